"""The dense synchroniser: DDP (overlapped with backward) equals the after-backward all-reduce."""
from __future__ import annotations

import pytest
import torch

from core.flat import param_groups
from core.optim import AdamS
from core.sync import DenseAllReduce
from tests.dist_helpers import run_distributed
from tests.scape.helpers import batch, make_model

STEPS, ACCUM = 4, 3


def _optimizer(name: str):
    if name == "adamw":
        return lambda ps: torch.optim.AdamW(param_groups(ps, 0.1), lr=1e-2, betas=(0.9, 0.95))
    return lambda ps: AdamS(param_groups(ps, 0.1), lr=1e-2, betas=(0.9, 0.95))


def _run(grad_sync: str, optimizer: str, rank: int):
    from trainer.step import train_step

    model = make_model()
    sync = DenseAllReduce(model, _optimizer(optimizer), grad_sync=grad_sync)
    losses, norms, grad_bytes = [], [], []
    for step in range(1, STEPS + 1):
        sync.comm.counter.reset()
        micro = iter([batch(rank, step, m) for m in range(ACCUM)])
        result = train_step(sync.train_module, sync, micro, ACCUM, 1e-2, 0.5, sync.comm, 2)
        losses.append(result.loss)
        norms.append(result.grad_norm)
        grad_bytes.append(sync.comm.counter.bytes["grad_allreduce"])
    return model, sync, losses, norms, grad_bytes


def _body_equal(rank: int, world: int, optimizer: str) -> None:
    ddp_model, ddp, ddp_losses, ddp_norms, ddp_bytes = _run("ddp", optimizer, rank)
    ref_model, ref, ref_losses, ref_norms, ref_bytes = _run("after_backward", optimizer, rank)
    assert ddp.ddp is not None and ref.ddp is None
    assert ddp_bytes == ref_bytes and ref_bytes[0] > 0, (ddp_bytes, ref_bytes)
    torch.testing.assert_close(torch.tensor(ddp_losses), torch.tensor(ref_losses), rtol=0, atol=1e-6)
    torch.testing.assert_close(torch.tensor(ddp_norms), torch.tensor(ref_norms), rtol=0, atol=1e-6)
    for (name, a), b in zip(ddp_model.named_parameters(), ref_model.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=f"{name} differs")
        assert not torch.equal(a, make_model().state_dict()[name]), f"{name} never trained"
    # the replicas agree across ranks too
    flat = torch.cat([p.detach().reshape(-1) for p in ddp_model.parameters()])
    other = flat.clone()
    torch.distributed.broadcast(other, src=0)
    assert torch.equal(flat, other)


@pytest.mark.parametrize("optimizer", ["adamw", "adams"])
def test_ddp_equals_after_backward_with_accumulation(optimizer):
    run_distributed(_body_equal, world_size=2, args=(optimizer,))


def _body_bypass(rank: int, world: int) -> None:
    from trainer.step import train_step

    model = make_model()
    sync = DenseAllReduce(model, _optimizer("adamw"), grad_sync="ddp")
    with pytest.raises(RuntimeError, match="sync.train_module"):
        train_step(sync.model, sync, iter([batch(rank, 1)]), 1, 1e-2, 0.5, sync.comm, 2)


def test_ddp_refuses_a_forward_that_bypasses_the_wrapper():
    run_distributed(_body_bypass, world_size=2)


def test_grad_sync_names_its_choices():
    with pytest.raises(ValueError, match="optimizer.grad_sync must be ddp or after_backward"):
        DenseAllReduce(make_model(), _optimizer("adamw"), grad_sync="overlap")


def _body_device_skip(rank: int, world: int) -> None:
    """A non-finite loss on one rank: both ranks skip the fused AdamW update on the device, without
    the loop reading the flag, and the optimizer's step count does not advance."""
    from trainer.step import train_step

    model = make_model()
    sync = DenseAllReduce(model, lambda ps: torch.optim.AdamW(param_groups(ps, 0.1), lr=1e-2, fused=True),
                          grad_sync="ddp")
    assert sync.skips_on_device
    micro = iter([batch(rank, 1)])
    train_step(sync.train_module, sync, micro, 1, 1e-2, 0.5, sync.comm, 2).read()
    before = [p.detach().clone() for p in model.parameters()]
    steps_before = [sync.optimizer.state[p]["step"].clone() for p in model.parameters()]
    x, y = batch(rank, 2)
    if rank == 1:
        x = x * float("nan")
    result = train_step(sync.train_module, sync, iter([(x, y)]), 1, 1e-2, 0.5, sync.comm, 2)
    assert result.nonfinite and result.grad_norm != result.grad_norm  # NaN: skipped before any use
    for p, b, s in zip(model.parameters(), before, steps_before):
        assert torch.equal(p.detach(), b) and torch.equal(sync.optimizer.state[p]["step"], s)
    result = train_step(sync.train_module, sync, iter([batch(rank, 3)]), 1, 1e-2, 0.5, sync.comm, 2)
    assert not result.nonfinite and all(not torch.equal(p.detach(), b) for p, b in zip(model.parameters(), before))


def test_fused_adamw_skips_a_nonfinite_step_on_the_device():
    run_distributed(_body_device_skip, world_size=2)
