"""Tokenize a corpus once into token shards: ``prepare(data_cfg, tok_cfg) -> folder``.

Layout of ``<cache_dir>/<data.name>-<tokenizer.name>/``::

    manifest.json          written last: its presence means the folder is complete
    tokenizer.json (+ transformers config files)
    train-00000.bin ...    raw uint16/uint32 token ids, an EOS after every document
    val-00000.bin ...
    .work/                 only while preparing: state.json and finished pieces
    (and ``<cache_dir>/.<folder>.lock``: two prepares of one folder run one after the other)

Resume after a kill works at piece granularity: a piece is a fixed run of consecutive
documents of one split, its tokens are a pure function of those documents and the saved
tokenizer, and a finished piece is never redone. Shards are assembled from the pieces in
order, so a resumed run writes byte-identical shards.

Also a command (data/prepare.py): ``python -m data.prepare data=embedded tokenizer=bpe_local data.num_proc=4``.
"""
from __future__ import annotations

import concurrent.futures as futures
import contextlib
import dataclasses
import json
import multiprocessing
import os
import pathlib
import shutil
import signal
import sys
import time
from typing import Any, Dict, Iterator, List, Optional, Sequence

import numpy as np

from .config import DataConfig, TokenizerConfig
from .errors import (ConfigMismatchError, DataPipelineError, EmptyCorpusError,
                     TokenizerMismatchError)
from .pieces import init_worker, piece_paths, tokenize_piece
from .shards import (MANIFEST_NAME, MANIFEST_VERSION, atomic_write_json, atomic_write_tokens,
                     read_manifest, token_dtype, verify_shards)
from .sources import iter_documents
from .tokenizer import (load_hf_tokenizer, save_tokenizer, tokenizer_fingerprint,
                        tokenizer_identity, train_bpe_tokenizer)

SPLITS = ("train", "val")
_DTYPE_NAMES = {"<u2": "uint16", "<u4": "uint32"}
# Content-neutral settings (how fast, where) are left out, so changing them reuses the folder.
_DATA_IDENTITY_FIELDS = ("source", "paths", "hf_path", "hf_name", "hf_split", "hf_val_split",
                         "text_field", "max_documents", "max_val_documents", "val_fraction",
                         "shard_tokens", "token_dtype", "txt_sample_by")


def _coerce(cfg: Any, schema: type):
    """Accept the dataclass, a Hydra DictConfig or a plain dict (the trainer passes cfg.data)."""
    if isinstance(cfg, schema):
        return cfg
    from omegaconf import OmegaConf

    values = OmegaConf.to_container(cfg, resolve=True) if OmegaConf.is_config(cfg) else dict(cfg)
    known = {f.name for f in dataclasses.fields(schema)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise DataPipelineError(f"unknown {schema.__name__} keys {unknown}; valid keys are {sorted(known)}")
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(schema), values))


def prepared_dir_for(data_cfg: DataConfig, tok_cfg: TokenizerConfig) -> pathlib.Path:
    """Where prepare puts (or put) the shards; ranks other than 0 can compute it themselves."""
    data_cfg, tok_cfg = _coerce(data_cfg, DataConfig), _coerce(tok_cfg, TokenizerConfig)
    return (pathlib.Path(data_cfg.cache_dir).expanduser() / f"{data_cfg.name}-{tok_cfg.name}").resolve()


def data_identity(cfg: DataConfig) -> Dict[str, Any]:
    identity = {name: getattr(cfg, name) for name in _DATA_IDENTITY_FIELDS}
    identity["paths"] = list(identity["paths"])
    if cfg.source == "embedded":
        from .embedded import embedded_corpus_identity
        identity["embedded_corpus"] = embedded_corpus_identity(cfg.embedded_docstrings)
    elif cfg.source == "local":
        from .sources import resolve_local_paths
        # A glob that now matches more files, or a file that changed, is a different corpus.
        identity["files"] = [[path, os.path.getsize(path)] for path in resolve_local_paths(cfg.paths)]
    return identity


def _differences(recorded: Dict[str, Any], wanted: Dict[str, Any]) -> str:
    keys = sorted(k for k in set(recorded) | set(wanted) if recorded.get(k) != wanted.get(k))

    def short(value: Any) -> str:
        text = repr(value)
        return text if len(text) <= 160 else text[:150] + "...]"

    return ", ".join(f"{k}: {short(recorded.get(k))} then, {short(wanted.get(k))} now" for k in keys)


