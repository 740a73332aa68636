"""The model's config schema (Hydra group ``model``).

One dataclass for both families so a misspelt key fails at start-up; fields a family does not use
are ignored by it (documented per field).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

from core.choices import check_choice

Family = Literal["llama", "gpt"]
Attention = Literal["auto", "sdpa", "flash"]  # auto: flash-attn on CUDA when installed, else blocked/SDPA
Kernels = Literal["auto", "stock", "cpu"]  # models/ops.py; auto: the CPU kernels on CPU tensors only
Loss = Literal["fused", "standard"]  # models/loss.py; fused: chunked linear + cross-entropy


@dataclass
class ModelConfig:
    name: str = "tiny_llama"
    family: str = "llama"  # llama | gpt
    n_layer: int = 4
    n_head: int = 4
    n_kv_head: Optional[int] = None  # llama only; None = n_head (no grouped-query attention)
    d_model: int = 256
    ffn_hidden: Optional[int] = None  # llama: SwiGLU width (None = 8/3 d rounded up to 256); gpt: MLP width (None = 4 d)
    vocab_size: int = 8192  # embedding rows (may be padded above the tokenizer's vocabulary)
    seq_len: int = 256
    rope_theta: float = 10000.0  # llama only
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    init_std: float = 0.02
    attention: str = "auto"  # Attention
    kernels: str = "auto"  # Kernels
    loss: str = "fused"  # Loss

    def __post_init__(self) -> None:
        check_choice("model.family", self.family, Family, "{key}={value!r}: expected {alternatives}")
        check_choice("model.attention", self.attention, Attention, "{key}={value!r}: expected one of {allowed}")
        check_choice("model.kernels", self.kernels, Kernels)
        check_choice("model.loss", self.loss, Loss)
        if self.seq_len <= 0:
            raise ValueError(f"model.seq_len must be positive, got {self.seq_len}")
