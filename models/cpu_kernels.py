"""CPU kernels: parts of the transformer block with hand-written backward passes, and blocked
causal attention for short fp32 sequences. ``model.kernels=cpu`` (or ``auto`` on a CPU) selects
them in models/ops.py; the stock path computes the same functions (tests/models/test_ops.py).

Why: in eager mode every PyTorch op is one pass over memory plus a fresh temporary (on CPU a
fresh multi-MB block is often new pages from the OS, faulted in and zeroed), and autograd adds
more in backward. RoPE written the textbook way (``x * cos + rotate_half(x) * sin``) costs five
passes forward and about eight backward (the gradients of ``cat`` and slicing are zero-filled
buffers); here it is two and two. SwiGLU saves only its inputs and computes its backward with
aten's fused silu derivative, writing in place. RMSNorm on CPU, where PyTorch runs and
differentiates its composite form, gets a three-pass forward that keeps its 1/rms for a backward
of a few passes. Same functions as transformers' LlamaForCausalLM (gradients in
test_hf_parity.py); torch.compile traces through them like any autograd.Function. What these
kernels save is measured in docs/RESULTS.md ("Forward+backward speed against transformers").
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sign: float) -> torch.Tensor:
    """Rotate each (x1, x2) half-pair by +angle (sign=1) or -angle (sign=-1) into a new tensor."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    if torch.compiler.is_compiling():
        # Dynamo cannot trace out= into views (a graph break whose resumed graph Inductor then
        # fails to lower); the compiler fuses this functional form into one pass anyway.
        return torch.cat((x1 * cos - sign * x2 * sin, x2 * cos + sign * x1 * sin), dim=-1)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    out1, out2 = out[..., :half], out[..., half:]
    torch.mul(x1, cos, out=out1)
    out1.addcmul_(x2, sin, value=-sign)   # x1 cos - x2 sin
    torch.mul(x2, cos, out=out2)
    out2.addcmul_(x1, sin, value=sign)    # x2 cos + x1 sin
    return out


