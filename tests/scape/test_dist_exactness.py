"""2 gloo ranks: SCAPE at density 1 equals dense AdamS with all-reduced gradients."""
import torch

from core.optim import AdamS
from scape.synchronizer import ScapeSynchronizer
from tests.dist_helpers import run_distributed
from tests.scape.helpers import make_model, scape_config, train
from core.flat import param_groups
from core.sync import DenseAllReduce


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
