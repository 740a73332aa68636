"""Element-wise parts of the Llama block with hand-written backward passes.

Why: in eager mode every PyTorch op is one pass over memory plus a fresh temporary (on CPU a
fresh multi-MB block is often new pages from the OS, faulted in and zeroed), and autograd adds
more in backward. RoPE written the textbook way (``x * cos + rotate_half(x) * sin``) costs five
passes forward and about eight backward (the gradients of ``cat`` and slicing are zero-filled
buffers); here it is two and two. SwiGLU saves only its inputs and computes its backward with
aten's fused silu derivative, writing in place. RMSNorm on CPU, where PyTorch runs and
differentiates its composite form, gets a three-pass forward that keeps its 1/rms for a backward
of a few passes. Same functions as transformers'
LlamaForCausalLM (tests/models/test_ops.py; gradients in test_hf_parity.py); torch.compile
traces through them like any autograd.Function.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sign: float) -> torch.Tensor:
    """Rotate each (x1, x2) half-pair by +angle (sign=1) or -angle (sign=-1) into a new tensor."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
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
    (PyTorch differentiates through its composite form there: ~4 ms instead of ~0.7 ms for a
    [2048, 256] input here). Elsewhere (CUDA has a fused backward kernel) it is F.rms_norm itself."""
    if x.device.type != "cpu":
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return _RMSNorm.apply(x, weight, eps)
