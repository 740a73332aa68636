"""SCAPE's element-wise kernels: one entry point each, Triton on CUDA, the PyTorch reference elsewhere.

``SCAPE_KERNELS=reference`` forces the reference on CUDA too (to bisect a numerical difference).
The Triton module is imported only on first CUDA use, so CPU runs never need a working Triton.
"""
from __future__ import annotations

import os
from types import ModuleType
from typing import Optional, Tuple

import torch

from scape.kernels import reference

_TRITON: Optional[ModuleType] = None


def _backend(tensor: torch.Tensor) -> ModuleType:
    global _TRITON
    if not tensor.is_cuda or os.environ.get("SCAPE_KERNELS", "auto") == "reference":
        return reference
    if _TRITON is None:
        from scape.kernels import triton_kernels
        _TRITON = triton_kernels
    return _TRITON


def pack_bits(mask: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    return _backend(mask).pack_bits(mask, out)


def unpack_bits(packed: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    return _backend(packed).unpack_bits(packed, out)


def gather_and_clear(source: torch.Tensor, indices: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    return _backend(source).gather_and_clear(source, indices, out)


def scatter(target: torch.Tensor, indices: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    return _backend(target).scatter(target, indices, values)


def adams_masked_update(param: torch.Tensor, momentum: torch.Tensor, indices: torch.Tensor,
                        grad: torch.Tensor, lr: float, beta1: float, beta2: float, eps: float,
                        bias_correction: float, scale: Optional[torch.Tensor] = None) -> None:
    _backend(param).adams_masked_update(param, momentum, indices, grad, lr, beta1, beta2, eps,
                                        bias_correction, scale)


def adams_dense_update(param: torch.Tensor, momentum: torch.Tensor, grad: torch.Tensor, lr: float,
                       beta1: float, beta2: float, eps: float, bias_correction: float,
                       weight_decay: float, decay_end: int) -> None:
    _backend(param).adams_dense_update(param, momentum, grad, lr, beta1, beta2, eps,
                                       bias_correction, weight_decay, decay_end)


def quantize_blocks(values: torch.Tensor, bits: int, step_per_rms: float, block: int,
                    scale_dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _backend(values).quantize_blocks(values, bits, step_per_rms, block, scale_dtype)


def set_bit_positions(packed: torch.Tensor) -> torch.Tensor:
    """Ascending positions of the set bits of a packed mask (PyTorch on every device)."""
    return reference.set_bit_positions(packed)
