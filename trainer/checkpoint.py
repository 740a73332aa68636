"""Step-N checkpoint folders: atomic, checksummed, resumable (torchtitan's layout), written by
every rank in parallel and resumable on another number of ranks.

A checkpoint is written into ``.step-N.tmp`` and renamed to ``step-N`` only after every file,
and last of all ``meta.json`` (with the sha256 of every other file), is on disk. A folder without
a valid ``meta.json`` is therefore never a checkpoint: a kill during the write leaves only a
``.tmp`` folder, which the next save removes. Assumes the run directory is on a filesystem every
rank sees (a cluster's shared scratch), as torchtitan and Megatron do.

Files, and who writes them (all at the same time):
    model.safetensors   the full model's weights (rank 0)
    optimizer.pt        the synchroniser's replicated state: optimizer, SCAPE mask, ... (rank 1,
                        rank 0 on one process: the two large replicated files go out in parallel)
    rank-R.pt           each rank's own state (rank R): RNG states, SCAPE residual, sparse_avg's
                        copy and momentum, SDP's optimizer state
    meta.json           step, world size, data position, resolved config, checksums (rank 0, last)

Every rank hashes (while writing: one pass) and fsyncs its own files; rank 0 gathers the
checksums (a few bytes a rank) and seals. Rank 0 never reads another rank's file, so its share of
the write is the model and meta.json whatever the number of ranks. A rank that fails (a full disk:
ENOSPC or a quota, any OSError) while making the folder, writing its files or sealing reports it
in a gather, every rank raises the same CheckpointError, rank 0 removes the ``.tmp`` folder, and
the previous checkpoints, which rotation deletes only after a complete write, stay loadable.

The project's own format, not torch.distributed.checkpoint: DCP reshards tensors that are shards
of one global tensor (DTensor), but SCAPE's residual and sparse_avg's copies are per-rank values
of the full buffer, whose resharding is a mean (the synchronisers' ``load_resharded_state``), and
the checksums and atomic rename above would have to be rebuilt around DCP's own metadata. A
sharded optimizer (``optimizer.shard``) fits the same layout: each rank puts its partition of the
momentum and master weights, with the partition's bounds in the flat buffer, into its
``rank-R.pt``; ``optimizer.pt`` keeps the replicated rest; resuming on M ranks concatenates the
partitions by their bounds and re-slices them (``RankShards.read`` per old rank).

Elastic resume: a checkpoint written by N ranks loads on M != N. The replicated files load as
they are; each synchroniser combines the old ranks' files (``load_resharded_state``); new rank r
takes old rank r's RNG states, or fresh ones seeded from (seed, step, r) when r >= N. The data
position is the tokens consumed (meta ``data.tokens_consumed``), which do not depend on N.
"""
from __future__ import annotations

import errno
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any, Callable, Dict, Optional

import numpy as np
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from core.checkpoint import (MODEL_FILE, CheckpointError, RankShards, capture_rng, fsync_dir, rank_file,
                             read_meta, restore_rng, save_hashed, save_weights, seal, verify)
from core.distributed import DistEnv, barrier

STEP_DIR = re.compile(r"^step-(\d+)$")
OPTIMIZER_FILE = "optimizer.pt"
__all__ = ["CheckpointError", "Checkpointer", "latest_checkpoint", "list_checkpoints", "load_checkpoint",
           "read_meta", "save_checkpoint", "tokens_consumed", "verify_checkpoint"]
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


def replicated_writer(world_size: int) -> int:
    """The rank that writes ``optimizer.pt``: not rank 0 (busy with the model) when there is another."""
    return min(1, world_size - 1)


def _gather(obj: Any, world_size: int) -> list:
    if world_size == 1 or not dist.is_initialized():
        return [obj]
    out: list = [None] * world_size
    dist.all_gather_object(out, obj)
    return out


def _agreed(error: Optional[str], world_size: int) -> list:
    """Every rank's error (None where it has none), on every rank: no rank raises alone and leaves
    the others waiting in the next collective."""
    return [e for e in _gather(error, world_size) if e is not None]


def _attempt(fn: Callable[[], Any], rank: int, where: Optional[Path] = None) -> Optional[str]:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - every rank learns of it (``_agreed``) and raises
        return f"rank {rank}: {type(exc).__name__}: {exc}{_disk_full_note(exc, where)}"
    return None


