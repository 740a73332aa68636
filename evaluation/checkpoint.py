"""A trainer checkpoint as an inference model: our model class, the run's own tokenizer.

Evaluation and sampling run through models/ (not an HF export) so the numbers are those of the
code that trained the weights; models.hf.read_checkpoint reads the folder.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Optional, Union

import torch

from models import build_model
from models.config import ModelConfig
from models.hf import read_checkpoint

# Tried in order when a bare tokenizer.json names no end-of-sequence token.
_EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>")
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class CheckpointLoadError(RuntimeError):
    """The checkpoint folder or its tokenizer cannot be used for evaluation or sampling."""


@dataclass
class LoadedCheckpoint:
    model: torch.nn.Module
    config: ModelConfig
    tokenizer: Any  # transformers.PreTrainedTokenizerFast
    meta: Dict[str, Any]
    path: Path

    @property
    def step(self) -> Optional[int]:
        step = self.meta.get("step")
        return int(step) if step is not None else None

    @property
    def run_name(self) -> str:
        """The trainer's run name (wandb's display name; the wandb id is in the run folder's
        ``wandb_id``), else the run folder's name."""
        return str((self.meta.get("config") or {}).get("run_name") or self.path.resolve().parent.name)


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str) -> torch.dtype:
    if dtype not in _DTYPES:
        raise ValueError(f"dtype={dtype!r}: expected one of {sorted(_DTYPES)}")
    return _DTYPES[dtype]


def _tokenizer_candidates(recorded: str, checkpoint_dir: Path):
    # The run may have moved since it was trained: also look beside the checkpoint and the run.
    yield Path(recorded)
    yield checkpoint_dir / recorded
    yield checkpoint_dir.parent / recorded
    yield checkpoint_dir / "tokenizer.json"
    yield checkpoint_dir.parent / "tokenizer.json"


def load_run_tokenizer(meta: Dict[str, Any], checkpoint_dir: Path):
    """The tokenizer whose ids the checkpoint was trained on (meta.json's ``tokenizer_path``).

    A prepared folder's tokenizer.json sits beside transformers' config files, which carry the
    end-of-sequence token; a bare tokenizer.json gets the first of the usual EOS names it has.
    """
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    recorded = meta.get("tokenizer_path")
    if not recorded:
        raise CheckpointLoadError(
            f"{checkpoint_dir}/meta.json records no tokenizer_path; evaluation and sampling need the "
            "run's tokenizer (the trainer records it; for an imported checkpoint re-import from an "
            "HF folder that has a tokenizer.json)")
    path = next((p for p in _tokenizer_candidates(recorded, checkpoint_dir) if p.exists()), None)
    if path is None:
        raise CheckpointLoadError(f"tokenizer {recorded!r} recorded in {checkpoint_dir}/meta.json does "
                                  "not exist (nor a tokenizer.json beside the checkpoint)")
    folder = path if path.is_dir() else path.parent
    if (folder / "tokenizer_config.json").is_file() and (path.is_dir() or path.name == "tokenizer.json"):
        tokenizer = AutoTokenizer.from_pretrained(str(folder))
    else:
        tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(path))
    if tokenizer.eos_token is None:
        vocab = tokenizer.get_vocab()
        eos = next((c for c in _EOS_CANDIDATES if c in vocab), None)
        if eos is None:
            raise CheckpointLoadError(f"tokenizer {path} names no end-of-sequence token and has none "
                                      f"of {list(_EOS_CANDIDATES)}")
        tokenizer.eos_token = eos
    return tokenizer


def load_checkpoint_for_inference(checkpoint_dir: Union[str, os.PathLike], device: str = "auto",
                                  dtype: str = "fp32") -> LoadedCheckpoint:
    """Our model with the checkpoint's weights (eval mode, no grad needed) and the run's tokenizer."""
    path = Path(checkpoint_dir)
    if not (path / "meta.json").is_file() or not (path / "model.safetensors").is_file():
        raise CheckpointLoadError(f"{path} is not a checkpoint folder (expected RUN/step-N with "
                                  "meta.json and model.safetensors)")
    cfg, state_dict, meta = read_checkpoint(str(path))
    model = build_model(cfg, device="meta")
    model.load_state_dict(state_dict, assign=True)
    model = model.to(device=resolve_device(device), dtype=resolve_dtype(dtype)).eval()
    model.requires_grad_(False)
    tokenizer = load_run_tokenizer(meta, path)
    if len(tokenizer) > cfg.vocab_size:
        raise CheckpointLoadError(f"the tokenizer has {len(tokenizer)} tokens but the model only "
                                  f"{cfg.vocab_size} embedding rows: not this run's tokenizer")
    return LoadedCheckpoint(model=model, config=cfg, tokenizer=tokenizer, meta=meta, path=path)
