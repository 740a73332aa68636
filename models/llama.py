"""The Llama family: RMSNorm, RoPE, SwiGLU MLP, optional grouped-query attention, untied head.

Numerically the same function as transformers' LlamaForCausalLM (see tests/models); the weight
name mapping lives in models/hf.py. A block can be built with a subset of its heads and MLP
units (models/subnet.py), so one definition serves dense training and SDP.
"""
from __future__ import annotations

from typing import List

import torch
import torch.nn as nn
import torch.nn.functional as F

from models.common import CausalLM, RotaryEmbedding, resolved_ffn_hidden, resolved_kv_heads
from models.config import ModelConfig
from models.ops import apply_rotary, causal_attention, projections, rms_norm, swiglu
from models.subnet import SubnetSpec


class RMSNorm(nn.Module):
    """``cast_output``: under autocast, return the normalised activations in autocast's dtype, cast
    once here rather than by every projection that reads them (a block's norms; the final norm
    stays fp32, as the loss computes in fp32)."""

    def __init__(self, dim: int, eps: float, kernels: str = "auto", cast_output: bool = False) -> None:
        super().__init__()
        self.eps, self.kernels, self.cast_output = eps, kernels, cast_output
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:  # one fused op (the residual stream is fp32 under autocast)
            normed = rms_norm(x, self.weight, self.eps, self.kernels)
            if self.cast_output and torch.is_autocast_enabled(x.device.type):
                # the same rounding autocast's matmuls apply to their input, done once
                return normed.to(torch.get_autocast_dtype(x.device.type))
            return normed
        # Normalise in fp32 and scale in the input dtype, as Llama's reference does.
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)
        return self.weight * normed


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, n_heads: int, n_kv_heads: int) -> None:
        super().__init__()
        self.head_dim = cfg.d_model // cfg.n_head
        self.n_heads, self.n_kv_heads = n_heads, n_kv_heads
        self.backend, self.kernels = cfg.attention, cfg.kernels
        self.q_proj = nn.Linear(cfg.d_model, n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.d_model, n_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.d_model, n_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(n_heads * self.head_dim, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        if self.n_heads == 0:
            # A subnetwork holding no head of this block: the output is zero, but computed
            # through the (empty) projections so every held tensor, the norm included, gets a
            # gradient (zeros) like in any other block.
            return self.o_proj(self.q_proj(x) + self.k_proj(x) + self.v_proj(x))
        # q/k/v stay three parameters (their names, initial draws, flat order, SDP slices and HF
        # mapping are the separate tensors'); the stock path runs them as one GEMM (models/ops.py).
        q, k, v = projections(x, (self.q_proj.weight, self.k_proj.weight, self.v_proj.weight), self.kernels)
        q = q.view(batch, length, self.n_heads, self.head_dim)
        k = k.view(batch, length, self.n_kv_heads, self.head_dim)
        v = v.view(batch, length, self.n_kv_heads, self.head_dim)
        q, k = apply_rotary(q, cos, sin, self.kernels), apply_rotary(k, cos, sin, self.kernels)
        y = causal_attention(q, k, v, self.backend, self.kernels)
        return self.o_proj(y.reshape(batch, length, self.n_heads * self.head_dim))


class SwiGLU(nn.Module):
    def __init__(self, d_model: int, hidden: int, kernels: str = "auto") -> None:
        super().__init__()
        self.kernels = kernels
        self.gate_proj = nn.Linear(d_model, hidden, bias=False)
        self.up_proj = nn.Linear(d_model, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = projections(x, (self.gate_proj.weight, self.up_proj.weight), self.kernels)
        return self.down_proj(swiglu(gate, up, self.kernels))


class LlamaBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, heads: List[int], units: List[int]) -> None:
        super().__init__()
        group = cfg.n_head // resolved_kv_heads(cfg)
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps, cfg.kernels, cast_output=True)
        self.attn = LlamaAttention(cfg, len(heads), len({h // group for h in heads}))
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps, cfg.kernels, cast_output=True)
        self.mlp = SwiGLU(cfg.d_model, len(units), cfg.kernels)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class Llama(CausalLM):
    def __init__(self, cfg: ModelConfig, subnet: SubnetSpec | None = None) -> None:
        super().__init__(cfg)
        subnet = subnet or SubnetSpec()
        ffn = resolved_ffn_hidden(cfg)
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.d_model)
        for layer in subnet.held_blocks(cfg.n_layer):
            self.blocks[str(layer)] = LlamaBlock(cfg, subnet.kept_heads(layer, cfg.n_head),
                                                 subnet.kept_units(layer, ffn))
        self.final_norm = RMSNorm(cfg.d_model, cfg.norm_eps, cfg.kernels)
        self.rotary = RotaryEmbedding(cfg.d_model // cfg.n_head, cfg.rope_theta)
        if not cfg.tie_embeddings:
            self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        return self.tok_embeddings(idx)

    def block_context(self, length: int, device: torch.device) -> tuple:
        return self.rotary.cos_sin(length, device)

    def head_weight(self) -> torch.Tensor:
        return self.tok_embeddings.weight if self.cfg.tie_embeddings else self.lm_head.weight