def _check_identity(folder: pathlib.Path, recorded: Dict[str, Any], data_id: Dict[str, Any],
                    tok_id: Dict[str, Any]) -> None:
    """Never mix tokens of two tokenizers (or two corpora) under one folder name."""
    if recorded["tokenizer"] != tok_id:
        raise TokenizerMismatchError(
            f"{folder} was prepared with a different tokenizer ({_differences(recorded['tokenizer'], tok_id)}). "
            f"Nothing was overwritten. Give this tokenizer its own name (tokenizer.name=...) or "
            f"delete {folder} to rebuild it")
    if recorded["data"] != data_id:
        raise ConfigMismatchError(
            f"{folder} was prepared from different data settings ({_differences(recorded['data'], data_id)}). "
            f"Nothing was overwritten. Give this corpus its own name (data.name=...) or delete "
            f"{folder} to rebuild it")


def _check_local_tokenizer_unchanged(folder: pathlib.Path, tok_cfg: TokenizerConfig,
                                     recorded_fingerprint: str) -> None:
    """A tokenizer file on disk can change under the same path; the hub is not asked again."""
    if tok_cfg.kind != "hf" or not tok_cfg.path or not os.path.exists(os.path.expanduser(tok_cfg.path)):
        return
    current = tokenizer_fingerprint(load_hf_tokenizer(tok_cfg))
    if current != recorded_fingerprint:
        raise TokenizerMismatchError(
            f"the tokenizer at {tok_cfg.path} changed since {folder} was prepared with it "
            f"(sha256 {recorded_fingerprint[:12]}... then, {current[:12]}... now). Nothing was "
            f"overwritten. Give it its own name (tokenizer.name=...) or delete {folder} to rebuild")


def _simulated_kill(stage: str, done: int) -> None:
    """Fault injection for the resume tests: DATA_PREPARE_KILL_AT=piece:N or shard:N."""
    target = os.environ.get("DATA_PREPARE_KILL_AT")
    if target and target == f"{stage}:{done}":
        os.kill(os.getpid(), signal.SIGKILL)


def _build_tokenizer(data_cfg: DataConfig, tok_cfg: TokenizerConfig):
    if tok_cfg.kind == "bpe_local":
        import itertools
        train_docs = (text for split, text in iter_documents(data_cfg) if split == "train")
        documents = itertools.islice(train_docs, tok_cfg.max_train_documents)
        first = next(documents, None)
        if first is None:
            raise EmptyCorpusError(f"data {data_cfg.name!r} has no non-empty training document to "
                                   f"train the tokenizer on")
        return train_bpe_tokenizer(tok_cfg, itertools.chain([first], documents))
    if tok_cfg.kind == "hf":
        return load_hf_tokenizer(tok_cfg)
    raise DataPipelineError(f"tokenizer.kind must be bpe_local or hf, not {tok_cfg.kind!r}")


def _probe_source(data_cfg: DataConfig) -> None:
    """Fail on a bad path, a wrong field or an empty corpus before anything is written."""
    if next(iter_documents(data_cfg), None) is None:
        raise EmptyCorpusError(f"data {data_cfg.name!r} yielded no non-empty document; check "
                               f"data.paths / data.hf_path and data.text_field")


class _PieceRunner:
    """Tokenizes pieces inline until a second one is ready, then in a process pool.

    Small corpora (the embedded one is a single piece) never pay for starting processes.
    """

    def __init__(self, work_dir: pathlib.Path, tokenizer_file: pathlib.Path, eos_id: int,
                 dtype: np.dtype, num_proc: int, progress) -> None:
        self.work_dir, self.num_proc, self.progress = work_dir, max(1, num_proc), progress
        self.init_args = (str(tokenizer_file), eos_id, dtype.str)
        self.pool: Optional[futures.ProcessPoolExecutor] = None
        self.waiting: List[tuple] = []
        self.running: set = set()
        self.completed = 0
        self.tokens = 0
        self.worker_seconds = 0.0
        self.replacement_characters = 0
        self.started = time.perf_counter()

    def submit(self, split: str, index: int, documents: List[str]) -> None:
        self.waiting.append((str(self.work_dir), split, index, documents))
        if self.num_proc > 1 and self.pool is None and len(self.waiting) >= 2:
            self.pool = futures.ProcessPoolExecutor(
                self.num_proc, mp_context=multiprocessing.get_context("spawn"),
                initializer=init_worker, initargs=(*self.init_args, os.getpid()))
        if self.pool is not None:
            while self.waiting:
                if len(self.running) >= 2 * self.num_proc:  # bound memory held by queued text
                    self._collect(futures.FIRST_COMPLETED)
                self.running.add(self.pool.submit(tokenize_piece, *self.waiting.pop(0)))

    def _record(self, meta: Dict[str, Any]) -> None:
        self.completed += 1
        self.tokens += meta["num_tokens"]
        self.worker_seconds += meta["seconds"]
        self.replacement_characters += meta["replacement_characters"]
        self.progress.update(meta["num_documents"])
        elapsed = max(time.perf_counter() - self.started, 1e-9)
        self.progress.set_postfix(tokens=self.tokens, tok_per_s=f"{self.tokens / elapsed:,.0f}", refresh=False)
        _simulated_kill("piece", self.completed)

    def _collect(self, mode) -> None:
        done, self.running = futures.wait(self.running, return_when=mode)
        for future in done:
            self._record(future.result())

    def finish(self) -> None:
        if self.pool is None:
            if self.waiting:
                init_worker(*self.init_args)
            for args in self.waiting:
                self._record(tokenize_piece(*args))
            self.waiting = []
            return
        self._collect(futures.ALL_COMPLETED)
        self.close()

    def close(self) -> None:
        """Stop the workers, also when a piece failed or the source raised mid-way."""
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
            self.pool = None


