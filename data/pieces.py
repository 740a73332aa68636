"""Tokenizing one piece (a fixed run of consecutive documents) into a token file.

This runs inside worker processes, so it imports only numpy and ``tokenizers``: a spawned
worker starts in well under a second and never loads torch. A piece's output is a pure function
of its documents and the tokenizer, which is why a resumed prepare can skip finished pieces.
"""
from __future__ import annotations

import os
import pathlib
import threading
import time
from typing import Any, Dict, List, Optional

import numpy as np

from .shards import atomic_write_json, atomic_write_tokens

_worker_tokenizer = None
_worker_eos_id: Optional[int] = None
_worker_dtype: Optional[np.dtype] = None


def _exit_when_orphaned(parent_pid: int) -> None:
    """A prepare killed with SIGKILL cannot stop its pool; without this its workers would wait
    on the task queue forever (and hold the parent's stdout open)."""
    while os.getppid() == parent_pid:
        time.sleep(0.5)
    os._exit(1)


def init_worker(tokenizer_file: str, eos_id: int, dtype: str, parent_pid: Optional[int] = None) -> None:
    """Load the tokenizer once per process instead of once per piece.

    ``parent_pid`` is the pid of the process that made the pool, passed in rather than read
    here: a worker still starting up when its parent is killed would read its new parent's pid
    and never notice.
    """
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the processes are the parallelism
    if parent_pid is not None:
        threading.Thread(target=_exit_when_orphaned, args=(parent_pid,), daemon=True).start()
    from tokenizers import Tokenizer

    global _worker_tokenizer, _worker_eos_id, _worker_dtype
    _worker_tokenizer = Tokenizer.from_file(tokenizer_file)
    # A tokenizer.json may carry truncation/padding settings meant for model inputs; applied
    # here they would silently cut or pad documents.
    _worker_tokenizer.no_truncation()
    _worker_tokenizer.no_padding()
    _worker_eos_id = eos_id
    _worker_dtype = np.dtype(dtype)


def piece_paths(work_dir: pathlib.Path, split: str, index: int):
    stem = work_dir / f"{split}-piece-{index:07d}"
    return stem.with_suffix(".bin"), stem.with_suffix(".json")


def tokenize_piece(work_dir: str, split: str, index: int, documents: List[str]) -> Dict[str, Any]:
    """Write ``<split>-piece-<index>.bin`` then its ``.json``; the .json marks the piece done."""
    started = time.perf_counter()
    encodings = _worker_tokenizer.encode_batch(documents, add_special_tokens=False)
    lengths = [len(e.ids) + 1 for e in encodings]
    tokens = np.empty(sum(lengths), dtype=_worker_dtype)
    position = 0
    for encoding, length in zip(encodings, lengths):
        tokens[position:position + length - 1] = encoding.ids
        tokens[position + length - 1] = _worker_eos_id  # EOS after every document
        position += length
    tokens_path, meta_path = piece_paths(pathlib.Path(work_dir), split, index)
    sha256 = atomic_write_tokens(tokens_path, tokens)
    meta = {"split": split, "index": index, "num_tokens": int(tokens.size),
            "num_documents": len(documents), "sha256": sha256,
            "replacement_characters": sum(d.count("\ufffd") for d in documents),
            "seconds": time.perf_counter() - started}
    atomic_write_json(meta_path, meta)
    return meta
