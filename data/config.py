"""Config schemas of the data pipeline (Hydra groups ``data`` and ``tokenizer``)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional


@dataclass
class TokenizerConfig:
    name: str = "bpe_local"
    kind: str = "bpe_local"  # bpe_local (trained on the corpus) | hf (hub id or local path)
    path: Optional[str] = None  # hub id or local folder / tokenizer.json for kind=hf
    vocab_size: int = 8192  # target size for bpe_local
    min_frequency: int = 2  # bpe_local: a pair must occur this often to be merged
    max_train_documents: Optional[int] = None  # bpe_local: train on the first N train documents
    eos_token: Optional[str] = None  # the document separator; None = the tokenizer's own EOS


@dataclass
class DataConfig:
    name: str = "embedded"
    source: str = "embedded"  # embedded | local | hub
    paths: List[str] = field(default_factory=list)  # local files or globs (source=local)
    hf_path: Optional[str] = None  # hub dataset id (source=hub)
    hf_name: Optional[str] = None  # hub dataset config
    hf_split: str = "train"
    hf_val_split: Optional[str] = None  # a split of the dataset's own; None = hold out val_fraction
    text_field: str = "text"
    streaming: bool = False
    max_documents: Optional[int] = None
    val_fraction: float = 0.05
    cache_dir: str = "cache/data"  # prepared shards go to cache_dir/<data.name>-<tokenizer.name>
    num_proc: int = 2
    shard_tokens: int = 100_000_000
    prefetch: int = 4  # micro-batches prepared ahead by the loader's background thread
    max_val_documents: Optional[int] = None  # cap on hf_val_split documents
    documents_per_piece: int = 1024  # unit of parallel work and of resume after a kill
    token_dtype: str = "auto"  # auto (uint16 when the vocab fits) | uint16 | uint32
    verify_checksums: bool = True  # sha256 every shard when a prepared folder is reused
    txt_sample_by: str = "paragraph"  # .txt files: one document per paragraph | line | document
    embedded_docstrings: bool = False  # source=embedded: add the stdlib's long docstrings (data/embedded.py)
