"""Block quantization of the drifts sparse averaging sends (``optimizer.value_bits``).

Every ``BLOCK`` consecutive values share one scale: the step of a uniform mid-rise quantizer,
``STEP_PER_RMS[bits]`` times the block's root mean square, the step with the least squared error
on a Gaussian of that RMS (Max, "Quantizing for minimum distortion", 1960). A value v becomes the
code c = clamp(floor(v / step) + 2^(b-1), 0, 2^b - 1) and is read back as
(c - 2^(b-1) + 1/2) step: at 1 bit the sign times the mean absolute value of a Gaussian. A block
of zeros has step 0 and reads back as zeros. The codes are packed 8 / b to a byte.

Mid-rise codes have no level at 0: a value far below its block's RMS reads back as half a step
(a mid-tread variant with a level at 0 lost in the study: docs/JOURNAL.md).

A block holding a NaN or an Inf has a NaN or Inf scale (kept so through the bf16 rounding of the
scale, see ``scape.kernels``) and reads back non-finite, at the sender and at every receiver: the
non-finite policy sees it and skips the step rather than applying zeros.

The caller keeps what the codes do not say (v minus its read-back value) in its copy, as it
keeps bf16's rounding: error feedback, so no drift is lost, only delayed.
"""
from __future__ import annotations

import math
from typing import Tuple

import torch

from scape import kernels

BLOCK = 64
STEP_PER_RMS = {1: 1.596, 2: 0.9957, 4: 0.3352}
BITS = tuple(STEP_PER_RMS)


def packed_nbytes(count: int, bits: int, scale_bytes: int) -> int:
    """Bytes of ``count`` values at ``bits`` each: the packed codes, then one scale per block."""
    return math.ceil(count * bits / 8) + math.ceil(count / BLOCK) * scale_bytes


def _shifts(bits: int, device) -> torch.Tensor:
    return torch.arange(0, 8, bits, dtype=torch.uint8, device=device)


def quantize(values: torch.Tensor, bits: int, scale_dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(packed codes as uint8, one scale per block in ``scale_dtype``, the values they read back
    as) of a 1-D fp32 tensor. The read-back equals ``dequantize`` of the first two, bit for bit:
    the sender's error feedback needs it and need not unpack what it just packed. One pass of a
    Triton kernel on CUDA (``scape.kernels``), the PyTorch reference elsewhere."""
    return kernels.quantize_blocks(values, bits, STEP_PER_RMS[bits], BLOCK, scale_dtype)


def dequantize(packed: torch.Tensor, scale: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """The fp32 values that ``quantize``'s codes and scales stand for (``count`` of them)."""
    codes = (packed[:, None] >> _shifts(bits, packed.device)) & (2 ** bits - 1)
    zero, shift, _ = kernels.reference.code_layout(bits)
    values = codes.view(-1)[:count].float().sub_(zero - 0.5 + shift)
    step, full = scale.float(), count // BLOCK * BLOCK
    values[:full].view(-1, BLOCK).mul_(step[:full // BLOCK, None])
    values[full:].mul_(step[full // BLOCK:])  # the partial last block, if any: its one step
    return values
