"""The GPT-2 family: LayerNorm, learned positions, tanh-GELU MLP, biases, tied embeddings.

Numerically the same function as transformers' GPT2LMHeadModel (activation ``gelu_new`` is
GELU's tanh form). q/k/v are separate projections here (GPT-2 fuses them into ``c_attn``) so
that SDP slices heads by rows of three plainly named tensors; models/hf.py fuses on export.
"""
from __future__ import annotations

from typing import List

import torch
import torch.nn as nn
import torch.nn.functional as F

from models.common import CausalLM, resolved_ffn_hidden
from models.config import ModelConfig
from models.ops import causal_attention
from models.subnet import SubnetSpec


class GPTAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, n_heads: int) -> None:
        super().__init__()
        self.head_dim = cfg.d_model // cfg.n_head
        self.n_heads = n_heads
        self.backend, self.kernels = cfg.attention, cfg.kernels
        width = n_heads * self.head_dim
        self.q_proj = nn.Linear(cfg.d_model, width)
        self.k_proj = nn.Linear(cfg.d_model, width)
        self.v_proj = nn.Linear(cfg.d_model, width)
        self.o_proj = nn.Linear(width, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        if self.n_heads == 0:
            # A subnetwork holding no head of this block: only o_proj's bias remains, computed
            # through the (empty) projections so every held tensor gets a gradient.
            return self.o_proj(self.q_proj(x) + self.k_proj(x) + self.v_proj(x))
        # One matmul for q, k and v (as GPT-2's c_attn): the weights are concatenated per call,
        # a copy of d x 3d that is small next to the activations, and autograd splits the grads.
        weight = torch.cat((self.q_proj.weight, self.k_proj.weight, self.v_proj.weight))
        bias = torch.cat((self.q_proj.bias, self.k_proj.bias, self.v_proj.bias))
        qkv = F.linear(x, weight, bias).view(batch, length, 3, self.n_heads, self.head_dim)
        q, k, v = qkv.unbind(dim=2)
        y = causal_attention(q, k, v, self.backend, self.kernels)
        return self.o_proj(y.reshape(batch, length, self.n_heads * self.head_dim))


class GPTMLP(nn.Module):
    def __init__(self, d_model: int, hidden: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d_model, hidden)
        self.proj = nn.Linear(hidden, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class GPTBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, heads: List[int], units: List[int]) -> None:
        super().__init__()
        self.attn_norm = nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps)
        self.attn = GPTAttention(cfg, len(heads))
        self.mlp_norm = nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps)
        self.mlp = GPTMLP(cfg.d_model, len(units))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class GPT(CausalLM):
    def __init__(self, cfg: ModelConfig, subnet: SubnetSpec | None = None) -> None:
        super().__init__(cfg)
        subnet = subnet or SubnetSpec()
        ffn = resolved_ffn_hidden(cfg)
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_embeddings = nn.Embedding(cfg.seq_len, cfg.d_model)
        for layer in subnet.held_blocks(cfg.n_layer):
            self.blocks[str(layer)] = GPTBlock(cfg, subnet.kept_heads(layer, cfg.n_head),
                                               subnet.kept_units(layer, ffn))
        self.final_norm = nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps)
        if not cfg.tie_embeddings:
            self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        return self.tok_embeddings(idx) + self.pos_embeddings(positions)

    def head_weight(self) -> torch.Tensor:
        return self.tok_embeddings.weight if self.cfg.tie_embeddings else self.lm_head.weight
