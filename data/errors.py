"""Errors of the data pipeline.

Every failure a user can cause (a bad path, a wrong field, a changed tokenizer, a corrupted
shard, an unreachable hub) raises a subclass of ``DataPipelineError`` whose message says what
went wrong and what to do. The ``python -m data.prepare`` entry point prints that message and
exits non-zero instead of showing a traceback, so the message is the user interface.
"""
from __future__ import annotations

OFFLINE_OPTIONS = (
    "Offline options: the embedded corpus (data=embedded), your own files "
    "(data=local data.paths=[...]), a BPE tokenizer trained on the corpus (tokenizer=bpe_local) "
    "or a tokenizer on disk (tokenizer=local tokenizer.path=/path/to/folder_or_tokenizer.json), "
    "or a dataset already in the HF cache with HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1."
)


def looks_like_network_failure(exc: BaseException) -> bool:
    """True when an HF loading error (or one it wraps) comes from having no route to the hub."""
    seen = 0
    while exc is not None and seen < 20:
        if isinstance(exc, (ConnectionError, TimeoutError)) or type(exc).__name__ in (
                "OfflineModeIsEnabled", "LocalEntryNotFoundError", "ConnectError", "gaierror"):
            return True
        message = str(exc).lower()
        if ("offline" in message or "couldn't reach" in message or "couldn't connect" in message
                or "not cached" in message):
            return True
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return False


class DataPipelineError(Exception):
    """A failure with a message meant for the person running the pipeline."""


class MissingPathError(DataPipelineError):
    pass


class EmptyCorpusError(DataPipelineError):
    pass


class TextFieldError(DataPipelineError):
    pass


class HubUnreachableError(DataPipelineError):
    pass


class TokenizerMismatchError(DataPipelineError):
    pass


class ConfigMismatchError(DataPipelineError):
    pass


class ShardChecksumError(DataPipelineError):
    pass


class TokenDtypeError(DataPipelineError):
    pass
