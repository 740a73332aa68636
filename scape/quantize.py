"""Block quantization of the drifts sparse averaging sends (``optimizer.value_bits``).

Every ``BLOCK`` consecutive values share one scale: the step of a uniform mid-rise quantizer,
``STEP_PER_RMS[bits]`` times the block's root mean square, the step with the least squared error
on a Gaussian of that RMS (Max, "Quantizing for minimum distortion", 1960). A value v becomes the
code c = clamp(floor(v / step) + 2^(b-1), 0, 2^b - 1) and is read back as
(c - 2^(b-1) + 1/2) step: at 1 bit the sign times the mean absolute value of a Gaussian. A block
of zeros has step 0 and reads back as zeros. The codes are packed 8 / b to a byte.

The caller keeps what the codes do not say (v minus its read-back value) in its copy, as it
keeps bf16's rounding: error feedback, so no drift is lost, only delayed.
"""
from __future__ import annotations

import math
from typing import Tuple

import torch

BLOCK = 64
STEP_PER_RMS = {1: 1.596, 2: 0.9957, 4: 0.3352}
BITS = tuple(STEP_PER_RMS)


def packed_nbytes(count: int, bits: int, scale_bytes: int) -> int:
    """Bytes of ``count`` values at ``bits`` each: the packed codes, then one scale per block."""
    return math.ceil(count * bits / 8) + math.ceil(count / BLOCK) * scale_bytes


def _shifts(bits: int, device) -> torch.Tensor:
    return torch.arange(0, 8, bits, dtype=torch.uint8, device=device)


def _blocks(values: torch.Tensor) -> torch.Tensor:
    """``values`` as rows of BLOCK, zero-padded at the end (a view when the length allows)."""
    count = values.numel()
    padded = math.ceil(count / BLOCK) * BLOCK
    if padded == count and values.is_contiguous():
        return values.view(-1, BLOCK)
    blocks = torch.zeros(padded, dtype=torch.float32, device=values.device)
    blocks[:count] = values
    return blocks.view(-1, BLOCK)


def quantize(values: torch.Tensor, bits: int,
             scale_dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(packed codes as uint8, one scale per block in ``scale_dtype``, the values they read back
    as) of a 1-D fp32 tensor. The read-back equals ``dequantize`` of the first two, bit for bit:
    the sender's error feedback needs it and need not unpack what it just packed."""
    count = values.numel()
    blocks = _blocks(values)
    # the scale is rounded to what travels first, so that both ends read the same step
    scale = blocks.square().mean(dim=1).sqrt_().mul_(STEP_PER_RMS[bits]).to(scale_dtype)
    step = scale.float()[:, None]
    half = 2 ** (bits - 1)
    codes = torch.div(blocks, torch.where(step > 0, step, 1.0)).floor_().add_(half).clamp_(0, 2 ** bits - 1)
    read_back = (codes - (half - 0.5)).mul_(step).view(-1)[:count]
    per_byte = 8 // bits
    codes = codes.view(-1)[:math.ceil(count / per_byte) * per_byte].to(torch.uint8).view(-1, per_byte)
    packed = codes[:, 0].clone()
    for place in range(1, per_byte):  # code j of a byte in its bits [j b, (j + 1) b)
        packed.bitwise_or_(codes[:, place] << (place * bits))
    return packed, scale, read_back


def dequantize(packed: torch.Tensor, scale: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """The fp32 values that ``quantize``'s codes and scales stand for (``count`` of them)."""
    codes = (packed[:, None] >> _shifts(bits, packed.device)) & (2 ** bits - 1)
    values = codes.view(-1)[:count].float().sub_(2 ** (bits - 1) - 0.5)
    step, full = scale.float(), count // BLOCK * BLOCK
    values[:full].view(-1, BLOCK).mul_(step[:full // BLOCK, None])
    values[full:].mul_(step[full // BLOCK:])  # the partial last block, if any: its one step
    return values
