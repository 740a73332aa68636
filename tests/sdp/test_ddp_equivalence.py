"""SDP on 2 gloo processes: with C = 1 every worker holds everything and SDP is DDP."""
from __future__ import annotations

from sdp.config import SDPConfig
from tests.dist_helpers import run_distributed
from tests.sdp._bodies import build_ddp, build_sdp, full_flat, tiny, train_step


def _full_coverage_equals_ddp(rank: int, world: int) -> None:
    for family, kind, masking, opt in [("llama", "block", "forward", "adamw"),
                                       ("llama", "neuron", "backward", "adams"),
                                       ("gpt", "neuron", "forward", "adamw")]:
        cfg = tiny(family)
        ddp_model, ddp = build_ddp(cfg, opt)
        model, sync = build_sdp(cfg, SDPConfig(kind=kind, coverage=1.0, masking=masking), rank, world, opt)
        assert len(sync.buckets) == 1, "with C = 1 everything shares one holder set: one bucket"
        norms = []
        for step in range(10):
            n_ddp = train_step(ddp_model, ddp, cfg, rank, step)
            n_sdp = train_step(model, sync, cfg, rank, step)
            norms.append((n_ddp, n_sdp))
        assert any(n > 1.0 for n, _ in norms), "clipping never engaged; the test would not cover it"
        for n_ddp, n_sdp in norms:
            assert abs(n_ddp - n_sdp) <= 1e-5 * max(1.0, n_ddp)
        want = full_flat(cfg, ddp_model.state_dict())
        got = full_flat(cfg, sync.model_state_dict())
        diff = float((want - got).abs().max())
        assert diff <= 1e-6, f"{family} {kind}/{masking}: SDP at C = 1 differs from DDP by {diff}"


def test_full_coverage_equals_ddp_after_10_steps():
    run_distributed(_full_coverage_equals_ddp, world_size=2)
