"""Token shards on disk: flat arrays of token ids, the manifest that describes them, and the
atomic-write discipline that makes a killed ``prepare`` safe to rerun.

A shard is a raw little-endian ``uint16`` or ``uint32`` array with no header, so it can be
memory-mapped by numpy without parsing and its sha256 is a checksum of exactly the tokens.
"""
from __future__ import annotations

import hashlib
import json
import os
import pathlib
from typing import Any, Dict, Iterable, List

import numpy as np

from .errors import ShardChecksumError, TokenDtypeError

MANIFEST_NAME = "manifest.json"
MANIFEST_VERSION = 1
UINT16_LIMIT = 1 << 16


def token_dtype(vocab_size: int, requested: str = "auto") -> np.dtype:
    """uint16 halves disk and page-cache use whenever every id fits (GPT-2, Llama-2, bpe_local)."""
    if requested not in ("auto", "uint16", "uint32"):
        raise TokenDtypeError(f"data.token_dtype must be auto, uint16 or uint32, not {requested!r}")
    if requested == "uint32" or (requested == "auto" and vocab_size > UINT16_LIMIT):
        return np.dtype("<u4")
    if vocab_size > UINT16_LIMIT:
        raise TokenDtypeError(
            f"the tokenizer has {vocab_size} tokens but data.token_dtype=uint16 holds ids below "
            f"{UINT16_LIMIT} only; use data.token_dtype=uint32 or data.token_dtype=auto")
    return np.dtype("<u2")


def atomic_write_bytes(path: pathlib.Path, payload: bytes) -> None:
    """Write to a temporary name and rename, so a reader or a resumed run never sees half a file."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(payload)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def atomic_write_json(path: pathlib.Path, obj: Any) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode("utf-8"))


def atomic_write_tokens(path: pathlib.Path, tokens: np.ndarray) -> str:
    """Write one token array atomically; returns its sha256 (computed from memory, no re-read)."""
    payload = np.ascontiguousarray(tokens).tobytes()
    atomic_write_bytes(path, payload)
    return hashlib.sha256(payload).hexdigest()


def file_sha256(path: pathlib.Path, chunk_bytes: int = 1 << 24) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            chunk = f.read(chunk_bytes)
            if not chunk:
                return digest.hexdigest()
            digest.update(chunk)


def manifest_dtype(manifest: Dict[str, Any]) -> np.dtype:
    return np.dtype({"uint16": "<u2", "uint32": "<u4"}[manifest["dtype"]])


def read_manifest(folder: pathlib.Path) -> Dict[str, Any]:
    return json.loads((folder / MANIFEST_NAME).read_text(encoding="utf-8"))


def shard_entries(manifest: Dict[str, Any], split: str) -> List[Dict[str, Any]]:
    try:
        return manifest["splits"][split]["shards"]
    except KeyError:
        raise KeyError(f"the manifest has no split {split!r}; it has {sorted(manifest['splits'])}")


def verify_shards(folder: pathlib.Path, manifest: Dict[str, Any], checksums: bool = True) -> None:
    """Refuse to hand out a shard that is missing, truncated or altered since it was written.

    The manifest's sha256 is the only evidence that the tokens on disk are the tokens prepare
    produced; a silent mismatch would train on garbage or break exact resume.
    """
    itemsize = manifest_dtype(manifest).itemsize
    for split in manifest["splits"]:
        for entry in shard_entries(manifest, split):
            path = folder / entry["file"]
            if not path.is_file():
                raise ShardChecksumError(
                    f"shard {path} listed in {folder / MANIFEST_NAME} is missing; delete "
                    f"{folder} (or just its manifest.json) and rerun prepare to rebuild it")
            expected_bytes = entry["num_tokens"] * itemsize
            if path.stat().st_size != expected_bytes:
                raise ShardChecksumError(
                    f"shard {path} has {path.stat().st_size} bytes, the manifest says "
                    f"{expected_bytes}; it is truncated or was overwritten. Delete {folder} and "
                    f"rerun prepare to rebuild it")
            if checksums:
                actual = file_sha256(path)
                if actual != entry["sha256"]:
                    raise ShardChecksumError(
                        f"shard {path} has sha256 {actual}, the manifest says {entry['sha256']}; "
                        f"the file changed after prepare wrote it. Nothing was overwritten: delete "
                        f"{folder} and rerun prepare to rebuild it")


def open_shards(folder: pathlib.Path, manifest: Dict[str, Any], split: str) -> List[np.memmap]:
    """Memory-map a split's shards after a size check (a full checksum is prepare's job)."""
    dtype = manifest_dtype(manifest)
    shards = []
    for entry in shard_entries(manifest, split):
        path = folder / entry["file"]
        expected_bytes = entry["num_tokens"] * dtype.itemsize
        if not path.is_file() or path.stat().st_size != expected_bytes:
            raise ShardChecksumError(
                f"shard {path} is missing or does not have the {expected_bytes} bytes its manifest "
                f"says; delete {folder} and rerun prepare to rebuild it")
        if entry["num_tokens"] > 0:
            shards.append(np.memmap(path, dtype=dtype, mode="r", shape=(entry["num_tokens"],)))
    return shards


def concat_files(paths: Iterable[pathlib.Path], dtype: np.dtype) -> np.ndarray:
    parts = [np.fromfile(p, dtype=dtype) for p in paths]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)
