"""2 gloo ranks: SCAPE at density 1 equals dense AdamS with all-reduced gradients."""
import torch

from core.optim import AdamS
from scape.synchronizer import ScapeSynchronizer
from tests.dist_helpers import run_distributed
from tests.scape.helpers import TokenModel, make_model, scape_config, train
from core.flat import embedding_weight_ids, param_groups
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


def _table_lr_at_sparsity_zero_equals_dense_adams(rank: int, world: int) -> None:
    """A parameter group's lr_scale k (optimizer.param_groups): SCAPE at density 1 (its dense first step, then the lazy
    rule on every coordinate) equals dense AdamS whose table group trains at k lr, decay included."""
    from trainer.step import train_step

    k = 4.0
    model, reference = TokenModel(), TokenModel()
    sync = ScapeSynchronizer(model, scape_config(sparsity=0.0, weight_decay=0.1,
                                                param_groups=[{"match": "embedding", "lr_scale": k}]))
    dense = DenseAllReduce(reference, lambda ps: AdamS(param_groups(ps, 0.1, embedding_weight_ids(reference), k),
                                                       lr=1e-2, betas=(0.9, 0.95), eps=1e-8))
    for step in range(1, 9):
        ids = torch.randint(0, 16, (4, 3), generator=torch.Generator().manual_seed(100 * step + rank))
        for m, s in ((model, sync), (reference, dense)):
            train_step(s.train_module, s, iter([(ids, ids[:, 0] % 3)]), 1, 1e-2 / step, 0.5, s.comm)
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            # the table's entries are N(0, 1), up to ~3: a few float32 ulps of the k-scaled decay there
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-6, msg=lambda m: f"{name} step {step}: {m}")
    assert sync.mask.numel() == sync.layout.padded_numel
    assert not torch.allclose(model.tokens.weight, TokenModel().tokens.weight, atol=1e-2), "the table barely moved"


def test_table_lr_scale_at_sparsity_zero_equals_dense_adams_with_a_table_group():
    run_distributed(_table_lr_at_sparsity_zero_equals_dense_adams, world_size=2)
