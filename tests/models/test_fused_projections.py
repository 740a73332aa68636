"""Llama's q/k/v and gate/up projections: one GEMM each on the stock path (CUDA's), kept as separate
parameters (names, initial values, flat order, SDP slices and the HF mapping are untouched), and
the block norms' outputs cast to autocast's dtype once, not by every projection that reads them."""
from __future__ import annotations

import dataclasses
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from models import build_model, load_model_config
from models.ops import projections

_GEMMS = {"mm", "addmm", "bmm"}


class _Ops(TorchDispatchMode):
    """Counts GEMMs and fp32 -> bf16 casts of activation-shaped tensors [B, T, d]."""

    def __init__(self, d_model: int) -> None:
        super().__init__()
        self.d_model, self.counts = d_model, Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name in _GEMMS:
            self.counts["gemm"] += 1
        if name == "_to_copy" and kwargs.get("dtype") == torch.bfloat16:
            source = args[0]
            if source.dtype == torch.float32 and source.ndim == 3 and source.shape[-1] == self.d_model:
                self.counts["activation casts"] += 1
        return func(*args, **kwargs)


def _block(kernels: str):
    cfg = dataclasses.replace(load_model_config("tiny_llama"), n_layer=1, d_model=64, n_head=4, n_kv_head=2,
                              ffn_hidden=96, vocab_size=128, seq_len=16, kernels=kernels,
                              attention="sdpa")  # attention as one op on both paths: only projections count
    torch.manual_seed(0)
    model = build_model(cfg)
    return model, model.blocks["0"], cfg


def _count(block, cfg, autocast: bool):
    x = torch.randn(2, cfg.seq_len, cfg.d_model, requires_grad=True)
    cos, sin = _rotary_tables(cfg)
    forward, backward = _Ops(cfg.d_model), _Ops(cfg.d_model)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        with forward:
            y = block(x, cos, sin)
    with backward:
        y.float().sum().backward()
    return forward.counts, backward.counts


def _rotary_tables(cfg):
    from models.common import RotaryEmbedding

    return RotaryEmbedding(cfg.d_model // cfg.n_head, cfg.rope_theta).cos_sin(cfg.seq_len, torch.device("cpu"))


@pytest.mark.parametrize("kernels,forward_gemms", [("stock", 4), ("cpu", 7)])
def test_one_gemm_for_qkv_and_one_for_gate_up_on_the_stock_path(kernels: str, forward_gemms: int) -> None:
    """Stock: q/k/v, o, gate/up, down (4 forward, 8 backward). The CPU kernels keep the three and
    two separate GEMMs: a stacked one sums the input gradient in one reduction, other low bits
    than the golden tests pin (models/ops.py, projections)."""
    _, block, cfg = _block(kernels)
    forward, backward = _count(block, cfg, autocast=False)
    assert forward["gemm"] == forward_gemms
    assert backward["gemm"] == 2 * forward_gemms


@pytest.mark.parametrize("kernels", ["stock", "cpu"])
def test_a_block_norms_bf16_output_is_cast_once(kernels: str) -> None:
    _, block, cfg = _block(kernels)
    forward, _ = _count(block, cfg, autocast=True)
    assert forward["activation casts"] == 2  # attn_norm's and mlp_norm's outputs, once each


def test_fusion_keeps_the_separate_parameters_in_their_order() -> None:
    model, _, _ = _block("stock")
    names = [n for n, _ in model.named_parameters() if n.startswith("blocks.0.")]
    assert names == [f"blocks.0.{n}.weight" for n in ("attn_norm", "attn.q_proj", "attn.k_proj", "attn.v_proj",
                                                     "attn.o_proj", "mlp_norm", "mlp.gate_proj", "mlp.up_proj",
                                                     "mlp.down_proj")]
    assert tuple(model.blocks["0"].attn.k_proj.weight.shape) == (32, 64)  # 2 kv heads of 16


def test_projections_split_the_stacked_gemm_like_the_separate_ones() -> None:
    torch.manual_seed(0)
    x = torch.randn(3, 5, 8, dtype=torch.float64)
    weights = [torch.randn(rows, 8, dtype=torch.float64) for rows in (8, 4, 4)]
    for kernels in ("stock", "cpu"):
        outputs = projections(x, weights, kernels)
        assert [tuple(o.shape) for o in outputs] == [(3, 5, 8), (3, 5, 4), (3, 5, 4)]
        for got, w in zip(outputs, weights):
            torch.testing.assert_close(got, x @ w.t(), rtol=1e-12, atol=1e-12)
