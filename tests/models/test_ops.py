"""The CPU kernels (models/cpu_kernels.py) equal autograd through the textbook forms, and the model
on the stock path (model.kernels=stock) equals the model on the CPU kernels."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from models import ops
from models.common import RotaryEmbedding
from models.cpu_kernels import apply_rotary, block_causal_attention, rms_norm, swiglu


def _values_and_grads(fn, inputs, grad_out):
    inputs = [t.detach().clone().requires_grad_(True) for t in inputs]
    out = fn(*inputs)
    out.backward(grad_out)
    return out.detach(), [t.grad for t in inputs]


def _assert_same(fn, reference, inputs, atol=1e-6, rtol=1e-5):
    grad_out = torch.randn_like(reference(*inputs))
    got, got_grads = _values_and_grads(fn, inputs, grad_out)
    want, want_grads = _values_and_grads(reference, inputs, grad_out)
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, atol=atol, rtol=rtol)


def test_rotary_equals_transformers_formula_on_strided_input() -> None:
    from transformers.models.llama.modeling_llama import rotate_half

    torch.manual_seed(0)
    cos, sin = RotaryEmbedding(head_dim=16, theta=10000.0).cos_sin(12, torch.device("cpu"))
    full_cos, full_sin = torch.cat((cos, cos), -1), torch.cat((sin, sin), -1)
    # A slice of a wider tensor, as the q/k heads of the fused qkv projection are.
    qkv = torch.randn(3, 12, 7, 16)

    def reference(x):
        return x[:, :, :5] * full_cos + rotate_half(x[:, :, :5]) * full_sin

    _assert_same(lambda x: apply_rotary(x[:, :, :5], cos, sin), reference, [qkv])


@pytest.mark.parametrize("hidden", [24, 0])
def test_swiglu_equals_silu_gate_times_up(hidden: int) -> None:
    torch.manual_seed(1)
    gate, up = torch.randn(4, 5, hidden), torch.randn(4, 5, hidden)
    _assert_same(swiglu, lambda g, u: F.silu(g) * u, [gate, up])


def test_rms_norm_equals_pytorch_and_passes_gradcheck() -> None:
    torch.manual_seed(2)
    x, weight = torch.randn(3, 9, 32) * 3, torch.randn(32)
    _assert_same(lambda a, w: rms_norm(a, w, 1e-5), lambda a, w: F.rms_norm(a, (32,), w, 1e-5),
                 [x, weight])
    x64 = torch.randn(2, 3, 8, dtype=torch.float64, requires_grad=True)
    w64 = torch.randn(8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, w: rms_norm(a, w, 1e-6), (x64, w64))


def _sdpa_causal(q, k, v):
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         is_causal=True, enable_gqa=k.shape[2] != q.shape[2])
    return out.transpose(1, 2)


@pytest.mark.parametrize("length,heads,kv_heads", [(100, 4, 2), (64, 4, 4), (130, 6, 2), (7, 2, 1)])
def test_block_causal_attention_equals_sdpa(length: int, heads: int, kv_heads: int) -> None:
    """Whole blocks, a padded last block, MHA and GQA; q as a strided slice of a wider tensor."""
    torch.manual_seed(3)
    wide = torch.randn(2, length, heads + 1, 16)
    k, v = torch.randn(2, length, kv_heads, 16), torch.randn(2, length, kv_heads, 16)
    _assert_same(lambda w, k_, v_: block_causal_attention(w[:, :, :heads], k_, v_),
                 lambda w, k_, v_: _sdpa_causal(w[:, :, :heads], k_, v_), [wide, k, v], atol=2e-6)


def test_block_causal_attention_passes_gradcheck() -> None:
    torch.manual_seed(4)
    q = torch.randn(1, 70, 2, 4, dtype=torch.float64, requires_grad=True)  # two blocks, padded
    k = torch.randn(1, 70, 1, 4, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 70, 1, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(block_causal_attention, (q, k, v))


def test_auto_attention_uses_blocks_on_cpu_for_short_fp32_sequences(monkeypatch) -> None:
    calls = []
    monkeypatch.setattr(ops.cpu_kernels, "block_causal_attention",
                        lambda *args: calls.append(args[0].shape[1]) or block_causal_attention(*args))
    q, k, v = torch.randn(1, 8, 2, 4), torch.randn(1, 8, 1, 4), torch.randn(1, 8, 1, 4)
    expected = _sdpa_causal(q, k, v)
    for backend in ("auto", "sdpa"):
        torch.testing.assert_close(ops.causal_attention(q, k, v, backend), expected)
    ops.causal_attention(q, k, v, "auto", kernels="stock")  # the stock path: SDPA
    monkeypatch.setattr(ops, "BLOCK_ATTENTION_MAX_LENGTH", 4)
    ops.causal_attention(q, k, v, "auto")  # longer than the limit: SDPA
    ops.causal_attention(q.double(), k.double(), v.double(), "auto")  # not fp32: SDPA
    assert calls == [8]


@pytest.mark.parametrize("family", ["llama", "gpt"])
@pytest.mark.parametrize("loss", ["fused", "standard"])
def test_the_stock_path_equals_the_cpu_kernels(family: str, loss: str) -> None:
    """model.kernels=stock and =cpu: the same losses and gradients (and model.loss either way)."""
    import dataclasses

    from models import build_model, load_model_config

    base = dataclasses.replace(load_model_config(f"tiny_{family}"), n_layer=2, d_model=64, n_head=4,
                               ffn_hidden=96, vocab_size=256, seq_len=48, loss=loss)
    if family == "llama":
        base = dataclasses.replace(base, n_kv_head=2)
    x = torch.randint(0, base.vocab_size, (3, base.seq_len + 1), generator=torch.Generator().manual_seed(0))
    results = {}
    for kernels in ("stock", "cpu"):
        torch.manual_seed(0)
        model = build_model(dataclasses.replace(base, kernels=kernels))
        loss_value = model(x[:, :-1], x[:, 1:])
        loss_value.backward()
        results[kernels] = (loss_value.detach(), {n: p.grad for n, p in model.named_parameters()})
    (stock_loss, stock_grads), (cpu_loss, cpu_grads) = results["stock"], results["cpu"]
    torch.testing.assert_close(stock_loss, cpu_loss, atol=1e-5, rtol=1e-5)
    for name, grad in stock_grads.items():
        torch.testing.assert_close(grad, cpu_grads[name], atol=1e-5, rtol=1e-4, msg=name)


def test_auto_kernels_take_the_cpu_kernels_on_cpu_only() -> None:
    x = torch.randn(2, 3)
    assert ops.cpu_path("auto", x) and ops.cpu_path("cpu", x) and not ops.cpu_path("stock", x)
    assert not ops.cpu_path("auto", torch.empty(2, 3, device="meta"))
