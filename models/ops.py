"""The transformer's elementwise parts and attention, on stock PyTorch operations by default.

``model.kernels`` chooses the implementation: ``stock`` is plain RoPE and SwiGLU, ``F.rms_norm``
and SDPA (flash-attn on CUDA when installed), which read like nanoGPT and compile well on GPUs;
``cpu`` is models/cpu_kernels.py (hand-written backward passes, blocked attention for short fp32
sequences on CPU tensors); ``auto`` (the default) takes the CPU kernels on CPU tensors and the
stock path everywhere else. Both paths compute the same functions (tests/models/test_ops.py).
"""
from __future__ import annotations

from typing import Literal, Sequence, Tuple

import torch
import torch.nn.functional as F

from models import cpu_kernels

Kernels = Literal["auto", "stock", "cpu"]

# With the CPU kernels and ``model.attention=auto``, fp32 attention on CPU up to this length is
# cpu_kernels.block_causal_attention (its memory grows as T^2; beyond ~512 SDPA is the better trade).
BLOCK_ATTENTION_MAX_LENGTH = 512


def cpu_path(kernels: str, x: torch.Tensor) -> bool:
    return kernels == "cpu" or (kernels == "auto" and x.device.type == "cpu")


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kernels: str = "auto") -> torch.Tensor:
    """RoPE in Llama's half-split layout: x [B, T, H, hd], cos/sin [T, 1, hd/2] fp32 tables (cast to
    x's dtype, as transformers does)."""
    if cpu_path(kernels, x):
        return cpu_kernels.apply_rotary(x, cos, sin)
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def swiglu(gate: torch.Tensor, up: torch.Tensor, kernels: str = "auto") -> torch.Tensor:
    """silu(gate) * up."""
    if cpu_path(kernels, gate):
        return cpu_kernels.swiglu(gate, up)
    return F.silu(gate) * up


def projections(x: torch.Tensor, weights: Sequence[torch.Tensor], kernels: str = "auto") -> Tuple[torch.Tensor, ...]:
    """``x @ w.T`` for each of ``weights`` (bias-free projections of one input, e.g. q/k/v).

    On the stock path one GEMM over the weights stacked per call (cast to autocast's dtype
    first, so the copy is the bf16 one and under torch.compile it fuses into the casts autocast
    makes anyway); the outputs are column slices of its result. On the CPU kernels one GEMM per
    weight: a stacked GEMM gives the same outputs and weight gradients bit for bit, but sums the
    input's gradient over all the weights in one reduction instead of adding three GEMMs' sums,
    which moves its low bits (and the golden tests' pinned losses) for no speed on CPU.
    """
    if cpu_path(kernels, x) or len(weights) == 1:
        return tuple(F.linear(x, w) for w in weights)
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        weights = [w.to(dtype) for w in weights]
    fused = F.linear(x, torch.cat(tuple(weights)))
    return fused.split([w.shape[0] for w in weights], dim=-1)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, kernels: str = "auto") -> torch.Tensor:
    """RMSNorm over the last dimension, scaled by ``weight``."""
    if cpu_path(kernels, x):
        return cpu_kernels.rms_norm(x, weight, eps)
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


_FLASH_ATTN = None


def flash_attn_installed() -> bool:
    global _FLASH_ATTN
    if _FLASH_ATTN is None:
        try:
            from flash_attn import flash_attn_func  # type: ignore[import-not-found]
            _FLASH_ATTN = flash_attn_func
        except ImportError:
            _FLASH_ATTN = False
    return _FLASH_ATTN is not False


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backend: str,
                     kernels: str = "auto") -> torch.Tensor:
    """Causal self-attention on [B, T, H, hd] queries and [B, T, H_kv, hd] keys/values.

    Returns [B, T, H, hd]. flash-attn takes this layout natively; SDPA wants heads first.
    ``auto``: flash-attn on CUDA when installed (bf16/fp16); with the CPU kernels, blocked matmul
    attention on CPU for fp32 sequences up to BLOCK_ATTENTION_MAX_LENGTH; SDPA otherwise.
    ``sdpa`` always SDPA.
    """
    use_flash = (backend != "sdpa" and q.is_cuda and flash_attn_installed()
                 and q.dtype in (torch.float16, torch.bfloat16))
    if backend == "flash" and not use_flash:
        if not q.is_cuda:
            raise ValueError("model.attention=flash needs CUDA tensors; set model.attention=sdpa "
                             "or auto on this device")
        if q.dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"model.attention=flash needs bf16/fp16 activations (got {q.dtype}); "
                             "train under bf16 autocast or set model.attention=sdpa or auto")
    if use_flash:
        return _FLASH_ATTN(q, k, v, causal=True)
    if (backend == "auto" and cpu_path(kernels, q) and q.device.type == "cpu" and q.dtype == torch.float32
            and q.shape[1] <= BLOCK_ATTENTION_MAX_LENGTH):
        return cpu_kernels.block_causal_attention(q, k, v)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    # Grouped-query attention without copying k/v per query head.
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])
    return y.transpose(1, 2)
