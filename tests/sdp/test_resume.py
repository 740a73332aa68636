"""SDP checkpoints on 2 gloo processes: the full model is saved and re-sliced, resume is exact,
and state from another plan is refused; a 2-worker checkpoint resumes on 4 workers with every
optimizer moment re-sliced from its old holder."""
from __future__ import annotations

import math
from pathlib import Path

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


# ------------------------------------------------------------------ elastic: 2 workers -> 4

ELASTIC = [("neuron", "forward"), ("block", "backward")]


def _held_locations(sync, model):
    """(tensor the optimizer steps, full-model name, (dim, indices) or None) for this worker."""
    shadows = {id(s.held): s for s in sync.shadows}
    names = {id(p): n for n, p in model.named_parameters()}
    full_names = {id(p): n for n, p in model.named_parameters()}
    out = []
    for p in sync.params:
        if id(p) in shadows:
            s = shadows[id(p)]
            out.append((p, full_names[id(s.full)], (s.dim, s.indices)))
        else:
            out.append((p, names[id(p)], None))
    return out


def _full_moments(cfg, sync, model, key):
    """This worker's optimizer moment ``key`` at its full-model positions, NaN where it holds nothing."""
    from tests.sdp._bodies import full_shapes

    full = {n: torch.full(shape, float("nan")) for n, shape in full_shapes(cfg).items()}
    for p, name, where in _held_locations(sync, model):
        value = sync.optimizer.state[p][key]
        if where is None and sync.masking == "forward" and value.shape != full[name].shape:
            from models.subnet import scatter_state_dict

            scatter_state_dict({name: value}, full, cfg, sync.spec)
        elif where is None:
            full[name].copy_(value)
        else:
            full[name].index_copy_(where[0], where[1], value)
    return full


def _write_two(rank: int, world: int, tmp: str) -> None:
    from core.distributed import DistEnv
    from trainer.checkpoint import save_checkpoint

    env = DistEnv(rank=rank, world_size=world, local_rank=rank, device=torch.device("cpu"))
    for kind, masking in ELASTIC:
        cfg = tiny()
        model, sync = build_sdp(cfg, SDPConfig(kind=kind, coverage=0.5, masking=masking, groups_per_block=2),
                                rank, world, "adamw")
        for step in range(3):
            train_step(model, sync, cfg, rank, step)
        save_checkpoint(Path(tmp) / f"{kind}-{masking}", 3, sync, env, {"data": {"seed": 0}}, keep_last=1)
        torch.save({key: _full_moments(cfg, sync, model, key) for key in ("exp_avg", "exp_avg_sq")},
                   Path(tmp) / f"{kind}-{masking}-moments-{rank}.pt")


def _resume_on_four(rank: int, world: int, tmp: str) -> None:
    from core.distributed import DistEnv
    from trainer.checkpoint import load_checkpoint

    env = DistEnv(rank=rank, world_size=world, local_rank=rank, device=torch.device("cpu"))
    for kind, masking in ELASTIC:
        cfg = tiny()
        torch.manual_seed(99)
        from sdp import build_synchronizer

        sdp_cfg = SDPConfig(kind=kind, coverage=0.5, masking=masking, groups_per_block=2)
        model, sync = build_synchronizer(cfg, sdp_cfg, optimizer_cfg("adamw"), world, rank, torch.device("cpu"))
        load_checkpoint(Path(tmp) / f"{kind}-{masking}" / "step-3", sync, env)
        old = [torch.load(Path(tmp) / f"{kind}-{masking}-moments-{r}.pt", weights_only=True) for r in range(2)]
        for key in ("exp_avg", "exp_avg_sq"):
            mine = _full_moments(cfg, sync, model, key)
            for name, tensor in mine.items():
                held = ~tensor.isnan()
                expected = torch.where(old[0][key][name].isnan(), old[1][key][name], old[0][key][name])
                assert held.any() or name.startswith("blocks."), name
                assert torch.equal(tensor[held], expected[held]), f"{kind}/{masking} {key} {name}"
        assert all(int(sync.optimizer.state[p]["step"]) == 3 for p in sync.params)
        assert math.isfinite(train_step(model, sync, cfg, rank, 3))


def test_elastic_resume_reslices_the_optimizer_state_onto_four_workers(tmp_path):
    """Each new worker's AdamW moments are the old holders' values of the tensors it now holds."""
    run_distributed(_write_two, world_size=2, args=(str(tmp_path),))
    run_distributed(_resume_on_four, world_size=4, args=(str(tmp_path),))
