"""The simple gradient noise scale, B_simple = tr(Sigma) / |G|^2 (McCandlish et al. 2018, App. A).

Every step measures the squared norm of one gradient at two batch sizes, both before clipping and
before any synchroniser touches it: the first micro-batch's gradient (``b_small`` tokens, this
rank's own) and the gradient of the whole backward (``b_big`` tokens: this rank's micro-batches,
or all ranks' where the synchroniser reduces during backward, as DDP does). Both ride in the
step's control all-reduce, so they cost no collective of their own; they are averaged over ranks
there. With E|G_b|^2 = |G|^2 + tr(Sigma) / b the two sizes give unbiased estimates of both terms,

    |G|^2     = (b_big |G_big|^2 - b_small |G_small|^2) / (b_big - b_small)
    tr(Sigma) = (|G_small|^2 - |G_big|^2) / (1 / b_small - 1 / b_big)

and, as the paper advises, each is averaged over the steps between two logs before the ratio is
taken (one step's |G|^2 estimate is too noisy to divide by). The scale is in tokens. It needs two
different sizes: at one micro-batch per step without a reducing backward there is nothing to
compare, and no value is logged.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch


def noise_terms(sq_small: float, sq_big: float, b_small: float, b_big: float) -> Tuple[float, float]:
    """(tr(Sigma), |G|^2) from the squared gradient norms at batch sizes ``b_small`` < ``b_big``."""
    if not b_big > b_small > 0:
        raise ValueError(f"the noise scale needs 0 < b_small < b_big, got {b_small} and {b_big}")
    g2 = (b_big * sq_big - b_small * sq_small) / (b_big - b_small)
    trace = (sq_small - sq_big) / (1.0 / b_small - 1.0 / b_big)
    return trace, g2


def simple_noise_scale(sq_small: float, sq_big: float, b_small: float, b_big: float) -> float:
    """B_simple in the units of the batch sizes; NaN while |G|^2's estimate is not positive."""
    trace, g2 = noise_terms(sq_small, sq_big, b_small, b_big)
    return trace / g2 if g2 > 0 else math.nan


def squared_grad_norm(params, device: torch.device) -> torch.Tensor:
    """sum |p.grad|^2 over ``params`` as a float64 scalar on ``device`` (no host read)."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros((), dtype=torch.float64, device=device)
    norms = torch._foreach_norm(grads)
    return torch.stack([n.double() for n in norms]).square().sum()


class NoiseScaleMeter:
    """Sums the steps' squared norms on the device (skipped, non-finite steps left out) and turns
    the sums into B_simple when metrics are logged, so no step reads the host for it."""

    def __init__(self) -> None:
        self._sums: Optional[torch.Tensor] = None  # (sum |G_small|^2, sum |G_big|^2, steps)
        self.b_small = self.b_big = 0.0

    def add(self, sq_small: torch.Tensor, sq_big: torch.Tensor, b_small: float, b_big: float) -> None:
        if not b_big > b_small:
            return
        self.b_small, self.b_big = b_small, b_big
        pair = torch.stack([sq_small, sq_big]).double()
        finite = torch.isfinite(pair).all()
        step = torch.cat([torch.where(finite, pair, torch.zeros_like(pair)), finite.double().reshape(1)])
        self._sums = step if self._sums is None else self._sums + step

    def take(self) -> Optional[float]:
        """B_simple over the steps added since the last call (None: nothing to estimate)."""
        sums, self._sums = self._sums, None
        if sums is None:
            return None
        small, big, steps = sums.tolist()
        if steps == 0:
            return None
        scale = simple_noise_scale(small / steps, big / steps, self.b_small, self.b_big)
        return None if math.isnan(scale) else scale
