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

import hashlib
import json
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any, Callable, Dict, Optional

import torch
from safetensors.torch import load_file, save_file

from core.distributed import DistEnv, barrier

STEP_DIR = re.compile(r"^step-(\d+)$")


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or corrupted."""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def rng_state() -> Dict[str, Any]:
    state: Dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


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
        save_file({k: v.detach().to("cpu").contiguous().clone() for k, v in model_state.items()},
                  str(tmp / "model.safetensors"))
        torch.save(sync.state_dict(), tmp / "optimizer.pt")
    torch.save({"rng": rng_state(), "sync": sync.local_state_dict()}, tmp / f"rank-{env.rank}.pt")
    _fsync_file(tmp / f"rank-{env.rank}.pt")
    barrier()
    if env.is_main:
        files = sorted(p.name for p in tmp.iterdir())
        checksums = {name: _sha256(tmp / name) for name in files}
        for name in files:
            _fsync_file(tmp / name)
        record = dict(meta, step=step, world_size=env.world_size, files=checksums)
        meta_tmp = tmp / "meta.json.tmp"
        meta_tmp.write_text(json.dumps(record, indent=2, default=str))
        _fsync_file(meta_tmp)
        os.replace(meta_tmp, tmp / "meta.json")
        if final.exists():  # the same step saved again (e.g. a signal at a checkpoint step)
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(run_dir)
        for old in list_checkpoints(run_dir)[:-keep_last] if keep_last > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    barrier()
    return final


def read_meta(ckpt: Path) -> Dict[str, Any]:
    meta_path = ckpt / "meta.json"
    if not meta_path.is_file():
        raise CheckpointError(f"{ckpt} is not a complete checkpoint (no meta.json); "
                              f"pass resume=auto to take the newest complete one")
    try:
        return json.loads(meta_path.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{meta_path} is corrupted ({exc}); delete {ckpt} to resume from "
                              f"the previous checkpoint") from None


def verify_checkpoint(ckpt: Path, meta: Dict[str, Any], names: list[str]) -> None:
    """Compare the sha256 of ``names`` with meta.json's; never load a silently damaged file."""
    for name in names:
        path = ckpt / name
        expected = meta.get("files", {}).get(name)
        if expected is None or not path.is_file():
            raise CheckpointError(f"checkpoint {ckpt} lacks {name} or meta.json does not record it; "
                                  f"delete {ckpt} to resume from the previous checkpoint")
        actual = _sha256(path)
        if actual != expected:
            raise CheckpointError(f"checkpoint file {path} is corrupted (sha256 {actual[:12]}… but "
                                  f"meta.json records {expected[:12]}…); delete {ckpt} to resume "
                                  f"from the previous checkpoint")


def load_checkpoint(ckpt: Path, sync, env: DistEnv) -> Dict[str, Any]:
    """Restore model, synchroniser and this rank's RNG from ``ckpt``; returns its meta."""
    meta = read_meta(ckpt)
    if meta.get("world_size") != env.world_size:
        raise CheckpointError(f"checkpoint {ckpt} was written by {meta.get('world_size')} ranks but "
                              f"this run has {env.world_size}; resume with the same number of "
                              f"processes (the data order, SCAPE residuals and SDP plans are per rank)")
    rank_file = f"rank-{env.rank}.pt"
    verify_checkpoint(ckpt, meta, ["model.safetensors", "optimizer.pt", rank_file])
    sync.load_model_state_dict(load_file(str(ckpt / "model.safetensors")))
    sync.load_state_dict(torch.load(ckpt / "optimizer.pt", map_location="cpu", weights_only=True))
    local = torch.load(ckpt / rank_file, map_location="cpu", weights_only=True)
    sync.load_local_state_dict(local["sync"])
    set_rng_state(local["rng"])
    return meta


class Checkpointer:
    """Writes the run's step-N checkpoints and decides when: every ``every`` steps (0 = never),
    at the last step and when the job stops. Mid-trouble (non-finite steps in a row) it writes no
    periodic checkpoint, so rotation never deletes the good ones. The model holds the weights to
    save inside ``sync.evaluation_weights()``."""

    def __init__(self, run_dir: Path, sync, env: DistEnv, every: int, keep_last: int,
                 meta: Callable[[int], Dict[str, Any]]) -> None:
        self.run_dir, self.sync, self.env = run_dir, sync, env
        self.every, self.keep_last, self.meta = every, keep_last, meta
        self.saved_at: Optional[int] = None

    def due(self, step: int, last: bool, stopping: bool, in_trouble: bool) -> bool:
        periodic = bool(self.every) and step % self.every == 0 and not in_trouble
        return periodic or last or stopping

    def save(self, step: int) -> Path:
        with self.sync.evaluation_weights():
            path = save_checkpoint(self.run_dir, step, self.sync, self.env, self.meta(step), self.keep_last)
        self.saved_at = step
        return path

    def maybe_save(self, step: int, last: bool, stopping: bool, in_trouble: bool) -> None:
        if self.due(step, last, stopping, in_trouble):
            self.save(step)
