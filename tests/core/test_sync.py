"""The dense synchroniser: DDP (overlapped with backward) equals the after-backward all-reduce;
the embedding tables' own lr."""
from __future__ import annotations

import pytest
import torch

from core.flat import embedding_weight_ids, param_groups
from core.optim import AdamS, DenseOptimizerConfig, build_optimizer
from core.sync import DenseAllReduce
from core.zero import ZeroDenseSynchronizer
from tests.dist_helpers import run_distributed
from tests.scape.helpers import TokenModel, batch, make_model

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


def _token_batch(step: int):
    ids = torch.randint(0, 16, (4, 3), generator=torch.Generator().manual_seed(step))
    return ids, ids[:, 0] % 3


@pytest.mark.parametrize("name", ["adamw", "adams"])
def test_the_embedding_tables_train_at_their_scaled_lr(name):
    """A parameter group's lr_scale k: along the schedule the table steps at k lr and the rest at lr, what
    the optimizer does with its lr set per group by hand."""
    from trainer.step import train_step

    k = 3.0
    cfg = DenseOptimizerConfig(name=name, lr=1e-2, weight_decay=0.1, param_groups=[{"match": "embedding", "lr_scale": k}])
    model, ref = TokenModel(), TokenModel()
    sync = DenseAllReduce(model, lambda ps: build_optimizer(ps, cfg, embeddings=embedding_weight_ids(model)))
    assert [group.get("lr_scale") for group in sync.optimizer.param_groups] == [None, None, k]
    groups = [{"params": [ref.head.weight], "weight_decay": 0.1}, {"params": [ref.head.bias], "weight_decay": 0.0},
              {"params": [ref.tokens.weight], "weight_decay": 0.1}]
    opt = (torch.optim.AdamW if name == "adamw" else AdamS)(groups, lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    for step, lr in enumerate([1e-2, 5e-3, 2e-3], 1):
        train_step(sync.train_module, sync, iter([_token_batch(step)]), 1, lr, 0.0, sync.comm)
        opt.zero_grad()
        ref(*_token_batch(step)).backward()
        for group, scale in zip(opt.param_groups, (1.0, 1.0, k)):
            group["lr"] = lr * scale
        opt.step()
    for (key, a), b in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=f"{key} differs")
    assert not torch.allclose(model.tokens.weight, TokenModel().tokens.weight), "the table never trained"


def _table(lr_scale: float, **more) -> list:
    return [{"match": "embedding", "lr_scale": lr_scale, **more}]


def test_the_tables_lr_scale_is_checked_and_resumes_by_the_config():
    model = TokenModel()
    tables = embedding_weight_ids(model)

    def sync_for(**overrides):
        cfg = DenseOptimizerConfig(name="adams", **overrides)
        return DenseAllReduce(model, lambda ps: build_optimizer(ps, cfg, embeddings=tables))

    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match=r"param_groups\[0\].lr_scale=.* must be a number > 0"):
            sync_for(param_groups=_table(bad))
    # an optimizer built without the tables (ZeRO-1's flat pieces, SDP's held parameters) refuses it
    with pytest.raises(ValueError, match=r"param_groups\[0\].lr_scale=2: this optimizer was built without the "
                                         r"model's embedding tables"):
        build_optimizer(list(model.parameters()), DenseOptimizerConfig(name="adams", param_groups=_table(2.0)))
    with pytest.raises(ValueError, match="built without the model's embedding tables"):
        ZeroDenseSynchronizer(model, DenseOptimizerConfig(name="adams", param_groups=_table(2.0)))
    # the config refuses it first: a sharded optimizer never holds whole tables
    with pytest.raises(ValueError, match=r"param_groups\[0\].lr_scale=2 is not supported with optimizer.shard=true"):
        DenseOptimizerConfig(name="adams", shard=True, param_groups=_table(2.0))
    scaled = sync_for(param_groups=_table(2.0))
    scaled.step(1e-2)
    with pytest.raises(ValueError, match="3 parameter groups, this run's 2"):
        sync_for().load_state_dict(scaled.state_dict())
    # another scale on resume: the run's config decides, as it does the lr
    resumed = sync_for(param_groups=_table(4.0))
    resumed.load_state_dict(scaled.state_dict())
    resumed.step(1e-2)
    assert resumed.optimizer.param_groups[2]["lr"] == pytest.approx(4e-2)


@pytest.mark.parametrize("groups,needle", [
    ([{"match": "embedding", "lr_scale": 2.0, "lr": 1e-3}],
     r"optimizer.param_groups\[0\].lr is not a field of a parameter group \(its fields: match, lr_scale, "
     r"step_bound, denominator_beta\): remove it"),
    ([{"match": "embedding", "lr_scale": 2.0}, {"match": "embedding", "lr_scale": 4.0}],
     "optimizer.param_groups holds 2 groups; one override group is supported"),
    ([{"lr_scale": 2.0}], r"optimizer.param_groups\[0\] has no match"),
    ([{"match": "norm", "lr_scale": 2.0}], r"optimizer.param_groups\[0\].match='norm' is not supported"),
    (_table(2.0, step_bound=4.47), r"optimizer.param_groups\[0\].step_bound=4.47 sets the bound on a local step "
                                   r"\(sparse_avg\), which optimizer=adams does not have"),
    (_table(2.0, denominator_beta=0.2), r"denominator_beta=0.2 sets the shared denominator's memory \(sparse_avg\), "
                                        r"which optimizer=adams does not have"),
])
def test_a_parameter_group_with_an_unknown_field_or_a_second_group_is_refused(groups, needle):
    """Through the config every optimizer is built from, as train.py's command line gives it."""
    from scape.config import optimizer_config

    with pytest.raises(ValueError, match=needle):
        optimizer_config(name="adams", param_groups=groups)

