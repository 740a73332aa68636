"""Step-N checkpoint folders: atomic, checksummed, resumable (torchtitan's layout).

A checkpoint is written into ``.step-N.tmp`` and renamed to ``step-N`` only after every file,
and last of all ``meta.json`` (with the sha256 of every other file), is on disk. A folder without
a valid ``meta.json`` is therefore never a checkpoint: a kill during the write leaves only a
``.tmp`` folder, which the next save removes. Assumes the run directory is on a filesystem every
rank sees (a cluster's shared scratch), as torchtitan and Megatron do.

Files:
    model.safetensors   the full model's weights (rank 0)
    optimizer.pt        the synchroniser's replicated state: optimizer, SCAPE mask, ... (rank 0)
    rank-R.pt           each rank's own state: RNG states, SCAPE residual, SDP optimizer state
    meta.json           step, world size, data position, resolved config, checksums
"""
from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Any, Callable, Dict, Optional

import torch
from safetensors.torch import load_file

from core.checkpoint import (MODEL_FILE, CheckpointError, capture_rng, fsync_dir, fsync_file, read_meta,
                             restore_rng, save_weights, seal, verify)
from core.distributed import DistEnv, barrier

STEP_DIR = re.compile(r"^step-(\d+)$")
__all__ = ["CheckpointError", "Checkpointer", "latest_checkpoint", "list_checkpoints", "load_checkpoint",
           "read_meta", "save_checkpoint", "verify_checkpoint"]
verify_checkpoint = verify


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints (a ``meta.json`` present), oldest first."""
    if not run_dir.is_dir():
        return []
    found = []
    for child in run_dir.iterdir():
        m = STEP_DIR.match(child.name)
        if m and child.is_dir() and (child / "meta.json").is_file():
            found.append((int(m.group(1)), child))
    return [p for _, p in sorted(found)]


def latest_checkpoint(run_dir: Path) -> Optional[Path]:
    ckpts = list_checkpoints(run_dir)
    return ckpts[-1] if ckpts else None


def save_checkpoint(run_dir: Path, step: int, sync, env: DistEnv, meta: Dict[str, Any],
                    keep_last: int) -> Path:
    """Write ``run_dir/step-{step}`` atomically; every rank calls this (it has collectives)."""
    final = run_dir / f"step-{step}"
    tmp = run_dir / f".step-{step}.tmp"
    if env.is_main:
        if tmp.exists():
            shutil.rmtree(tmp)  # a write killed earlier
        tmp.mkdir(parents=True)
    barrier()
    model_state = sync.model_state_dict()  # collective for SDP: every rank calls it
    if env.is_main:
        save_weights(tmp, model_state)
        torch.save(sync.state_dict(), tmp / "optimizer.pt")
    torch.save({"rng": capture_rng(), "sync": sync.local_state_dict()}, tmp / f"rank-{env.rank}.pt")
    fsync_file(tmp / f"rank-{env.rank}.pt")
    barrier()
    if env.is_main:
        seal(tmp, dict(meta, step=step, world_size=env.world_size))
        if final.exists():  # the same step saved again (e.g. a signal at a checkpoint step)
            shutil.rmtree(final)
        os.replace(tmp, final)
        fsync_dir(run_dir)
        for old in list_checkpoints(run_dir)[:-keep_last] if keep_last > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    barrier()
    return final


def load_checkpoint(ckpt: Path, sync, env: DistEnv) -> Dict[str, Any]:
    """Restore model, synchroniser and this rank's RNG from ``ckpt``; returns its meta."""
    meta = read_meta(ckpt)
    if meta.get("world_size") != env.world_size:
        raise CheckpointError(f"checkpoint {ckpt} was written by {meta.get('world_size')} ranks but "
                              f"this run has {env.world_size}; resume with the same number of "
                              f"processes (the data order, SCAPE residuals and SDP plans are per rank)")
    rank_file = f"rank-{env.rank}.pt"
    verify(ckpt, meta, [MODEL_FILE, "optimizer.pt", rank_file])
    sync.load_model_state_dict(load_file(str(ckpt / MODEL_FILE)))
    sync.load_state_dict(torch.load(ckpt / "optimizer.pt", map_location="cpu", weights_only=True))
    local = torch.load(ckpt / rank_file, map_location="cpu", weights_only=True)
    sync.load_local_state_dict(local["sync"])
    restore_rng(local["rng"])
    return meta


class Checkpointer:
    """Writes the run's step-N checkpoints and decides when: every ``every`` steps (0 = never),
    at the last step and when the job stops. Mid-trouble (non-finite steps in a row) it writes no
    periodic checkpoint, so rotation never deletes the good ones. The weights saved are
    ``sync.model_state_dict()`` (e.g. sparse_avg's average of the ranks' copies), next to each
    rank's own training state, so the save runs outside ``sync.evaluation_weights()``."""

    def __init__(self, run_dir: Path, sync, env: DistEnv, every: int, keep_last: int,
                 meta: Callable[[int], Dict[str, Any]]) -> None:
        self.run_dir, self.sync, self.env = run_dir, sync, env
        self.every, self.keep_last, self.meta = every, keep_last, meta
        self.saved_at: Optional[int] = None

    def due(self, step: int, last: bool, stopping: bool, in_trouble: bool) -> bool:
        periodic = bool(self.every) and step % self.every == 0 and not in_trouble
        return periodic or last or stopping

    def save(self, step: int) -> Path:
        path = save_checkpoint(self.run_dir, step, self.sync, self.env, self.meta(step), self.keep_last)
        self.saved_at = step
        return path

    def maybe_save(self, step: int, last: bool, stopping: bool, in_trouble: bool) -> None:
        if self.due(step, last, stopping, in_trouble):
            self.save(step)
