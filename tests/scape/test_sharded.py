"""Sharded SCAPE (optimizer.shard=true) equals replicated SCAPE, with 1/N of its optimizer state.

2 and 4 gloo ranks, 2 micro-batches per step (accumulation), the study's rule and the spec's, the
options that touch the optimizer state (AdamW base, staleness counters, bf16 payload, offloaded
residual, dense warm-up), and an N -> N resume through the state dicts.
"""
import pytest
import torch

from scape import build_synchronizer
from scape.sharded import ShardedScapeSynchronizer
from scape.synchronizer import ScapeSynchronizer
from tests.dist_helpers import run_distributed
from tests.scape.helpers import make_model, scape_config, train
from tests.scape.test_dist_resume import roundtrip

CONFIGS = (
    dict(sparsity=0.9),  # the study's rule: post-step score, lr-sum catch-up capped at 32
    dict(sparsity=0.9, score_timing="pre_send", stale_scale="steps", stale_scale_cap=1,
         dense_warmup_steps=3),  # the spec's rule, three dense steps (ZeRO-1's path)
    dict(sparsity=0.99, value_dtype="bf16", offload_residual=True, base="adamw", stale_scale_cap=4),
    dict(sparsity=0.8, sparsity_warmup_steps=3, mask_transport="indices"),
)
STEPS = 8


def _equal_to_replicated(rank: int, world: int) -> None:
    for overrides in CONFIGS:
        cfg = scape_config(**overrides)
        replicated_model, sharded_model = make_model(), make_model()
        replicated = ScapeSynchronizer(replicated_model, cfg, residual_chunk_numel=700)
        sharded = ShardedScapeSynchronizer(sharded_model, cfg, residual_chunk_numel=700)
        shard = sharded.shard
        for step in range(STEPS):
            # max_norm small enough that clipping acts on some steps
            a = train(replicated_model, replicated, 1, rank, start=step, max_norm=0.3)
            b = train(sharded_model, sharded, 1, rank, start=step, max_norm=0.3)
            assert abs(a[0] - b[0]) <= 1e-6, (overrides, step, a, b)
            torch.testing.assert_close(sharded.flat.data, replicated.flat.data, rtol=0, atol=1e-6,
                                       msg=f"{overrides} parameters, step {step + 1}")
            torch.testing.assert_close(sharded.optimizer.momentum, replicated.optimizer.momentum[shard],
                                       rtol=0, atol=1e-6, msg=f"{overrides} momentum, step {step + 1}")
            torch.testing.assert_close(sharded.residual.cpu_copy(), replicated.residual.cpu_copy(),
                                       rtol=0, atol=1e-6, msg=f"{overrides} residual, step {step + 1}")
        assert torch.equal(sharded.mask, replicated.mask), overrides
        # the state is the shard's: 1/N of the replicated buffers
        assert sharded.optimizer.momentum.numel() * world == replicated.optimizer.momentum.numel()
        if cfg.base == "adamw":
            assert sharded.optimizer.second_moment.numel() * world == sharded.layout.padded_numel
        if cfg.stale_scale_cap != 1:
            assert sharded.optimizer.last_sent.numel() * world == sharded.layout.padded_numel


def test_sharded_equals_replicated_on_2_ranks():
    run_distributed(_equal_to_replicated, world_size=2)


def test_sharded_equals_replicated_on_4_ranks():
    run_distributed(_equal_to_replicated, world_size=4)


def _bytes_no_more_than_the_all_reduce(rank: int, world: int) -> None:
    cfg = scape_config(sparsity=0.9, dense_warmup_steps=2)
    replicated_model, sharded_model = make_model(), make_model()
    replicated = ScapeSynchronizer(replicated_model, cfg)
    sharded = ShardedScapeSynchronizer(sharded_model, cfg)
    for step in range(4):
        replicated.comm.counter.reset()
        sharded.comm.counter.reset()
        train(replicated_model, replicated, 1, rank, start=step)
        train(sharded_model, sharded, 1, rank, start=step)
        old, new = replicated.comm.counter.bytes, sharded.comm.counter.bytes
        assert new["control"] == old["control"]
        assert new.get("scape_mask", 0.0) == old.get("scape_mask", 0.0)  # the mask as today
        assert new["grad_norm"] == 2.0 * (world - 1) / world * 8  # the one fp64 norm scalar
        if step < 2:  # dense: reduce-scatter + all-gather = the all-reduce
            assert new["grad_reducescatter"] + new["param_allgather"] == old["grad_allreduce"] > 0
        else:
            assert new["scape_values"] + new["scape_params"] == old["scape_values"] > 0
            assert new["scape_values"] == new["scape_params"]  # fp32 both ways: half each
        assert set(new) - set(old) <= {"grad_norm", "grad_reducescatter", "param_allgather",
                                       "scape_params"}


