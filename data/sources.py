"""Where documents come from: the embedded corpus, local files, or a dataset on the HF hub.

All three yield ``(split, text)`` pairs in a fixed order, so document *i* always lands in the
same split and the same tokenization piece; that is what makes a resumed ``prepare`` produce
the same shards as an uninterrupted one.
"""
from __future__ import annotations

import glob
import hashlib
import itertools
import os
import tempfile
from typing import Any, Dict, Iterable, Iterator, List, Tuple

from .config import DataConfig
from .errors import (DataPipelineError, HubUnreachableError, MissingPathError, OFFLINE_OPTIONS,
                     TextFieldError, looks_like_network_failure)

_BUILDER_BY_SUFFIX = {".txt": "text", ".text": "text", ".md": "text", ".json": "json",
                      ".jsonl": "json", ".parquet": "parquet"}
_COMPRESSION_SUFFIXES = (".gz", ".bz2", ".xz", ".zst", ".lz4")


def is_held_out(document_index: int, val_fraction: float) -> bool:
    """A hash, not a stride, so the validation documents are spread evenly over any source order."""
    digest = hashlib.blake2b(document_index.to_bytes(8, "little"), digest_size=8).digest()
    return int.from_bytes(digest, "little") < val_fraction * 2.0 ** 64


def _builder_for(path: str) -> str:
    name = path.lower()
    for suffix in _COMPRESSION_SUFFIXES:
        if name.endswith(suffix):
            name = name[: -len(suffix)]
    ext = os.path.splitext(name)[1]
    if ext not in _BUILDER_BY_SUFFIX:
        raise DataPipelineError(
            f"{path}: unknown file type {ext!r}; data=local reads {sorted(_BUILDER_BY_SUFFIX)} "
            f"(optionally compressed with {list(_COMPRESSION_SUFFIXES)})")
    return _BUILDER_BY_SUFFIX[ext]


def resolve_local_paths(patterns: Iterable[str]) -> List[str]:
    """Expand globs; every pattern must match something, so a typo is not a silently smaller corpus."""
    patterns = list(patterns)
    if not patterns:
        raise MissingPathError("data=local needs data.paths: a list of .txt/.jsonl/.parquet files or globs")
    files: List[str] = []
    for pattern in patterns:
        expanded = os.path.expanduser(str(pattern))
        matches = sorted(glob.glob(expanded, recursive=True)) if glob.has_magic(expanded) else (
            [expanded] if os.path.exists(expanded) else [])
        matches = [m for m in matches if os.path.isfile(m)]
        if not matches:
            raise MissingPathError(f"data.paths entry {pattern!r} matches no file "
                                   f"(working directory: {os.getcwd()})")
        files.extend(os.path.abspath(m) for m in matches)
    return files


def _text_of(record: Dict[str, Any], field: str, origin: str) -> str:
    if field not in record:
        raise TextFieldError(f"{origin}: the records have no field {field!r}; their fields are "
                             f"{sorted(record)}. Set data.text_field to the one holding the text")
    text = record[field]
    if text is None:
        return ""
    if not isinstance(text, str):
        raise TextFieldError(f"{origin}: field {field!r} holds {type(text).__name__}, not text; "
                             f"set data.text_field to a string field of {sorted(record)}")
    return text