def _tokenize_pieces(data_cfg: DataConfig, work_dir: pathlib.Path, runner: _PieceRunner) -> Dict[str, int]:
    buffers: Dict[str, List[str]] = {s: [] for s in SPLITS}
    counts = {s: 0 for s in SPLITS}

    def flush(split: str) -> None:
        index = counts[split]
        counts[split] += 1
        documents, buffers[split] = buffers[split], []
        if piece_paths(work_dir, split, index)[1].is_file():
            runner.progress.update(len(documents))  # finished before a kill: skipped
            return
        runner.submit(split, index, documents)

    try:
        for split, text in iter_documents(data_cfg):
            buffers[split].append(text)
            if len(buffers[split]) >= data_cfg.documents_per_piece:
                flush(split)
        for split in SPLITS:
            if buffers[split]:
                flush(split)
        runner.finish()
    finally:
        runner.close()
    return counts


def _assemble_split(folder: pathlib.Path, work_dir: pathlib.Path, split: str, num_pieces: int,
                    dtype: np.dtype, shard_tokens: int, shards_written: List[int]) -> Dict[str, Any]:
    """Concatenate the split's pieces in order and cut the stream every shard_tokens tokens."""
    shards: List[Dict[str, Any]] = []
    pending: List[np.ndarray] = []
    pending_tokens = 0
    documents = replacement_characters = 0

    def write(tokens: np.ndarray) -> None:
        name = f"{split}-{len(shards):05d}.bin"
        sha256 = atomic_write_tokens(folder / name, tokens)
        shards.append({"file": name, "num_tokens": int(tokens.size), "sha256": sha256})
        shards_written[0] += 1
        _simulated_kill("shard", shards_written[0])

    for index in range(num_pieces):
        tokens_path, meta_path = piece_paths(work_dir, split, index)
        meta = json.loads(meta_path.read_text())
        documents += meta["num_documents"]
        replacement_characters += meta["replacement_characters"]
        pending.append(np.fromfile(tokens_path, dtype=dtype))
        pending_tokens += pending[-1].size
        while pending_tokens >= shard_tokens:
            stream = np.concatenate(pending)
            write(stream[:shard_tokens])
            pending, pending_tokens = [stream[shard_tokens:]], stream.size - shard_tokens
    if pending_tokens:
        write(np.concatenate(pending))
    return {"num_tokens": int(sum(s["num_tokens"] for s in shards)), "num_documents": documents,
            "replacement_characters": replacement_characters, "shards": shards}


@contextlib.contextmanager
def _exclusive(folder: pathlib.Path) -> Iterator[None]:
    """One prepare per folder at a time (two runs started together on a fresh cache_dir).

    The lock file sits beside the folder, so deleting the folder never races with it. Where
    fcntl is missing (Windows) there is no lock.
    """
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.parent / f".{folder.name}.lock", "a") as handle:
        try:
            import fcntl
        except ImportError:
            yield
            return
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"[data] waiting for another prepare of {folder} to finish", file=sys.stderr)
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _reuse(folder: pathlib.Path, data_id: Dict[str, Any], tok_id: Dict[str, Any],
           tok_cfg: TokenizerConfig, checksums: bool) -> pathlib.Path:
    manifest = read_manifest(folder)
    _check_identity(folder, manifest, data_id, tok_id)
    _check_local_tokenizer_unchanged(folder, tok_cfg, manifest["tokenizer_sha256"])
    verify_shards(folder, manifest, checksums=checksums)
    return folder