def test_sharded_bytes_equal_the_replicated_all_reduce_plus_the_norm_scalar():
    run_distributed(_bytes_no_more_than_the_all_reduce, world_size=2)


def _resume(rank: int, world: int) -> None:
    for overrides in (CONFIGS[0], CONFIGS[2]):
        cfg = scape_config(**overrides)
        model = make_model()
        sync = ShardedScapeSynchronizer(model, cfg, residual_chunk_numel=700)
        uninterrupted = train(model, sync, 8, rank)
        final = sync.flat.data.clone()

        model = make_model()
        sync = ShardedScapeSynchronizer(model, cfg, residual_chunk_numel=700)
        first = train(model, sync, 4, rank)
        saved = roundtrip({"model": sync.model_state_dict(), "replicated": sync.state_dict(),
                           "local": sync.local_state_dict()})
        assert "momentum" not in saved["replicated"]["optimizer"]  # rank 0's file holds no shard
        model = make_model(seed=123)  # everything must come from the files
        sync = ShardedScapeSynchronizer(model, cfg, residual_chunk_numel=700)
        sync.load_model_state_dict(saved["model"])
        sync.load_state_dict(saved["replicated"])
        sync.load_local_state_dict(saved["local"])
        second = train(model, sync, 4, rank, start=4)
        assert first + second == uninterrupted, (overrides, first + second, uninterrupted)
        assert torch.equal(sync.flat.data, final), overrides

        # a checkpoint of the other kind is refused, naming the key to set
        replicated = ScapeSynchronizer(make_model(), cfg)
        with pytest.raises(ValueError, match="optimizer.shard=true"):
            replicated.load_state_dict(saved["replicated"])
        with pytest.raises(ValueError, match="optimizer.shard=false"):
            sync.load_state_dict(replicated.state_dict())
        with pytest.raises(ValueError, match="optimizer.shard=false"):
            sync.load_local_state_dict(replicated.local_state_dict())


def test_sharded_resume_n_to_n_is_bit_exact():
    run_distributed(_resume, world_size=2)


def test_single_rank_sharded_is_replicated_scape():
    cfg = scape_config(sparsity=0.9)
    a_model, b_model = make_model(), make_model()
    a = ScapeSynchronizer(a_model, cfg, num_partitions=4)
    b = ShardedScapeSynchronizer(b_model, cfg, num_partitions=4)
    assert train(a_model, a, 5, 0) == pytest.approx(train(b_model, b, 5, 0), rel=0, abs=1e-6)
    torch.testing.assert_close(b.flat.data, a.flat.data, rtol=0, atol=1e-6)
    assert isinstance(build_synchronizer(make_model(), scape_config(shard=True)), ShardedScapeSynchronizer)


def test_refusals_name_the_setting():
    with pytest.raises(ValueError, match="optimizer.update=lazy"):
        ShardedScapeSynchronizer(make_model(), scape_config(update="all", stale_scale_cap=1))
    with pytest.raises(ValueError, match="sparse_avg"):
        build_synchronizer(make_model(), scape_config(name="sparse_avg", shard=True))


def _nonfinite_step_is_skipped_alike(rank: int, world: int) -> None:
    # the gradient is poisoned after backward, where an overlapped all-reduce would already have
    # sent it: compare with replicated SCAPE's unoverlapped path (sharded SCAPE never overlaps)
    cfg = scape_config(sparsity=0.9, overlap_backward=False)
    runs = []
    for cls in (ScapeSynchronizer, ShardedScapeSynchronizer):
        model = make_model()
        sync = cls(model, cfg)

        def poison(step: int, sync=sync) -> None:
            if step == 4 and rank == world - 1:  # one rank's gradient turns non-finite
                sync.flat.grad.fill_(float("nan"))

        losses = train(model, sync, 7, rank, before_reduce=poison)
        assert sync.step_count == 6, "the poisoned step is skipped on every rank"
        assert torch.isfinite(sync.flat.data).all() and torch.isfinite(sync.residual.cpu_copy()).all()
        runs.append((losses, sync.flat.data.clone()))
    assert runs[0][0] == pytest.approx(runs[1][0], rel=0, abs=1e-6)
    torch.testing.assert_close(runs[1][1], runs[0][1], rtol=0, atol=1e-6)


def test_a_non_finite_step_is_skipped_and_rolled_back_as_replicated_scape_does():
    run_distributed(_nonfinite_step_is_skipped_alike, world_size=2)
