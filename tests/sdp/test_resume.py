"""SDP checkpoints on 2 gloo processes: the full model is saved and re-sliced, resume is exact,
and state from another plan is refused."""
from __future__ import annotations

import torch
import torch.distributed as dist

from sdp.config import SDPConfig
from tests.dist_helpers import run_distributed
from tests.sdp._bodies import build_sdp, full_flat, held_values_flat, optimizer_cfg, tiny, train_step


def _exact_resume(rank: int, world: int, tmp: str) -> None:
    for kind, masking in [("neuron", "forward"), ("block", "backward")]:
        cfg = tiny()
        sdp_cfg = SDPConfig(kind=kind, coverage=0.5, masking=masking, groups_per_block=2)
        model, sync = build_sdp(cfg, sdp_cfg, rank, world, "adams")
        for step in range(3):
            train_step(model, sync, cfg, rank, step)
        # the trainer's checkpoint: full model (rank 0 writes it), replicated and per-rank state
        full = {k: v.clone() for k, v in sync.model_state_dict().items()}
        if rank == 0:
            torch.save({"model": full, "replicated": sync.state_dict()}, f"{tmp}/{kind}-{masking}-shared.pt")
        torch.save(sync.local_state_dict(), f"{tmp}/{kind}-{masking}-rank{rank}.pt")
        mine_at_save = held_values_flat(cfg, model, sync.spec) if masking == "forward" else \
            full_flat(cfg, model.state_dict())
        for step in range(3, 6):
            train_step(model, sync, cfg, rank, step)
        straight = full_flat(cfg, sync.model_state_dict())
        dist.barrier()

        torch.manual_seed(99)  # a different init: everything must come from the checkpoint
        from sdp import build_synchronizer
        model2, sync2 = build_synchronizer(cfg, sdp_cfg, optimizer_cfg("adams"), world, rank, torch.device("cpu"))
        shared = torch.load(f"{tmp}/{kind}-{masking}-shared.pt", weights_only=True)
        sync2.load_model_state_dict(shared["model"])
        sync2.load_state_dict(shared["replicated"])
        sync2.load_local_state_dict(torch.load(f"{tmp}/{kind}-{masking}-rank{rank}.pt", weights_only=True))
        # the checkpoint holds the full model; each worker re-slices its own part on load
        mine_loaded = held_values_flat(cfg, model2, sync2.spec) if masking == "forward" else \
            full_flat(cfg, model2.state_dict())
        assert torch.equal(mine_loaded.nan_to_num(7.0), mine_at_save.nan_to_num(7.0))
        for step in range(3, 6):
            train_step(model2, sync2, cfg, rank, step)
        resumed = full_flat(cfg, sync2.model_state_dict())
        assert torch.equal(straight, resumed), f"{kind}/{masking}: resume is not exact " \
            f"(max diff {float((straight - resumed).abs().max())})"


def _wrong_checkpoint_plan_is_rejected(rank: int, world: int) -> None:
    cfg = tiny()
    _, sync = build_sdp(cfg, SDPConfig(kind="block", coverage=0.5), rank, world)
    _, other = build_sdp(cfg, SDPConfig(kind="block", coverage=1.0), rank, world)
    try:
        other.load_state_dict(sync.state_dict())
    except ValueError as err:
        assert "another SDP plan" in str(err)
    else:
        raise AssertionError("a checkpoint of another plan was accepted")
    try:
        build_sdp(cfg, SDPConfig(kind="block", coverage=0.5, workers=4), rank, world)
    except ValueError as err:
        assert "sdp.workers=4 does not match the world size 2" in str(err)
    else:
        raise AssertionError("a plan for 4 workers was accepted on 2 ranks")


def _resume_and_mismatches(rank: int, world: int, tmp: str) -> None:
    _exact_resume(rank, world, tmp)
    _wrong_checkpoint_plan_is_rejected(rank, world)


def test_exact_resume_and_mismatched_plans_rejected(tmp_path):
    # one spawn for both: starting ranks costs more here than the checks themselves
    run_distributed(_resume_and_mismatches, world_size=2, args=(str(tmp_path),))
