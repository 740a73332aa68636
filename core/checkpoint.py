"""The checkpoint format, written, verified and read in one place.

A checkpoint folder holds ``model.safetensors`` (the full model's weights, our parameter names),
any other state files, and last of all ``meta.json``: what the writer records (step, the resolved
config or at least ``config.model``, the tokenizer's path, ...) plus the sha256 of every other file
under ``files``. Readers check those checksums before they load anything, so a silently damaged
file is never used. The trainer's step-N folders (trainer/checkpoint.py) add the optimizer's and
every rank's state; an HF import (models/hf.py) writes a weights-only folder a run starts from
with ``train.init_from=DIR``.

Also here: the one capture and restore of the RNG states (python, numpy, torch, CUDA).
"""
from __future__ import annotations

import hashlib
import json
import os
import random
from pathlib import Path
from typing import Any, Dict, Iterable, Mapping, Tuple

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


def seal(folder: Path, meta: Dict[str, Any]) -> Dict[str, Any]:
    """Checksum and fsync every file in ``folder``, then write ``meta.json`` (atomically) last."""
    folder = Path(folder)
    files = sorted(p.name for p in folder.iterdir() if p.name not in (META_FILE, META_FILE + ".tmp"))
    checksums = {name: sha256(folder / name) for name in files}
    for name in files:
        fsync_file(folder / name)
    record = dict(meta, files=checksums)
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
