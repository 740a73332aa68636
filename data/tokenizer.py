"""Tokenizers: GPT-2 / Llama-2 (or any) from the HF hub or disk, or a BPE trained on the corpus.

Whatever the kind, the result is saved into the prepared folder as ``tokenizer.json`` (plus the
transformers config files) so that tokenization workers, the loader, generation and HF export
all read the one tokenizer that produced the shards, with no hub access after ``prepare``.
"""
from __future__ import annotations

import hashlib
import os
import pathlib
from typing import TYPE_CHECKING, Any, Dict, Iterable, Optional

from .config import TokenizerConfig
from .errors import (DataPipelineError, HubUnreachableError, MissingPathError, OFFLINE_OPTIONS,
                     looks_like_network_failure)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

DEFAULT_EOS = "<|endoftext|>"
_EOS_CANDIDATES = (DEFAULT_EOS, "</s>", "<eos>", "<|end_of_text|>")


def tokenizer_identity(cfg: TokenizerConfig) -> Dict[str, Any]:
    """The settings that decide which ids a text gets; a prepared folder is bound to them."""
    identity: Dict[str, Any] = {"kind": cfg.kind, "eos_token": cfg.eos_token}
    if cfg.kind == "bpe_local":
        identity.update(vocab_size=cfg.vocab_size, min_frequency=cfg.min_frequency,
                        max_train_documents=cfg.max_train_documents)
    else:
        identity["path"] = cfg.path
    return identity


def tokenizer_fingerprint(tokenizer) -> str:
    """sha256 of the serialized tokenizer: two tokenizers with equal fingerprints agree on ids."""
    return hashlib.sha256(tokenizer.backend_tokenizer.to_str().encode("utf-8")).hexdigest()


def _pick_eos(tokenizer, requested: Optional[str]) -> str:
    if requested:
        if requested not in tokenizer.get_vocab():
            raise DataPipelineError(f"tokenizer.eos_token={requested!r} is not in the tokenizer's vocabulary")
        return requested
    if tokenizer.eos_token is not None:
        return tokenizer.eos_token
    vocab = tokenizer.get_vocab()
    for candidate in _EOS_CANDIDATES:
        if candidate in vocab:
            return candidate
    raise DataPipelineError(
        "the tokenizer names no end-of-sequence token and has none of "
        f"{list(_EOS_CANDIDATES)}; set tokenizer.eos_token to the token that separates documents")


def load_hf_tokenizer(cfg: TokenizerConfig):
    """A fast tokenizer from a tokenizer.json file, a local folder, or a hub id."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if not cfg.path:
        raise DataPipelineError("tokenizer.kind=hf needs tokenizer.path: a hub id (gpt2), a folder or a tokenizer.json")
    path = os.path.expanduser(cfg.path)
    if path.endswith(".json") or os.path.isfile(path):
        if not os.path.isfile(path):
            raise MissingPathError(f"tokenizer file {path} does not exist")
        tokenizer = PreTrainedTokenizerFast(tokenizer_file=path)
    elif os.path.isdir(path):
        tokenizer = AutoTokenizer.from_pretrained(path, use_fast=True)
    elif path.startswith((".", "/", "~")):
        raise MissingPathError(f"tokenizer folder {path} does not exist")
    else:
        try:
            tokenizer = AutoTokenizer.from_pretrained(path, use_fast=True)
        except (OSError, ValueError) as exc:
            first_line = (str(exc).splitlines() or [type(exc).__name__])[0]
            if looks_like_network_failure(exc):
                raise HubUnreachableError(
                    f"could not load tokenizer {path!r}: the Hugging Face hub is unreachable from this "
                    f"machine (or offline mode is on) and the tokenizer is not in the local cache. "
                    f"{OFFLINE_OPTIONS} (original error: {first_line})") from exc
            hint = (" The repository is gated: accept its licence on the hub and log in "
                    "(huggingface-cli login), or use a local copy." if "gated" in str(exc).lower() else "")
            raise DataPipelineError(f"could not load tokenizer {path!r}: {first_line}.{hint} "
                                    f"{OFFLINE_OPTIONS}") from exc
    if not isinstance(tokenizer, PreTrainedTokenizerFast):
        raise DataPipelineError(f"tokenizer {path!r} has no fast (Rust) version; the pipeline needs one")
    eos = _pick_eos(tokenizer, cfg.eos_token)
    tokenizer.eos_token = eos
    return tokenizer


def train_bpe_tokenizer(cfg: TokenizerConfig, documents: Iterable[str]):
    """Byte-level BPE (GPT-2's scheme) so any text, even with replacement characters, encodes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    eos = cfg.eos_token or DEFAULT_EOS
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=cfg.vocab_size, min_frequency=cfg.min_frequency, special_tokens=[eos],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    backend.train_from_iterator(documents, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=eos, bos_token=eos,
                                   model_max_length=int(1e9))


def save_tokenizer(tokenizer, folder: pathlib.Path) -> None:
    """Saved into a temporary folder then moved file by file, so a kill leaves no half file."""
    tmp = folder / f".tokenizer.tmp-{os.getpid()}"
    tmp.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(tmp), legacy_format=False)
    for item in tmp.iterdir():
        os.replace(item, folder / item.name)
    tmp.rmdir()


def load_tokenizer(prepared_dir: "str | os.PathLike") -> "PreTrainedTokenizerFast":
    """The tokenizer that produced a prepared folder's shards (for generation and HF export)."""
    from transformers import PreTrainedTokenizerFast

    folder = pathlib.Path(prepared_dir)
    if not (folder / "tokenizer.json").is_file():
        raise MissingPathError(f"{folder} has no tokenizer.json; run prepare first")
    return PreTrainedTokenizerFast.from_pretrained(str(folder))
