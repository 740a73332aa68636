"""The data pipeline: sources -> tokenizer -> token shards (``prepare``) -> ``TokenLoader``.

The loader and tokenizer exports are resolved lazily so that tokenization worker processes,
which import ``data.pieces``, start without importing torch and transformers.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .config import DataConfig, TokenizerConfig
from .errors import DataPipelineError
from .preparation import prepare, prepared_dir_for

if TYPE_CHECKING:
    from .loader import TokenLoader
    from .tokenizer import load_tokenizer

__all__ = ["DataConfig", "TokenizerConfig", "DataPipelineError", "TokenLoader", "prepare",
           "prepared_dir_for", "load_tokenizer"]

_LAZY = {"TokenLoader": "loader", "load_tokenizer": "tokenizer"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