class _Rotary(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(cos, sin)
        return _rotate(x, cos, sin, 1.0)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor):
        cos, sin = ctx.saved_tensors
        # A rotation's transpose is the rotation by the opposite angle.
        return _rotate(grad, cos, sin, -1.0), None, None


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE in Llama's half-split layout: x [B, T, H, hd] (any strides), cos/sin [T, 1, hd/2]
    fp32 tables, cast to x's dtype as transformers does. Returns a new contiguous tensor."""
    return _Rotary.apply(x, cos.to(x.dtype), sin.to(x.dtype))


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        return F.silu(gate).mul_(up)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor):
        gate, up = ctx.saved_tensors
        grad_up = F.silu(gate).mul_(grad)
        grad_gate = torch.mul(grad, up)
        # aten's fused silu derivative (elementwise, so it may overwrite its own input).
        torch.ops.aten.silu_backward.grad_input(grad_gate, gate, grad_input=grad_gate)
        return grad_gate, grad_up


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up."""
    return _SwiGLU.apply(gate, up)


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        # y = w * x * r, r = rsqrt(mean(x^2) + eps): three passes (F.rms_norm's CPU composite
        # takes four and three temporaries), and r [.., 1] is kept for backward.
        rstd = torch.linalg.vector_norm(x, dim=-1, keepdim=True).square_().div_(x.shape[-1]).add_(eps).rsqrt_()
        ctx.save_for_backward(x, weight, rstd)
        return torch.mul(x, rstd).mul_(weight)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor):
        x, weight, rstd = ctx.saved_tensors
        dim = x.shape[-1]
        normed = x * rstd
        grad_times_normed = grad * normed
        grad_weight = grad_times_normed.reshape(-1, dim).sum(0) if weight.requires_grad else None
        # dx = r (g w - x_hat mean(g w x_hat)); mean(g w x_hat) is a matrix-vector product.
        mean_dot = (grad_times_normed @ weight).div_(dim).unsqueeze(-1)
        grad_x = (grad * weight).addcmul_(normed, mean_dot, value=-1.0).mul_(rstd)
        return grad_x, grad_weight, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """F.rms_norm over the last dimension, on CPU with fewer passes forward and a fused backward
    (PyTorch differentiates through its composite form there). Elsewhere (CUDA has a fused
    backward kernel) it is F.rms_norm itself."""
    if x.device.type != "cpu":
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return _RMSNorm.apply(x, weight, eps)


# ---------------------------------------------------------------------------------------------
# Causal attention on CPU for short sequences

ATTENTION_BLOCK = 64  # query positions per block


def _block_mask(start: int, end: int, group: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """Additive causal mask [(end - start) * group, end]: row (t, g) sees keys 0..t."""
    query = torch.arange(start, end, device=device).repeat_interleave(group)
    keys = torch.arange(end, device=device)
    return torch.zeros(query.numel(), end, device=device, dtype=dtype).masked_fill_(
        keys[None, :] > query[:, None], float("-inf"))


class _BlockCausalAttention(torch.autograd.Function):
    """Exact causal attention as batched matmuls over blocks of 64 query positions.

    Why: for the short sequences of CPU runs SDPA's CPU flash kernel is slow (docs/RESULTS.md);
    here query block i multiplies only against the keys 0..64(i+1) it can see (5/8 of the full
    score matrix at T=256) with MKL batched matmuls and aten's row softmax, and keeps the
    probabilities for backward (no recomputation). Queries live block-major,
    [blocks, B * H_kv, 64 * G, hd], so that every matmul writes a contiguous block (batched
    matmuls into strided slices fall back to one matmul per batch entry), with the G query heads
    that share a k/v head stacked along the rows (k/v are never copied per head). The sequence
    is zero-padded to whole blocks; padded keys lie in every real query's future, so the causal
    mask hides them. Memory is O(T^2) per layer, as in eager attention, hence the length limit
    in models.ops.
    """

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        batch, length, heads, dim = q.shape
        kv_heads = k.shape[2]
        group = heads // kv_heads
        queries = _to_blocks(q, kv_heads)
        padded = queries.shape[0] * ATTENTION_BLOCK
        keys = _padded(k, padded).transpose(1, 2).reshape(batch * kv_heads, padded, dim)
        values = _padded(v, padded).transpose(1, 2).reshape(batch * kv_heads, padded, dim)
        out = torch.empty_like(queries)
        probabilities = []
        for i in range(queries.shape[0]):
            end = (i + 1) * ATTENTION_BLOCK
            mask = _block_mask(i * ATTENTION_BLOCK, end, group, q.device, q.dtype)
            scores = torch.baddbmm(mask, queries[i], keys[:, :end].transpose(1, 2), alpha=dim ** -0.5)
            p = torch.ops.aten._softmax.out(scores, -1, False, out=scores)
            torch.bmm(p, values[:, :end], out=out[i])
            probabilities.append(p)
        ctx.save_for_backward(queries, keys, values, *probabilities)
        ctx.shape = (batch, length, heads, kv_heads, group, dim)
        return _from_blocks(out, batch, length, heads, kv_heads, group, dim)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor):
        queries, keys, values, *probabilities = ctx.saved_tensors
        batch, length, heads, kv_heads, group, dim = ctx.shape
        padded = keys.shape[1]
        scale = dim ** -0.5
        grad_out = _to_blocks(grad, kv_heads)
        grad_queries = torch.empty_like(queries)
        grad_keys = torch.zeros_like(keys)
        grad_values = torch.zeros_like(values)
        for i, p in enumerate(probabilities):
            end = (i + 1) * ATTENTION_BLOCK
            grad_values[:, :end] += torch.bmm(p.transpose(1, 2), grad_out[i])
            grad_p = torch.bmm(grad_out[i], values[:, :end].transpose(1, 2))
            grad_scores = torch.ops.aten._softmax_backward_data(grad_p, p, -1, p.dtype)
            torch.bmm(grad_scores, keys[:, :end], out=grad_queries[i])
            grad_keys[:, :end] += torch.bmm(grad_scores.transpose(1, 2), queries[i])
        grad_queries.mul_(scale)
        grad_keys.mul_(scale)
        return (_from_blocks(grad_queries, batch, length, heads, kv_heads, group, dim),
                grad_keys.view(batch, kv_heads, padded, dim)[:, :, :length].transpose(1, 2),
                grad_values.view(batch, kv_heads, padded, dim)[:, :, :length].transpose(1, 2))


def _padded(x: torch.Tensor, length: int) -> torch.Tensor:
    """[B, T, H, hd] zero-padded along T to ``length``."""
    return x if x.shape[1] == length else F.pad(x, (0, 0, 0, 0, 0, length - x.shape[1]))


def _to_blocks(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[B, T, H, hd] -> [blocks, B * H_kv, 64 * G, hd], zero-padded to whole blocks."""
    batch, length, heads, dim = x.shape
    blocks = -(-length // ATTENTION_BLOCK)
    x = _padded(x, blocks * ATTENTION_BLOCK)
    group = heads // kv_heads
    return x.reshape(batch, blocks, ATTENTION_BLOCK, kv_heads, group, dim).permute(1, 0, 3, 2, 4, 5) \
        .reshape(blocks, batch * kv_heads, ATTENTION_BLOCK * group, dim)


def _from_blocks(x: torch.Tensor, batch: int, length: int, heads: int, kv_heads: int, group: int,
                 dim: int) -> torch.Tensor:
    """The inverse of _to_blocks: -> [B, T, H, hd], padding dropped."""
    blocks = x.shape[0]
    x = x.view(blocks, batch, kv_heads, ATTENTION_BLOCK, group, dim).permute(1, 0, 3, 2, 4, 5)
    return x.reshape(batch, blocks * ATTENTION_BLOCK, heads, dim)[:, :length]


def block_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention, [B, T, H, hd] queries and [B, T, H_kv, hd] keys/values -> [B, T, H, hd],
    equal to SDPA's (tests/models/test_ops.py); meant for CPU and short sequences."""
    return _BlockCausalAttention.apply(q, k, v)
