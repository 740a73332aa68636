"""The checkpoint format, written, verified and read in one place.

A checkpoint folder holds ``model.safetensors`` (the full model's weights, our parameter names),
any other state files, and last of all ``meta.json``: what the writer records (step, the resolved
config or at least ``config.model``, the tokenizer's path, ...) plus the sha256 of every other file
under ``files``. Readers check those checksums before they load anything, so a silently damaged
file is never used. A file written by another process (a rank's own shard) is hashed and fsynced
by its writer (``save_hashed``) and its checksum handed to ``seal``, which then never reads it.
The trainer's step-N folders (trainer/checkpoint.py) add the optimizer's and every rank's state;
an HF import (models/hf.py) writes a weights-only folder a run starts from
with ``train.init_from=DIR``.

A checkpoint written by N ranks holds one ``rank-R.pt`` per rank (``rank_file``); ``RankShards``
reads them back on another number of ranks M (elastic resume), each file read by one new rank and
its checksum verified first, and ``RankShards.mean`` combines them with one all-reduce.

Also here: the one capture and restore of the RNG states (python, numpy, torch, CUDA).
"""
from __future__ import annotations

import hashlib
import json
import os
import random
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, Mapping, Optional, Tuple

import numpy as np
import torch
from safetensors.torch import load_file, save_file