def _refuse_other_tokenizer(folder: pathlib.Path, tokenizer) -> None:
    from .tokenizer import load_tokenizer

    if (folder / "tokenizer.json").is_file() and \
            tokenizer_fingerprint(load_tokenizer(folder)) != tokenizer_fingerprint(tokenizer):
        raise TokenizerMismatchError(
            f"{folder} holds shards of a different tokenizer (its tokenizer.json differs from the "
            f"one configured now). Nothing was overwritten. Give this tokenizer its own name "
            f"(tokenizer.name=...) or delete {folder} to rebuild it")


def prepare(data_cfg: DataConfig, tok_cfg: TokenizerConfig) -> pathlib.Path:
    """Tokenize once; later calls verify the manifest and return at once.

    Everything that can be wrong with the input (paths, fields, an empty corpus, the tokenizer,
    the token dtype) is checked before the first byte is written.
    """
    data_cfg, tok_cfg = _coerce(data_cfg, DataConfig), _coerce(tok_cfg, TokenizerConfig)
    if data_cfg.shard_tokens < 1 or data_cfg.documents_per_piece < 1:
        raise DataPipelineError("data.shard_tokens and data.documents_per_piece must be positive")
    if tok_cfg.kind == "bpe_local" and tok_cfg.path:
        raise DataPipelineError(
            f"tokenizer.path={tok_cfg.path} is set but tokenizer.kind=bpe_local trains a new tokenizer "
            f"and ignores it; to use that tokenizer, pass tokenizer=local tokenizer.path={tok_cfg.path}")
    folder = prepared_dir_for(data_cfg, tok_cfg)
    data_id, tok_id = data_identity(data_cfg), tokenizer_identity(tok_cfg)
    if (folder / MANIFEST_NAME).is_file():
        return _reuse(folder, data_id, tok_id, tok_cfg, data_cfg.verify_checksums)

    state_path = folder / ".work" / "state.json"
    if state_path.is_file() and (folder / "tokenizer.json").is_file():
        _check_identity(folder, json.loads(state_path.read_text()), data_id, tok_id)
        from .tokenizer import load_tokenizer
        tokenizer = load_tokenizer(folder)
    else:
        _probe_source(data_cfg)
        tokenizer = _build_tokenizer(data_cfg, tok_cfg)
        _refuse_other_tokenizer(folder, tokenizer)
    dtype = token_dtype(len(tokenizer), data_cfg.token_dtype)

    with _exclusive(folder):
        if (folder / MANIFEST_NAME).is_file():  # a concurrent prepare finished it meanwhile
            return _reuse(folder, data_id, tok_id, tok_cfg, data_cfg.verify_checksums)
        if state_path.is_file():  # started by a run that was killed (or just finished tokenizing)
            _check_identity(folder, json.loads(state_path.read_text()), data_id, tok_id)
            _refuse_other_tokenizer(folder, tokenizer)
            print(f"[data] resuming the unfinished prepare in {folder}", file=sys.stderr)
        else:
            state_path.parent.mkdir(parents=True, exist_ok=True)
            save_tokenizer(tokenizer, folder)
            atomic_write_json(state_path, {"data": data_id, "tokenizer": tok_id})
        try:
            return _tokenize_and_write(folder, data_cfg, tok_cfg, tokenizer, dtype, data_id, tok_id)
        except EmptyCorpusError:
            shutil.rmtree(folder, ignore_errors=True)  # nothing in it is worth keeping
            raise


