"""2 gloo ranks: a resumed run gives the losses and parameters of an uninterrupted one."""
import io
import math

import torch

from scape.synchronizer import ScapeSynchronizer
from tests.dist_helpers import run_distributed
from tests.scape.helpers import make_model, scape_config, train


def roundtrip(obj):
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def _resume(rank: int, world: int) -> None:
    for overrides in (dict(sparsity=0.9),
                      dict(sparsity=0.99, offload_residual=True, value_dtype="bf16",
                           stale_scale_cap=4),
                      dict(sparsity=0.9, score_timing="post_step", stale_scale="lr_sum",
                           stale_scale_cap=0, sparsity_warmup_steps=3)):
        _resume_one(rank, overrides)


def _resume_one(rank: int, overrides: dict) -> None:
    cfg = scape_config(**overrides)
    model = make_model()
    sync = ScapeSynchronizer(model, cfg, residual_chunk_numel=900)
    uninterrupted = train(model, sync, 8, rank)
    final = sync.flat.data.clone()

    model = make_model()
    sync = ScapeSynchronizer(model, cfg, residual_chunk_numel=900)
    first = train(model, sync, 4, rank)
    saved = roundtrip({"model": sync.model_state_dict(), "replicated": sync.state_dict(),
                       "local": sync.local_state_dict()})
    model = make_model(seed=123)  # different initial weights: everything must come from the files
    sync = ScapeSynchronizer(model, cfg, residual_chunk_numel=900)
    sync.load_model_state_dict(saved["model"])
    sync.load_state_dict(saved["replicated"])
    sync.load_local_state_dict(saved["local"])
    second = train(model, sync, 4, rank, start=4)
    for a, b in zip(first + second, uninterrupted):
        assert math.isclose(a, b, rel_tol=0, abs_tol=1e-6), (first + second, uninterrupted)
    torch.testing.assert_close(sync.flat.data, final, rtol=0, atol=1e-6)


def test_exact_resume_through_state_dicts():
    """Plain; offloaded residual with a bf16 payload and staleness counters; post-step score with
    lr-sum catch-up and a sparsity warm-up."""
    run_distributed(_resume, world_size=2)
