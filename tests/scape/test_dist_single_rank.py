"""2 gloo ranks with identical data equal a single-rank run with the same partitioning."""
import math

import torch

from scape.synchronizer import ScapeSynchronizer
from tests.dist_helpers import run_distributed
from tests.scape.helpers import make_model, scape_config, train


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


