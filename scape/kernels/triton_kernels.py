"""Triton versions of the reference kernels, used on CUDA.

Each kernel fuses what the reference does in several PyTorch passes (one read and one write per
touched element). They are tested against ``reference`` on CPU with ``TRITON_INTERPRET=1``
(the interpreter is chosen when this module is imported, so set the variable first).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from scape.kernels.reference import code_layout

_BLOCK = 1024
_BYTE_BLOCK = 256


@triton.jit
def _bf16_bits(value):
    """fp32 -> its bf16 rounding, as the fp32 bit pattern (low half zero): round to nearest even
    on the bits, the same result as torch's cast on the GPU and under the interpreter, whose own
    float cast truncates. A NaN keeps its sign and becomes quiet: rounding its payload would carry
    into the exponent and sign (CUDA's NaN 0x7FFFFFFF would become -0.0), sending a NaN as zero."""
    bits = value.to(tl.uint32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    is_nan = (bits & 0x7FFFFFFF) > 0x7F800000
    return tl.where(is_nan, (bits | 0x00400000) & 0xFFFF0000, rounded)


@triton.jit
def _pack_bits_kernel(mask_ptr, out_ptr, n_bytes, BLOCK: tl.constexpr):
    byte = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    bit = tl.arange(0, 8)
    valid = byte < n_bytes
    offsets = byte[:, None] * 8 + bit[None, :]
    bits = tl.load(mask_ptr + offsets, mask=valid[:, None], other=0).to(tl.int32)
    packed = tl.sum(bits << bit[None, :], axis=1)
    tl.store(out_ptr + byte, packed.to(tl.uint8), mask=valid)


@triton.jit
def _unpack_bits_kernel(packed_ptr, out_ptr, n_bytes, BLOCK: tl.constexpr):
    byte = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    bit = tl.arange(0, 8)
    valid = byte < n_bytes
    packed = tl.load(packed_ptr + byte, mask=valid, other=0).to(tl.int32)
    bits = (packed[:, None] >> bit[None, :]) & 1
    offsets = byte[:, None] * 8 + bit[None, :]
    tl.store(out_ptr + offsets, bits.to(tl.uint8), mask=valid[:, None])


@triton.jit
def _gather_and_clear_kernel(source_ptr, index_ptr, out_ptr, n, KEEP_REMAINDER: tl.constexpr,
                             BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    valid = i < n
    j = tl.load(index_ptr + i, mask=valid, other=0)
    value = tl.load(source_ptr + j, mask=valid, other=0.0)
    if KEEP_REMAINDER:
        rounded = _bf16_bits(value)  # out_ptr is the bf16 buffer viewed as int16
        tl.store(out_ptr + i, (rounded >> 16).to(tl.int16), mask=valid)
        tl.store(source_ptr + j, value - rounded.to(tl.float32, bitcast=True), mask=valid)
    else:
        tl.store(out_ptr + i, value, mask=valid)
        tl.store(source_ptr + j, tl.zeros_like(value), mask=valid)


@triton.jit
def _scatter_kernel(target_ptr, index_ptr, values_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    valid = i < n
    j = tl.load(index_ptr + i, mask=valid, other=0)
    value = tl.load(values_ptr + i, mask=valid, other=0.0)
    tl.store(target_ptr + j, value.to(target_ptr.dtype.element_ty), mask=valid)


@triton.jit
def _adams_masked_kernel(param_ptr, momentum_ptr, index_ptr, grad_ptr, scale_ptr, n, lr, beta1,
                         beta2, eps, bias_correction, HAS_SCALE: tl.constexpr,
                         BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    valid = i < n
    j = tl.load(index_ptr + i, mask=valid, other=0)
    g = tl.load(grad_ptr + i, mask=valid, other=0.0)
    m = tl.load(momentum_ptr + j, mask=valid, other=0.0)
    p = tl.load(param_ptr + j, mask=valid, other=0.0)
    m_hat = m / bias_correction
    denom = tl.sqrt_rn(beta2 * m_hat * m_hat + (1.0 - beta2) * g * g) + eps
    m = beta1 * m + (1.0 - beta1) * g
    step = (m / bias_correction) / denom
    if HAS_SCALE:
        step = step * tl.load(scale_ptr + i, mask=valid, other=0.0)
    tl.store(param_ptr + j, p - lr * step, mask=valid)
    tl.store(momentum_ptr + j, m, mask=valid)


@triton.jit
def _adams_dense_kernel(param_ptr, momentum_ptr, grad_ptr, n, lr, beta1, beta2, eps,
                        bias_correction, decay_factor, decay_end, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    valid = i < n
    g = tl.load(grad_ptr + i, mask=valid, other=0.0)
    m = tl.load(momentum_ptr + i, mask=valid, other=0.0)
    p = tl.load(param_ptr + i, mask=valid, other=0.0)
    p = tl.where(i < decay_end, p * decay_factor, p)
    m_hat = m / bias_correction
    denom = tl.sqrt_rn(beta2 * m_hat * m_hat + (1.0 - beta2) * g * g) + eps
    m = beta1 * m + (1.0 - beta1) * g
    tl.store(param_ptr + i, p - lr * ((m / bias_correction) / denom), mask=valid)
    tl.store(momentum_ptr + i, m, mask=valid)


@triton.jit
def _quantize_kernel(values_ptr, packed_ptr, scale_ptr, read_back_ptr, count, n_packed, n_blocks,
                     step_per_rms, BITS: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr,
                     SCALE_BF16: tl.constexpr, ZERO: tl.constexpr, SHIFT: tl.constexpr, TOP: tl.constexpr):
    # ROWS blocks of BLOCK values a program: the scale, the codes, their read-back and the packed
    # bytes in one read of the values (the reference takes a pass for each)
    PER_BYTE: tl.constexpr = 8 // BITS
    row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    i = row[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    valid = i < count
    v = tl.load(values_ptr + i, mask=valid, other=0.0)  # a partial last block: zero-padded
    scale = tl.sqrt_rn(tl.sum(v * v, axis=1) / BLOCK) * step_per_rms
    if SCALE_BF16:  # a NaN or Inf scale stays one: the block reads back non-finite
        rounded = _bf16_bits(scale)
        tl.store(scale_ptr + row, (rounded >> 16).to(tl.int16), mask=row < n_blocks)
        scale = rounded.to(tl.float32, bitcast=True)
    else:
        tl.store(scale_ptr + row, scale, mask=row < n_blocks)
    step = scale[:, None]
    codes = tl.floor(tl.div_rn(v, tl.where(step > 0, step, 1.0)) + SHIFT) + ZERO  # reference.code_layout
    codes = tl.minimum(tl.maximum(codes, 0.0), TOP)
    tl.store(read_back_ptr + i, (codes - (ZERO - 0.5 + SHIFT)) * step, mask=valid)
    # code j of a byte in its bits [j b, (j + 1) b)
    grouped = tl.reshape(codes.to(tl.int32), (ROWS, BLOCK // PER_BYTE, PER_BYTE))
    shifts = tl.arange(0, PER_BYTE) * BITS
    packed = tl.sum(grouped << shifts[None, None, :], axis=2)
    byte = row[:, None] * (BLOCK // PER_BYTE) + tl.arange(0, BLOCK // PER_BYTE)[None, :]
    tl.store(packed_ptr + byte, packed.to(tl.uint8), mask=byte < n_packed)


def pack_bits(mask: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    n_bytes = out.numel()
    _pack_bits_kernel[(triton.cdiv(n_bytes, _BYTE_BLOCK),)](mask.view(torch.uint8), out, n_bytes,
                                                          BLOCK=_BYTE_BLOCK)
    return out


def unpack_bits(packed: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    n_bytes = packed.numel()
    _unpack_bits_kernel[(triton.cdiv(n_bytes, _BYTE_BLOCK),)](packed, out.view(torch.uint8),
                                                            n_bytes, BLOCK=_BYTE_BLOCK)
    return out


def gather_and_clear(source: torch.Tensor, indices: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    n = indices.numel()
    if n:
        _gather_and_clear_kernel[(triton.cdiv(n, _BLOCK),)](
            source, indices, out if out.dtype == torch.float32 else out.view(torch.int16), n,
            KEEP_REMAINDER=out.dtype != torch.float32, BLOCK=_BLOCK)
    return out


def scatter(target: torch.Tensor, indices: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    n = indices.numel()
    if n:
        _scatter_kernel[(triton.cdiv(n, _BLOCK),)](target, indices, values, n, BLOCK=_BLOCK)
    return target


def adams_masked_update(param: torch.Tensor, momentum: torch.Tensor, indices: torch.Tensor,
                        grad: torch.Tensor, lr: float, beta1: float, beta2: float, eps: float,
                        bias_correction: float, scale: Optional[torch.Tensor] = None) -> None:
    n = indices.numel()
    if n:
        _adams_masked_kernel[(triton.cdiv(n, _BLOCK),)](
            param, momentum, indices, grad, scale if scale is not None else grad, n, lr, beta1,
            beta2, eps, bias_correction, HAS_SCALE=scale is not None, BLOCK=_BLOCK)


def adams_dense_update(param: torch.Tensor, momentum: torch.Tensor, grad: torch.Tensor, lr: float,
                       beta1: float, beta2: float, eps: float, bias_correction: float,
                       weight_decay: float, decay_end: int) -> None:
    n = param.numel()
    _adams_dense_kernel[(triton.cdiv(n, _BLOCK),)](
        param, momentum, grad, n, lr, beta1, beta2, eps, bias_correction,
        1.0 - lr * weight_decay, decay_end, BLOCK=_BLOCK)


def quantize_blocks(values: torch.Tensor, bits: int, step_per_rms: float, block: int,
                    scale_dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if scale_dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"quantized scales travel as bf16 or fp32, not {scale_dtype}")
    count = values.numel()
    n_blocks, n_packed = triton.cdiv(count, block), triton.cdiv(count * bits, 8)
    packed = torch.empty(n_packed, dtype=torch.uint8, device=values.device)
    scale = torch.empty(n_blocks, dtype=scale_dtype, device=values.device)
    read_back = torch.empty(count, dtype=torch.float32, device=values.device)
    if count:
        rows = 16
        zero, shift, top = code_layout(bits)
        _quantize_kernel[(triton.cdiv(n_blocks, rows),)](
            values.contiguous(), packed, scale.view(torch.int16) if scale_dtype == torch.bfloat16 else scale,
            read_back, count, n_packed, n_blocks, step_per_rms, BITS=bits, BLOCK=block, ROWS=rows,
            SCALE_BF16=scale_dtype == torch.bfloat16, ZERO=zero, SHIFT=shift, TOP=top)
    return packed, scale, read_back
