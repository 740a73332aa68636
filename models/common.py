"""What both families share: attention kernels, initialisation, the trunk's forward and loss.

The families (models/llama.py, models/gpt.py) only define their blocks and embeddings; the loop
over blocks, activation checkpointing, the LM head and the loss live here once, so the two
cannot drift apart.
"""
from __future__ import annotations

import math
import zlib
from typing import Callable, Dict, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from models.config import ModelConfig
from models.loss import loss_function
from models.ops import flash_attn_installed



def resolved_kv_heads(cfg: ModelConfig) -> int:
    n_kv = cfg.n_head if (cfg.family == "gpt" or cfg.n_kv_head is None) else cfg.n_kv_head
    if cfg.n_head % n_kv:
        raise ValueError(f"model.n_head={cfg.n_head} must be a multiple of model.n_kv_head={n_kv}")
    return n_kv


def resolved_ffn_hidden(cfg: ModelConfig) -> int:
    """MLP width; when unset: gpt 4 d, llama 8/3 d rounded up to a multiple of 256 (Llama's rule)."""
    if cfg.ffn_hidden is not None:
        return cfg.ffn_hidden
    if cfg.family == "gpt":
        return 4 * cfg.d_model
    return 256 * math.ceil(8 * cfg.d_model / 3 / 256)


def validate_config(cfg: ModelConfig) -> None:
    if cfg.d_model % cfg.n_head:
        raise ValueError(f"model.d_model={cfg.d_model} must be a multiple of model.n_head={cfg.n_head}")
    resolved_kv_heads(cfg)
    if cfg.attention == "flash" and not flash_attn_installed():
        raise ValueError(
            "model.attention=flash but the flash-attn package is not installed (it needs CUDA; "
            "there are no aarch64 wheels). Install it with `pip install flash-attn`, or set "
            "model.attention=sdpa (PyTorch's fused attention) or model.attention=auto.")