MODEL_FILE = "model.safetensors"
META_FILE = "meta.json"


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or corrupted."""


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ------------------------------------------------------------------------------------- write
def save_weights(folder: Path, state_dict: Mapping[str, torch.Tensor]) -> None:
    """``folder/model.safetensors`` from a state dict (copied to the CPU, contiguous)."""
    save_file({k: v.detach().to("cpu").contiguous().clone() for k, v in state_dict.items()},
              str(Path(folder) / MODEL_FILE))


class _HashingWriter:
    """A file object that hashes what passes through it, so a file is checksummed as it is written
    (one pass over the bytes, none read back)."""

    def __init__(self, file) -> None:
        self.file, self.hash = file, hashlib.sha256()

    def write(self, data) -> int:
        self.hash.update(data)
        return self.file.write(data)

    def flush(self) -> None:
        self.file.flush()


def save_hashed(obj: Any, path: Path) -> str:
    """``torch.save`` ``obj`` to ``path``, fsync it and return its sha256 (for ``seal``'s ``checksums``)."""
    with open(path, "wb") as f:
        writer = _HashingWriter(f)
        torch.save(obj, writer)
        f.flush()
        os.fsync(f.fileno())
    return writer.hash.hexdigest()


def seal(folder: Path, meta: Dict[str, Any], checksums: Optional[Mapping[str, str]] = None) -> Dict[str, Any]:
    """Write ``meta.json`` (atomically) last, with the sha256 of every other file in ``folder``.

    ``checksums`` are files their writers already hashed and fsynced (``save_hashed``, e.g. each
    rank's own shard): they are not read here. Every other file is hashed and fsynced here."""
    folder = Path(folder)
    files = sorted(p.name for p in folder.iterdir() if p.name not in (META_FILE, META_FILE + ".tmp"))
    given = dict(checksums or {})
    missing = sorted(set(given) - set(files))
    if missing:
        raise CheckpointError(f"{folder} lacks {', '.join(missing)} although its writer reported it; "
                              f"the checkpoint is incomplete and is not sealed")
    own = [name for name in files if name not in given]
    for name in own:
        given[name] = sha256(folder / name)
        fsync_file(folder / name)
    record = dict(meta, files={name: given[name] for name in files})
    tmp = folder / (META_FILE + ".tmp")
    tmp.write_text(json.dumps(record, indent=2, default=str))
    fsync_file(tmp)
    os.replace(tmp, folder / META_FILE)
    return record


def write_model_folder(folder: Path, state_dict: Mapping[str, torch.Tensor], meta: Dict[str, Any]) -> Path:
    """A weights-only checkpoint folder (model.safetensors + meta.json with its checksum)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_weights(folder, state_dict)
    seal(folder, meta)
    return folder


# -------------------------------------------------------------------------------------- read
def read_meta(folder: Path) -> Dict[str, Any]:
    meta_path = Path(folder) / META_FILE
    if not meta_path.is_file():
        raise CheckpointError(f"{folder} is not a complete checkpoint (no meta.json); "
                              f"pass resume=auto to take the newest complete one")
    try:
        return json.loads(meta_path.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{meta_path} is corrupted ({exc}); delete {folder} to resume from "
                              f"the previous checkpoint") from None


def verify(folder: Path, meta: Dict[str, Any], names: Iterable[str]) -> None:
    """Compare the sha256 of ``names`` with meta.json's; never load a silently damaged file."""
    folder = Path(folder)
    for name in names:
        path = folder / name
        expected = meta.get("files", {}).get(name)
        if expected is None or not path.is_file():
            raise CheckpointError(f"checkpoint {folder} lacks {name} or meta.json does not record it; "
                                  f"delete {folder} to resume from the previous checkpoint")
        actual = sha256(path)
        if actual != expected:
            raise CheckpointError(f"checkpoint file {path} is corrupted (sha256 {actual[:12]}… but "
                                  f"meta.json records {expected[:12]}…); delete {folder} to resume "
                                  f"from the previous checkpoint")


def read_weights(folder: Path) -> Tuple[Dict[str, torch.Tensor], Dict[str, Any]]:
    """(model state dict, meta) of a checkpoint folder, its checksum verified first."""
    meta = read_meta(folder)
    verify(folder, meta, [MODEL_FILE])
    return load_file(str(Path(folder) / MODEL_FILE)), meta


# ------------------------------------------------------------------ per-rank shards, elastic
def rank_file(rank: int) -> str:
    """The name of rank ``rank``'s own state file in a checkpoint folder."""
    return f"rank-{rank}.pt"


def repad(flat: torch.Tensor, numel: int, padded_numel: int) -> torch.Tensor:
    """A flat buffer laid out for one partitioning, for another: the first ``numel`` values (the
    parameters; the layout puts all padding at the end) followed by zero padding up to
    ``padded_numel``."""
    if flat.numel() < numel:
        raise CheckpointError(f"a flat checkpoint buffer has {flat.numel()} values, fewer than the "
                              f"model's {numel} parameters: it was written for another model")
    out = torch.zeros(padded_numel, dtype=flat.dtype)
    out[:numel] = flat[:numel]
    return out


class RankShards:
    """The ``rank-R.pt`` files of a checkpoint written by ``world`` ranks, read on demand.

    Each file is verified against meta.json before it is loaded. Only the RNG states of the files
    read are kept (small), so a rank holds at most one old rank's tensors at a time."""

    def __init__(self, folder: Path, meta: Dict[str, Any], world: int) -> None:
        self.folder, self.meta, self.world = Path(folder), meta, int(world)
        self._rng: Dict[int, Dict[str, Any]] = {}

    def read(self, rank: int) -> Dict[str, Any]:
        """Old rank ``rank``'s synchroniser state (its ``local_state_dict``)."""
        name = rank_file(rank)
        verify(self.folder, self.meta, [name])
        state = torch.load(self.folder / name, map_location="cpu", weights_only=True)
        self._rng[rank] = state["rng"]
        return state["sync"]

    def rng(self, rank: int) -> Dict[str, Any]:
        if rank not in self._rng:
            self.read(rank)
        return self._rng[rank]

    @torch.no_grad()
    def mean(self, extract: Callable[[Dict[str, Any]], Mapping[str, torch.Tensor]],
             like: Mapping[str, torch.Tensor], comm: Any, rank: int, world: int,
             device: torch.device) -> Dict[str, torch.Tensor]:
        """The mean over the old ranks of the fp32 tensors ``extract`` takes from each one's state.

        Collective over the ``world`` new ranks: new rank j reads old ranks j, j + world, ... (so
        every file is read once in all, whatever the two world sizes), sums what it read, and one
        all-reduce (``comm``'s, kind ``resume``) adds the partial sums; ``like`` gives each
        tensor's shape for the ranks that read nothing."""
        total = {key: torch.zeros(t.shape, dtype=torch.float32, device=device) for key, t in like.items()}
        for old in range(rank, self.world, world):
            part = extract(self.read(old))
            for key, buffer in total.items():
                if part[key].shape != buffer.shape:
                    raise CheckpointError(f"{rank_file(old)} of {self.folder} holds {key} of shape "
                                          f"{tuple(part[key].shape)}, expected {tuple(buffer.shape)}")
                buffer.add_(part[key].to(device, torch.float32))
        for key, buffer in total.items():
            comm.all_reduce(buffer, kind="resume")
            buffer.div_(self.world)
        return total


# --------------------------------------------------------------------------------------- RNG
def capture_rng() -> Dict[str, Any]:
    """Every RNG state a run or an evaluation touches: python, numpy, torch and CUDA.

    Plain values and tensors only, so ``torch.load(..., weights_only=True)`` reads it back."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state: Dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state(),
                             "numpy": (name, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss),
                                       float(cached))}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: Dict[str, Any]) -> None:
    random.setstate(state["python"])
    if "numpy" in state:  # checkpoints written before numpy's state was captured lack it
        name, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
