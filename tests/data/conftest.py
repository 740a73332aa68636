"""Small corpora the tests write themselves, and configs that prepare them quickly."""
from __future__ import annotations

import json
import pathlib
import random
from typing import List

import pytest

from data.config import DataConfig, TokenizerConfig

_WORDS = ("the loader reads memory mapped token shards while the trainer waits for nothing "
          "tokens documents epochs ranks seeds steps windows prefetch manifest checksum python "
          "language reference grammar expression statement").split()


def make_documents(count: int, seed: int = 0) -> List[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(5, 60))) + f" doc{i}."
            for i in range(count)]


def write_jsonl(path: pathlib.Path, documents: List[str], field: str = "text") -> pathlib.Path:
    path.write_text("".join(json.dumps({field: d, "id": i}) + "\n" for i, d in enumerate(documents)),
                    encoding="utf-8")
    return path


def local_config(tmp_path: pathlib.Path, paths, **overrides) -> DataConfig:
    values = dict(name="testcorpus", source="local", paths=[str(p) for p in paths],
                  cache_dir=str(tmp_path / "cache"), val_fraction=0.2, num_proc=1,
                  documents_per_piece=16)
    values.update(overrides)
    return DataConfig(**values)


def small_bpe(**overrides) -> TokenizerConfig:
    values = dict(name="bpe_small", kind="bpe_local", vocab_size=300)
    values.update(overrides)
    return TokenizerConfig(**values)


@pytest.fixture
def documents() -> List[str]:
    return make_documents(120)


@pytest.fixture
def jsonl_corpus(tmp_path, documents) -> pathlib.Path:
    return write_jsonl(tmp_path / "corpus.jsonl", documents)


REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]


def run_prepare_cli(args: List[str], env_extra=None, timeout: float = 120.0):
    """``python -m data.prepare`` in a child process, as a user runs it."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", **(env_extra or {}))
    return subprocess.run([sys.executable, "-m", "data.prepare", *args], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def folder_snapshot(folder: pathlib.Path):
    """Every file's bytes, to show that a refused run changed nothing."""
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _prepare_then_get_killed(data_cfg, tok_cfg, kill_at: str, marker: str) -> None:
    import os

    os.environ["DATA_PREPARE_KILL_AT"] = kill_at
    os.environ["DATA_TEST_PROCESS_MARKER"] = marker  # inherited by the tokenizer workers
    from data import prepare
    prepare(data_cfg, tok_cfg)


def processes_with_marker(marker: str) -> List[int]:
    import os

    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if f"DATA_TEST_PROCESS_MARKER={marker}".encode() in f.read():
                    found.append(int(pid))
        except OSError:
            continue
    return found


def prepare_killed_at(data_cfg, tok_cfg, kill_at: str, timeout: float = 60.0) -> int:
    """Run prepare in a forked child that SIGKILLs itself at ``kill_at`` (piece:N or shard:N).

    Forking skips the seconds of imports a fresh interpreter would pay. Returns the exit code
    once the child's tokenizer workers (orphaned by the kill) have exited too.
    """
    import multiprocessing
    import time
    import uuid

    marker = uuid.uuid4().hex
    child = multiprocessing.get_context("fork").Process(target=_prepare_then_get_killed,
                                                        args=(data_cfg, tok_cfg, kill_at, marker))
    child.start()
    child.join(timeout)
    if child.is_alive():
        child.kill()
        child.join()
    deadline = time.monotonic() + timeout
    while processes_with_marker(marker) and time.monotonic() < deadline:
        time.sleep(0.2)
    orphans = processes_with_marker(marker)
    assert not orphans, f"tokenizer workers {orphans} outlived their killed parent"
    return child.exitcode