class RotaryEmbedding(nn.Module):
    """RoPE tables in Llama's (HF's) half-split layout, so weights map to transformers unpermuted.

    cos/sin are [T, 1, hd/2] (both halves of a head share the same angles; models/ops.py's
    apply_rotary uses them for each), cached per (length, device) in fp32 and kept out of the
    state dict; they are recomputed after a move between devices.
    """

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.theta = theta
        self._cache: Dict[Tuple[int, str], Tuple[torch.Tensor, torch.Tensor]] = {}

    def cos_sin(self, length: int, device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
        key = (length, str(device))
        if key not in self._cache:
            inv_freq = 1.0 / (self.theta ** (
                torch.arange(0, self.head_dim, 2, dtype=torch.int64, device=device).float()
                / self.head_dim))
            positions = torch.arange(length, device=device, dtype=torch.float32)
            freqs = torch.outer(positions, inv_freq)  # [T, hd/2]
            self._cache[key] = (freqs.cos()[:, None, :], freqs.sin()[:, None, :])
        return self._cache[key]


# ---------------------------------------------------------------------------------------------
# Initialisation

RESIDUAL_OUTPUT_SUFFIXES = ("attn.o_proj.weight", "mlp.down_proj.weight", "mlp.proj.weight")


def _parameter_seed(base_seed: int, name: str) -> int:
    return (base_seed * 1_000_003 + zlib.crc32(name.encode())) % (2 ** 63 - 1)


@torch.no_grad()
def initialise(model: nn.Module, cfg: ModelConfig, full_shapes: Dict[str, torch.Size],
               slices: Dict[str, Tuple[int, torch.Tensor]], base_seed: int) -> None:
    """N(0, init_std) for matrices, init_std/sqrt(2 L) for residual output projections (GPT-2 /
    nanoGPT / Megatron), zeros for biases, ones for norm weights.

    Each tensor draws from its own generator seeded by (base_seed, parameter name), and a sliced
    tensor is cut from its full-size draw, so a subnetwork starts exactly at the full model's
    values restricted to what it holds (SDP holders must start identical). Only one full-size
    tensor exists transiently at a time; unheld blocks are never drawn.
    """
    residual_std = cfg.init_std / math.sqrt(2 * cfg.n_layer)
    for name, param in model.named_parameters():
        if param.is_meta:
            continue
        if name.endswith(".bias"):
            param.zero_()
            continue
        if "norm" in name:
            param.fill_(1.0)
            continue
        std = residual_std if name.endswith(RESIDUAL_OUTPUT_SUFFIXES) else cfg.init_std
        generator = torch.Generator(device=param.device)
        generator.manual_seed(_parameter_seed(base_seed, name))
        if name in slices:
            dim, indices = slices[name]
            full = torch.empty(full_shapes[name], device=param.device, dtype=param.dtype)
            full.normal_(0.0, std, generator=generator)
            param.copy_(full.index_select(dim, indices.to(param.device)))
        else:
            param.normal_(0.0, std, generator=generator)


# ---------------------------------------------------------------------------------------------
# The trunk


class CausalLM(nn.Module):
    """Embeddings -> held blocks -> final norm (``hidden_states``) -> LM head or the loss.

    ``blocks`` is a ModuleDict keyed by the layer index, so parameter names are
    ``blocks.<layer>.…`` as in the full model even when a subnetwork holds only some blocks
    (an unheld block is simply absent: the identity on the residual stream).
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.activation_checkpointing = False
        self.blocks = nn.ModuleDict()
        self.loss = loss_function(cfg.loss)
        # compile_blocks' compiled forward per block (a plain dict: not submodules, so parameter
        # names and the state dict stay those of the eager model)
        self.compiled_blocks: Dict[str, Callable] = {}

    # Families provide these.
    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def block_context(self, length: int, device: torch.device) -> tuple:
        return ()

    def head_weight(self) -> torch.Tensor:
        raise NotImplementedError

    def set_activation_checkpointing(self, enabled: bool) -> None:
        """Recompute each block's activations in backward (torch.utils.checkpoint, non-reentrant)."""
        self.activation_checkpointing = bool(enabled)

    def compile_blocks(self, **options) -> None:
        """torch.compile every block on its own, with static shapes (``options`` go to
        torch.compile, e.g. ``backend``); used by forwards with gradients (training), while
        no-grad forwards (validation, evaluation, generation: other shapes) stay eager.

        Per block, not the model as one graph: the backward then runs as one compiled node per
        block, so a block's parameters get their final gradients, and their post-accumulate-grad
        hooks fire (SCAPE's bucketed all-reduce, scape/overlap.py; DDP's buckets), while the
        earlier blocks' backward still runs. One graph would hand every gradient over at the end
        of backward and lose that overlap. Identical blocks share one compiled graph.
        """
        self.compiled_blocks = {name: torch.compile(block, dynamic=False, **options)
                                for name, block in self.blocks.items()}

    def hidden_states(self, idx: torch.Tensor) -> torch.Tensor:
        """The final norm's output [B, T, d]: what the LM head and the loss read."""
        _, length = idx.shape
        if length > self.cfg.seq_len:
            raise ValueError(f"sequence length {length} exceeds model.seq_len={self.cfg.seq_len}")
        x = self.embed(idx)
        context = self.block_context(length, idx.device)
        training = torch.is_grad_enabled()
        checkpointing = self.activation_checkpointing and training
        for name, block in self.blocks.items():
            run = self.compiled_blocks.get(name, block) if training else block
            if checkpointing:
                x = checkpoint(run, x, *context, use_reentrant=False)
            else:
                x = run(x, *context)
        return self.final_norm(x)

    def forward(self, idx: torch.Tensor, targets: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Logits [B, T, V] without targets; with targets (already shifted, -1 = ignore), the
        mean next-token cross-entropy over all positions (``model.loss``), computed in fp32."""
        hidden = self.hidden_states(idx)
        if targets is None:
            return F.linear(hidden, self.head_weight())
        return self.loss(hidden.reshape(-1, hidden.shape[-1]), self.head_weight(), targets.reshape(-1))