def _local_records(cfg: DataConfig) -> Iterator[Tuple[str, Dict[str, Any]]]:
    files = resolve_local_paths(cfg.paths)  # before the slow import: a typo fails at once
    import datasets

    for builder, group in itertools.groupby(files, key=_builder_for):
        group = list(group)
        kwargs: Dict[str, Any] = {}
        if builder == "text":
            kwargs.update(sample_by=cfg.txt_sample_by, encoding_errors="replace", keep_linebreaks=True)
            if cfg.text_field != "text":
                raise TextFieldError(f"{group[0]}: text files have the single field 'text', "
                                     f"not {cfg.text_field!r}; set data.text_field=text")
        elif builder == "json":
            # datasets' JSON reader decodes (and so applies encoding_errors) only when the
            # encoding is not spelled "utf-8"; "utf_8" is the same codec under another name.
            kwargs.update(encoding="utf_8", encoding_errors="replace")
        try:
            # Streaming reads the files in place; the throwaway cache_dir only catches the lock
            # files datasets leaves behind, which would otherwise pile up in ~/.cache.
            with tempfile.TemporaryDirectory(prefix="data_local_") as scratch:
                dataset = datasets.load_dataset(builder, data_files=group, split="train", streaming=True,
                                                cache_dir=scratch, **kwargs)
                for record in dataset:
                    yield f"{builder} files {group[0]}{' ...' if len(group) > 1 else ''}", record
        except DataPipelineError:
            raise
        except Exception as exc:  # datasets/pyarrow errors name the library, not the user's mistake
            raise DataPipelineError(f"could not read {group}: {type(exc).__name__}: {exc}") from exc


def _hub_error(cfg: DataConfig, split: str, exc: Exception) -> DataPipelineError:
    where = f"{cfg.hf_path!r}" + (f" (config {cfg.hf_name!r})" if cfg.hf_name else "") + f", split {split!r}"
    first_line = (str(exc).splitlines() or [type(exc).__name__])[0]
    if looks_like_network_failure(exc):
        return HubUnreachableError(
            f"could not load dataset {where}: the Hugging Face hub is unreachable from this machine "
            f"(or offline mode is on) and the dataset is not in the local cache. {OFFLINE_OPTIONS} "
            f"(original error: {first_line})")
    return DataPipelineError(f"could not load dataset {where}: {type(exc).__name__}: {first_line}. "
                             f"{OFFLINE_OPTIONS}")


def _hub_records(cfg: DataConfig, split: str, limit) -> Iterator[Tuple[str, Dict[str, Any]]]:
    import datasets

    if not cfg.hf_path:
        raise DataPipelineError("data.source=hub needs data.hf_path (a hub dataset id)")
    origin = f"hub dataset {cfg.hf_path} split {split}"
    try:
        dataset = datasets.load_dataset(cfg.hf_path, cfg.hf_name, split=split, streaming=cfg.streaming)
        for record in itertools.islice(dataset, limit):
            yield origin, record
    except DataPipelineError:
        raise
    except Exception as exc:  # streaming reaches the hub lazily, so iteration can fail too
        raise _hub_error(cfg, split, exc) from exc


def iter_documents(cfg: DataConfig) -> Iterator[Tuple[str, str]]:
    """``(split, text)`` for every document, in the source's order; empty documents skipped."""
    if not 0.0 <= cfg.val_fraction < 1.0:
        raise DataPipelineError(f"data.val_fraction must be in [0, 1), not {cfg.val_fraction}")
    if cfg.source == "embedded":
        from .embedded import embedded_documents
        records: Iterable[Tuple[str, Dict[str, Any]]] = (
            ("embedded corpus", {cfg.text_field: d})
            for d in embedded_documents(cfg.embedded_docstrings))
    elif cfg.source == "local":
        records = _local_records(cfg)
    elif cfg.source == "hub":
        records = _hub_records(cfg, cfg.hf_split, cfg.max_documents)
    else:
        raise DataPipelineError(f"data.source must be embedded, local or hub, not {cfg.source!r}")

    own_val_split = cfg.source == "hub" and cfg.hf_val_split
    for index, (origin, record) in enumerate(itertools.islice(records, cfg.max_documents)):
        text = _text_of(record, cfg.text_field, origin)
        if text.strip():
            yield ("val" if not own_val_split and is_held_out(index, cfg.val_fraction) else "train"), text
    if own_val_split:
        for origin, record in _hub_records(cfg, cfg.hf_val_split, cfg.max_val_documents):
            text = _text_of(record, cfg.text_field, origin)
            if text.strip():
                yield "val", text