def _disk_full_note(exc: Exception, where: Optional[Path]) -> str:
    """torch.save reports a full disk as a RuntimeError of its zip writer ("unexpected pos"), not
    as ENOSPC: say what the file system says, so the message names the cause."""
    if where is None or (isinstance(exc, OSError) and exc.errno == errno.ENOSPC):
        return ""
    try:
        free = shutil.disk_usage(where).free
    except OSError:
        return ""
    return f" [{os.strerror(errno.ENOSPC)}: {free:,} bytes free where {where} lies]" if free < (1 << 20) else ""


def _fresh_tmp(tmp: Path) -> None:
    if tmp.exists():
        shutil.rmtree(tmp)  # a write killed earlier
    tmp.mkdir(parents=True)


def _seal_and_publish(run_dir: Path, tmp: Path, final: Path, meta: Dict[str, Any], checksums: Dict[str, str],
                      keep_last: int) -> None:
    """Rank 0: meta.json last, the atomic rename, then the rotation (only of complete checkpoints)."""
    seal(tmp, meta, checksums=checksums)
    if final.exists():  # the same step saved again (e.g. a signal at a checkpoint step)
        shutil.rmtree(final)
    os.replace(tmp, final)
    fsync_dir(run_dir)
    for old in list_checkpoints(run_dir)[:-keep_last] if keep_last > 0 else []:
        shutil.rmtree(old, ignore_errors=True)


def _write_files(tmp: Path, sync, env: DistEnv) -> tuple:
    """This rank's files of the checkpoint: (their checksums, its error or None)."""
    model_state = sync.model_state_dict()  # collective for SDP: every rank calls it
    checksums: Dict[str, str] = {}

    def write() -> None:
        if env.is_main:
            save_weights(tmp, model_state)  # hashed and fsynced by rank 0's seal
        if env.rank == replicated_writer(env.world_size):
            checksums[OPTIMIZER_FILE] = save_hashed(sync.state_dict(), tmp / OPTIMIZER_FILE)
        checksums[rank_file(env.rank)] = save_hashed({"rng": capture_rng(), "sync": sync.local_state_dict()},
                                                     tmp / rank_file(env.rank))

    error = _attempt(write, env.rank, tmp)
    del model_state
    return checksums, error


def save_checkpoint(run_dir: Path, step: int, sync, env: DistEnv, meta: Dict[str, Any],
                    keep_last: int) -> Path:
    """Write ``run_dir/step-{step}`` atomically; every rank calls this (it has collectives).

    A write that fails on any rank (a full disk: ENOSPC, a quota, any OSError) fails on every rank
    with one CheckpointError; the partial folder is removed and the previous checkpoints are kept."""
    final, tmp = run_dir / f"step-{step}", run_dir / f".step-{step}.tmp"
    errors = _agreed(_attempt(lambda: _fresh_tmp(tmp), env.rank) if env.is_main else None, env.world_size)
    checksums, error = _write_files(tmp, sync, env) if not errors else ({}, None)
    reports = _gather((checksums, error), env.world_size)
    errors += [e for _, e in reports if e is not None]
    if not errors:
        written = {name: digest for sums, _ in reports for name, digest in sums.items()}
        errors = _agreed(_attempt(lambda: _seal_and_publish(run_dir, tmp, final, dict(meta, step=step,
                                                                                       world_size=env.world_size),
                                                            written, keep_last), env.rank)
                         if env.is_main else None, env.world_size)
    if errors:
        if env.is_main:
            shutil.rmtree(tmp, ignore_errors=True)  # every rank is done with it: the gathers above
        previous = latest_checkpoint(run_dir)
        raise CheckpointError(f"writing checkpoint {final} failed ({'; '.join(errors)}); its partial files are "
                              f"removed and the previous checkpoint is kept ({previous or 'none yet'}). Free space "
                              f"(or raise the quota) where {run_dir} lies and rerun with resume=auto")
    barrier()
    return final


