"""PyTorch reference kernels: the definition every Triton kernel is tested against.

They run on any device and are what SCAPE uses on CPU. Each function mutates its output
arguments in place (like the Triton versions) so the two are drop-in replacements.
"""
from __future__ import annotations

import math
import sys
from typing import Optional, Tuple

import torch

_BIT_WEIGHTS = {}
_LITTLE_ENDIAN = sys.byteorder == "little"


def _signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


# Byte i of a little-endian int64 holds mask element i of a group of 8. Multiplying by GATHER
# moves bit 0 of byte i to bit 56 + i with no carries, so (x * GATHER) >> 56 is the packed byte.
_GATHER = _signed(0x0102040810204080)
# The reverse: spread a byte to all 8 bytes, keep bit i in byte i, turn it into 0/1 per byte.
_SPREAD = 0x0101010101010101
_SELECT = _signed(0x8040201008040201)
_CARRY = 0x7F7F7F7F7F7F7F7F


def _bit_weights(device: torch.device) -> torch.Tensor:
    weights = _BIT_WEIGHTS.get(device)
    if weights is None:
        weights = torch.tensor([1 << b for b in range(8)], dtype=torch.uint8, device=device)
        _BIT_WEIGHTS[device] = weights
    return weights


def pack_bits(mask: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Pack a bool mask of length 8n into n bytes, element 8i+b in bit b of byte i (LSB-first)."""
    if _LITTLE_ENDIAN and mask.is_contiguous():
        groups = mask.view(torch.uint8).view(torch.int64)
        out.copy_(torch.bitwise_right_shift(groups * _GATHER, 56))
        return out
    bits = mask.view(torch.uint8).view(-1, 8)
    torch.sum(bits * _bit_weights(mask.device), dim=1, dtype=torch.uint8, out=out)
    return out


def unpack_bits(packed: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Inverse of ``pack_bits``: ``out`` is a bool tensor of length 8 * len(packed)."""
    if _LITTLE_ENDIAN and out.is_contiguous():
        spread = (packed.to(torch.int64) * _SPREAD).bitwise_and_(_SELECT).add_(_CARRY)
        ones = torch.bitwise_right_shift(spread, 7).bitwise_and_(_SPREAD)
        out.view(torch.uint8).view(torch.int64).copy_(ones)
        return out
    bits = torch.bitwise_and(packed.unsqueeze(1), _bit_weights(packed.device)).ne(0)
    out.view(-1, 8).copy_(bits)
    return out


def set_bit_positions(packed: torch.Tensor) -> torch.Tensor:
    """Ascending positions of the set bits of a packed mask (scans bytes, not bits)."""
    byte_positions = torch.nonzero(packed).squeeze(1)
    bits = torch.bitwise_and(packed.index_select(0, byte_positions).unsqueeze(1),
                             _bit_weights(packed.device)).ne(0)
    positions = byte_positions.unsqueeze(1) * 8 + torch.arange(8, device=packed.device)
    return positions[bits]


def gather_and_clear(source: torch.Tensor, indices: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out = source[indices]`` (cast to out's dtype); ``source[indices]`` keeps what was not sent.

    This is SCAPE's error feedback in one step: in fp32 the sent values leave the residual
    entirely; with a bf16 payload the rounding error stays in the residual, so sent plus residual
    is still exactly the contribution.
    """
    values = source.index_select(0, indices)
    out.copy_(values)
    if out.dtype == torch.float32:
        source.index_fill_(0, indices, 0.0)
    else:
        source.index_copy_(0, indices, values - out.float())
    return out


def scatter(target: torch.Tensor, indices: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``target[indices] = values``."""
    target.index_copy_(0, indices, values.to(target.dtype))
    return target


def adams_masked_update(param: torch.Tensor, momentum: torch.Tensor, indices: torch.Tensor,
                        grad: torch.Tensor, lr: float, beta1: float, beta2: float, eps: float,
                        bias_correction: float, scale: Optional[torch.Tensor] = None) -> None:
    """AdamS on the coordinates ``indices`` only (SCAPE's lazy rule); ``grad`` holds their ghat.

    ``scale`` (optional, per masked coordinate) multiplies the step: the stale-scale rule.
    Weight decay is not applied here: it covers every coordinate and runs as its own pass.
    """
    m_prev = momentum.index_select(0, indices)
    denom = (m_prev / bias_correction).square_().mul_(beta2)
    denom.addcmul_(grad, grad, value=1.0 - beta2).sqrt_().add_(eps)
    m_new = m_prev.mul_(beta1).add_(grad, alpha=1.0 - beta1)
    step = (m_new / bias_correction).div_(denom)
    if scale is not None:
        step.mul_(scale)
    param.index_add_(0, indices, step, alpha=-lr)
    momentum.index_copy_(0, indices, m_new)


def adams_dense_update(param: torch.Tensor, momentum: torch.Tensor, grad: torch.Tensor, lr: float,
                       beta1: float, beta2: float, eps: float, bias_correction: float,
                       weight_decay: float, decay_end: int) -> None:
    """Dense AdamS over the whole flat buffer, decoupled weight decay on ``[0, decay_end)``.

    The decay comes first, as in dense AdamS (p = p (1 - lr wd), then the step), so that
    SCAPE at density 1 reproduces it to float tolerance.
    """
    if weight_decay != 0.0 and decay_end > 0:
        param[:decay_end].mul_(1.0 - lr * weight_decay)
    denom = (momentum / bias_correction).square_().mul_(beta2)
    denom.addcmul_(grad, grad, value=1.0 - beta2).sqrt_().add_(eps)
    momentum.mul_(beta1).add_(grad, alpha=1.0 - beta1)
    param.addcdiv_(momentum / bias_correction, denom, value=-lr)


def code_layout(bits: int) -> Tuple[int, float, int]:
    """(the code of the level just above 0, what is added to v / step before the floor, the top
    code): mid-rise, 2^b levels at (c - 2^(b-1) + 1/2) step."""
    return 2 ** (bits - 1), 0.0, 2 ** bits - 1


def quantize_blocks(values: torch.Tensor, bits: int, step_per_rms: float, block: int,
                    scale_dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``scape.quantize.quantize``: (packed codes, one scale per block, the values they read back as)."""
    count = values.numel()
    padded = math.ceil(count / block) * block
    if padded == count and values.is_contiguous():
        blocks = values.view(-1, block)
    else:  # zero-padded at the end
        blocks = torch.zeros(padded, dtype=torch.float32, device=values.device)
        blocks[:count] = values
        blocks = blocks.view(-1, block)
    # the scale is rounded to what travels first, so that both ends read the same step
    scale = blocks.square().mean(dim=1).sqrt_().mul_(step_per_rms).to(scale_dtype)
    step = scale.float()[:, None]
    zero, shift, top = code_layout(bits)
    codes = torch.div(blocks, torch.where(step > 0, step, 1.0)).add_(shift).floor_().add_(zero).clamp_(0, top)
    read_back = (codes - (zero - 0.5 + shift)).mul_(step).view(-1)[:count]
    per_byte = 8 // bits
    codes = codes.view(-1)[:math.ceil(count / per_byte) * per_byte].to(torch.uint8).view(-1, per_byte)
    packed = codes[:, 0].clone()
    for place in range(1, per_byte):  # code j of a byte in its bits [j b, (j + 1) b)
        packed.bitwise_or_(codes[:, place] << (place * bits))
    return packed, scale, read_back
