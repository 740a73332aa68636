"""2 gloo ranks: density 1 equals dense AdamS; identical data equals one rank."""
import math

import torch

from scape.adams import AdamS
from scape.synchronizer import ScapeSynchronizer
from tests.dist_helpers import run_distributed
from tests.scape.helpers import make_model, scape_config, train
from trainer.grad_sync import DenseAllReduce, param_groups


def _gathered(tensor: torch.Tensor, world: int):
    parts = [torch.empty_like(tensor) for _ in range(world)]
    dist.all_gather(parts, tensor.contiguous())
    return parts


def _sparsity_zero_equals_dense_adams(rank: int, world: int) -> None:
    cfg = scape_config(sparsity=0.0, weight_decay=0.1)
    for transport in ("bitmap",):  # indices: covered by the byte and round-trip tests
        cfg.mask_transport = transport
        model, reference = make_model(), make_model()
        sync = ScapeSynchronizer(model, cfg)
        dense = DenseAllReduce(reference, lambda ps: AdamS(param_groups(ps, 0.1), lr=1e-2,
                                                           betas=(0.9, 0.95), eps=1e-8))
        for step in range(10):
            # max_norm small enough that clipping is active on some steps
            train(model, sync, 1, rank, start=step, max_norm=0.5, accum=1)
            train(reference, dense, 1, rank, start=step, max_norm=0.5, accum=1)
            for (name, p), q in zip(model.named_parameters(), reference.parameters()):
                torch.testing.assert_close(p, q, rtol=0, atol=1e-6, msg=f"{name} step {step + 1}")
        assert sync.mask.numel() == sync.layout.padded_numel  # density 1: the sparse path ran


def test_sparsity_zero_equals_dense_adams_with_allreduced_gradients():
    run_distributed(_sparsity_zero_equals_dense_adams, world_size=2)


def _identical_data(rank: int, world: int, out: str) -> None:
    model = make_model()
    sync = ScapeSynchronizer(model, scape_config(sparsity=0.9))
    losses = train(model, sync, 6, rank=0, accum=1)  # every rank reads rank 0's data
    if rank == 0:
        torch.save({"params": sync.flat.data.clone(), "losses": losses}, out)


def test_identical_data_on_both_ranks_equals_single_rank(tmp_path):
    out = str(tmp_path / "two_ranks.pt")
    run_distributed(_identical_data, world_size=2, args=(out,))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the workers: the same summation order in the matmuls
    try:
        model = make_model()
        sync = ScapeSynchronizer(model, scape_config(sparsity=0.9), num_partitions=2)
        losses = train(model, sync, 6, rank=0, accum=1)
    finally:
        torch.set_num_threads(threads)
    two = torch.load(out)
    for a, b in zip(losses, two["losses"]):
        assert math.isclose(a, b, rel_tol=0, abs_tol=1e-6), (losses, two["losses"])
    torch.testing.assert_close(sync.flat.data, two["params"], rtol=0, atol=1e-6)