def tokens_consumed(meta: Dict[str, Any], seq_len: int) -> int:
    """The training tokens a checkpoint's run had consumed: where its data stream continues.

    Counted in tokens, not per-rank indices, so it holds on any number of ranks. Checkpoints
    written before it was recorded: step x the global batch of their config."""
    config = meta.get("config") or {}
    saved_seq = (config.get("model") or {}).get("seq_len")
    if saved_seq is not None and int(saved_seq) != int(seq_len):
        raise CheckpointError(f"the checkpoint was trained on windows of model.seq_len={saved_seq}, this run "
                              f"uses {seq_len}: its data position is not a whole number of windows of the "
                              f"new length; resume with model.seq_len={saved_seq}")
    data = meta.get("data") or {}
    if "tokens_consumed" in data:
        return int(data["tokens_consumed"])
    return int(meta["step"]) * int(config["train"]["global_batch_tokens"])


def _fresh_rng(seed: int, step: int, rank: int) -> None:
    """RNG states for a rank the checkpoint has none for (elastic resume onto more ranks)."""
    value = (int(seed) * 1_000_003 + int(step)) * 4099 + int(rank)
    random.seed(value)
    np.random.seed(value % 2**32)
    torch.manual_seed(value)


def load_checkpoint(ckpt: Path, sync, env: DistEnv) -> Dict[str, Any]:
    """Restore model, synchroniser and this rank's RNG from ``ckpt``; returns its meta.

    Collective. A checkpoint of N ranks on M != N ranks is resharded (module docstring)."""
    meta = read_meta(ckpt)
    old_world = int(meta.get("world_size", 0))
    if old_world < 1:
        raise CheckpointError(f"{ckpt}/meta.json records no world_size; it is not a step checkpoint of this "
                              f"trainer (to start from its weights only, use train.init_from={ckpt})")
    verify(ckpt, meta, [MODEL_FILE, OPTIMIZER_FILE])
    try:
        sync.load_model_state_dict(load_file(str(ckpt / MODEL_FILE)))
    except (RuntimeError, KeyError) as exc:
        raise CheckpointError(f"the model in {ckpt} does not fit this run's model ({exc}); resume with the "
                              f"model config the run was started with") from None
    replicated = torch.load(ckpt / OPTIMIZER_FILE, map_location="cpu", weights_only=True)
    if old_world == env.world_size:
        verify(ckpt, meta, [rank_file(env.rank)])
        sync.load_state_dict(replicated)
        local = torch.load(ckpt / rank_file(env.rank), map_location="cpu", weights_only=True)
        sync.load_local_state_dict(local["sync"])
        restore_rng(local["rng"])
        return meta
    shards = RankShards(ckpt, meta, old_world)
    sync.load_resharded_state(replicated, shards)
    if env.rank < old_world:
        restore_rng(shards.rng(env.rank))
    else:
        _fresh_rng(meta.get("data", {}).get("seed", 0), int(meta["step"]), env.rank)
    if env.is_main:
        print(f"resumed {ckpt} (written by {old_world} ranks) on {env.world_size}", flush=True)
    return meta


class Checkpointer:
    """Writes the run's step-N checkpoints and decides when: every ``every`` steps (0 = never),
    at the last step and when the job stops. Mid-trouble (non-finite steps in a row) it writes no
    periodic checkpoint, so rotation never deletes the good ones. The weights saved are
    ``sync.model_state_dict()`` (e.g. sparse_avg's average of the ranks' copies), next to each
    rank's own training state, so the save runs outside ``sync.evaluation_weights()``."""

    def __init__(self, run_dir: Path, sync, env: DistEnv, every: int, keep_last: int,
                 meta: Callable[[int], Dict[str, Any]],
                 on_failure: Optional[Callable[[int, str], None]] = None) -> None:
        self.run_dir, self.sync, self.env = run_dir, sync, env
        self.every, self.keep_last, self.meta = every, keep_last, meta
        self.on_failure = on_failure  # records why the run stops (status.json), before the error ends it
        self.saved_at: Optional[int] = None

    def due(self, step: int, last: bool, stopping: bool, in_trouble: bool) -> bool:
        periodic = bool(self.every) and step % self.every == 0 and not in_trouble
        return periodic or last or stopping

    def save(self, step: int) -> Path:
        try:
            path = save_checkpoint(self.run_dir, step, self.sync, self.env, self.meta(step), self.keep_last)
        except CheckpointError as exc:
            if self.on_failure is not None:
                self.on_failure(step, str(exc))
            raise
        self.saved_at = step
        return path

    def maybe_save(self, step: int, last: bool, stopping: bool, in_trouble: bool) -> None:
        if self.due(step, last, stopping, in_trouble):
            self.save(step)
