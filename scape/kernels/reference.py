"""PyTorch reference kernels: the definition every Triton kernel is tested against.

They run on any device and are what SCAPE uses on CPU. Each function mutates its output
arguments in place (like the Triton versions) so the two are drop-in replacements.
"""
from __future__ import annotations

from typing import Optional

import torch

_BIT_WEIGHTS = {}


def _bit_weights(device: torch.device) -> torch.Tensor:
    weights = _BIT_WEIGHTS.get(device)
    if weights is None:
        weights = torch.tensor([1 << b for b in range(8)], dtype=torch.uint8, device=device)
        _BIT_WEIGHTS[device] = weights
    return weights


def pack_bits(mask: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Pack a bool mask of length 8n into n bytes, element 8i+b in bit b of byte i (LSB-first)."""
    bits = mask.view(torch.uint8).view(-1, 8)
    torch.sum(bits * _bit_weights(mask.device), dim=1, dtype=torch.uint8, out=out)
    return out


def unpack_bits(packed: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Inverse of ``pack_bits``: ``out`` is a bool tensor of length 8 * len(packed)."""
    bits = torch.bitwise_and(packed.unsqueeze(1), _bit_weights(packed.device)).ne_(0)
    out.view(-1, 8).copy_(bits)
    return out


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