def _tokenize_and_write(folder: pathlib.Path, data_cfg: DataConfig, tok_cfg: TokenizerConfig,
                        tokenizer, dtype: np.dtype, data_id: Dict[str, Any],
                        tok_id: Dict[str, Any]) -> pathlib.Path:
    from tqdm.auto import tqdm

    work_dir = folder / ".work"
    vocab_size, eos_id = len(tokenizer), tokenizer.eos_token_id
    started = time.perf_counter()
    with tqdm(desc=f"tokenizing {data_cfg.name}", unit="doc", mininterval=1.0, file=sys.stderr) as bar:
        runner = _PieceRunner(work_dir, folder / "tokenizer.json", eos_id, dtype, data_cfg.num_proc, bar)
        piece_counts = _tokenize_pieces(data_cfg, work_dir, runner)
    seconds = time.perf_counter() - started

    shards_written = [0]
    splits = {split: _assemble_split(folder, work_dir, split, piece_counts[split], dtype,
                                     data_cfg.shard_tokens, shards_written) for split in SPLITS}
    if splits["train"]["num_tokens"] == 0:
        raise EmptyCorpusError(f"data {data_cfg.name!r} has no training document")
    if splits["val"]["num_tokens"] == 0:
        raise EmptyCorpusError(
            f"data {data_cfg.name!r} has no validation document (val_fraction={data_cfg.val_fraction}, "
            f"{splits['train']['num_documents']} documents); raise data.val_fraction or add documents")
    replacement_characters = sum(s["replacement_characters"] for s in splits.values())
    if replacement_characters:
        print(f"[data] {replacement_characters} undecodable bytes/characters were replaced with "
              f"U+FFFD (counted in the manifest as replacement_characters)", file=sys.stderr)
    total_tokens = sum(s["num_tokens"] for s in splits.values())
    manifest = {
        "version": MANIFEST_VERSION, "name": folder.name, "data": data_id, "tokenizer": tok_id,
        "tokenizer_name": tok_cfg.name, "tokenizer_sha256": tokenizer_fingerprint(tokenizer),
        "vocab_size": vocab_size, "eos_id": eos_id, "eos_token": tokenizer.eos_token,
        "dtype": _DTYPE_NAMES[dtype.str], "splits": splits,
        "replacement_characters": replacement_characters,
        "tokenize_seconds": round(seconds, 3), "num_proc": data_cfg.num_proc,
        "tokens_per_second": round(runner.tokens / max(seconds, 1e-9)),
        # Pure encoding speed of one process (worker time only, excluding reading the source).
        "tokens_per_second_per_process": round(runner.tokens / max(runner.worker_seconds, 1e-9)),
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    atomic_write_json(folder / MANIFEST_NAME, manifest)
    shutil.rmtree(work_dir, ignore_errors=True)
    for leftover in folder.glob(".*.tmp-*"):  # half-written files of a killed earlier run
        shutil.rmtree(leftover) if leftover.is_dir() else leftover.unlink()
    print(f"[data] {folder}: {total_tokens:,} tokens (train {splits['train']['num_tokens']:,}, val "
          f"{splits['val']['num_tokens']:,}), vocab {vocab_size}, {manifest['dtype']}; tokenized "
          f"{runner.tokens:,} tokens in {seconds:.1f} s ({manifest['tokens_per_second']:,} tokens/s, "
          f"{manifest['tokens_per_second_per_process']:,} per process)", file=sys.stderr)
    return folder


def _split_overrides(argv: Sequence[str]):
    """Accept the trainer's syntax (data=X tokenizer=Y data.key=v) and bare data/tokenizer keys.

    Returns the group choices for Hydra's compose and the key=value overrides, which are applied
    after the group files are merged onto the typed schema (so any schema key can be set).
    """
    data_fields = {f.name for f in dataclasses.fields(DataConfig)}
    tok_fields = {f.name for f in dataclasses.fields(TokenizerConfig)}
    groups = {"data": "embedded", "tokenizer": "bpe_local"}
    rest: List[str] = []
    for arg in argv:
        key, sep, value = arg.partition("=")
        if not sep:
            raise DataPipelineError(f"arguments are key=value overrides, not {arg!r}")
        key = key.lstrip("+")
        if key in groups:
            groups[key] = value
        elif "." in key:
            rest.append(f"{key}={value}")
        elif key in data_fields:
            rest.append(f"data.{key}={value}")
        elif key in tok_fields:
            rest.append(f"tokenizer.{key}={value}")
        else:
            raise DataPipelineError(f"unknown key {key!r}; use data.<key> or tokenizer.<key>")
    return [f"+data={groups['data']}", f"+tokenizer={groups['tokenizer']}"], rest


def main(argv: Optional[Sequence[str]] = None) -> int:
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        return 0
    try:
        group_choices, overrides = _split_overrides(argv)
        conf_dir = pathlib.Path(__file__).resolve().parent.parent / "conf"
        with initialize_config_dir(config_dir=str(conf_dir), version_base="1.3"):
            composed = compose(overrides=group_choices)
        schema = OmegaConf.structured({"data": DataConfig(), "tokenizer": TokenizerConfig()})
        cfg = OmegaConf.merge(schema, composed, OmegaConf.from_dotlist(overrides))
        folder = prepare(cfg.data, cfg.tokenizer)
        manifest = read_manifest(folder)
        print(OmegaConf.to_yaml({"prepared_dir": str(folder), "vocab_size": manifest["vocab_size"],
                                 "train_tokens": manifest["splits"]["train"]["num_tokens"],
                                 "val_tokens": manifest["splits"]["val"]["num_tokens"]}), end="")
        return 0
    except DataPipelineError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # Hydra's own errors (unknown group option, bad override)
        if type(exc).__module__.startswith(("hydra", "omegaconf")):
            print(f"error: {exc}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())
