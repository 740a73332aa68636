"""The dense optimizers, AdamW (torch's) and AdamS, and the config keys every optimizer shares.

AdamS: Adam with the second moment replaced by the momentum itself. Formula and defaults: docs/specs/SCAPE.md, "AdamS (dense)" (official reference:
pku-huzhang/AdamS). One state buffer per parameter (half of AdamW's optimizer memory); the
update |m_t / c| / denom is bounded, which is what lets SCAPE feed it sparse, stale statistics.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Optional, Set, Tuple

import torch

from core.flat import param_groups

DENSE_OPTIMIZERS = ("adamw", "adams")


@dataclass
class DenseOptimizerConfig:
    """The keys of the Hydra group ``optimizer`` that every optimizer reads (each optimizer's
    config adds its own: ``AdamWConfig``, ``AdamSConfig``, scape/config.py); the learning-rate
    schedule and clipping are the Trainer's (trainer/config.py checks them)."""
    name: str = "adamw"  # adamw | adams | scape | sparse_avg
    lr: float = 3e-3
    betas: List[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    weight_decay: float = 0.1  # on tensors with ndim >= 2 only
    grad_clip: float = 1.0  # 0 = off
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1  # the schedule's floor, as a fraction of lr
    lr_schedule: str = "cosine"  # cosine | wsd (warmup-stable-decay; trainer/schedule.py)
    decay_fraction: float = 0.2  # wsd: the final fraction of the steps that decays linearly to the floor
    # true: each rank keeps the optimizer state of its 1/N of the flat parameters (ZeRO-1 for
    # adamw/adams, core/zero.py; sharded SCAPE, scape/sharded.py)
    shard: bool = False
    grad_sync: str = "ddp"  # core.sync.GradSync, the dense arms: ddp (overlapped) | after_backward
    # the learning rate on the embedding tables (torch.nn.Embedding weights, a tied head with
    # them) is lr times this; adamw and adams without shard, and sparse_avg
    embedding_lr_scale: float = 1.0

    def __post_init__(self) -> None:
        check_dense_keys(self)


def check_dense_keys(cfg: "DenseOptimizerConfig") -> None:
    """The keys every optimizer shares, beyond the Trainer's: a bad value fails at start-up."""
    betas = list(cfg.betas) if isinstance(cfg.betas, (list, tuple)) else None
    if not (betas and len(betas) == 2 and all(isinstance(b, (int, float)) and 0.0 <= b < 1.0 for b in betas)):
        raise ValueError(f"optimizer.betas={cfg.betas!r} must be two numbers in [0, 1), e.g. [0.9, 0.95]")
    if not (isinstance(cfg.eps, (int, float)) and math.isfinite(cfg.eps) and cfg.eps > 0):
        raise ValueError(f"optimizer.eps={cfg.eps!r} must be a number > 0 (e.g. 1e-8)")
    if not (isinstance(cfg.weight_decay, (int, float)) and math.isfinite(cfg.weight_decay) and cfg.weight_decay >= 0):
        raise ValueError(f"optimizer.weight_decay={cfg.weight_decay!r} must be a number >= 0 (0 = off)")
    embedding_lr_scale(cfg)


@dataclass
class AdamWConfig(DenseOptimizerConfig):
    """``optimizer=adamw``: torch's AdamW (fused on CUDA), weight decay on matrices only."""
    name: str = "adamw"


@dataclass
class AdamSConfig(DenseOptimizerConfig):
    """``optimizer=adams``: AdamS (docs/specs/SCAPE.md, "AdamS (dense)"), one state buffer."""
    name: str = "adams"


# A fused element-wise AdamS over one contiguous 1-D buffer (scape.kernels.adams_dense_update's
# signature): (param, momentum, grad, lr, beta1, beta2, eps, bias_correction, weight_decay, decay_end).
AdamSKernel = Callable[..., None]


def build_optimizer(params: List[torch.nn.Parameter], cfg: Any,
                    adams_kernel: Optional[AdamSKernel] = None,
                    embeddings: Set[int] = frozenset()) -> torch.optim.Optimizer:
    """A dense optimizer over ``params``: AdamW (torch's) or AdamS, weight decay on matrices only.

    ``cfg`` is anything with the fields of ``DenseOptimizerConfig``. On CUDA AdamW is torch's fused
    one (one kernel for all tensors; it also skips a non-finite step on the device) and AdamS runs
    ``adams_kernel`` (the layer above passes SCAPE's Triton kernel) once per tensor. ``embeddings``
    (``core.flat.embedding_weight_ids``) are the tables ``cfg.embedding_lr_scale`` applies to."""
    groups = param_groups(params, cfg.weight_decay, embeddings, embedding_lr_scale(cfg))
    return optimizer_for_groups(groups, cfg, adams_kernel)


def embedding_lr_scale(cfg: Any) -> float:
    """``optimizer.embedding_lr_scale``, checked: a finite number > 0 (1 = the lr everywhere)."""
    scale = getattr(cfg, "embedding_lr_scale", 1.0)
    if not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0):
        raise ValueError(f"optimizer.embedding_lr_scale={scale!r} must be a number > 0 "
                         f"(1 = the embedding tables train at optimizer.lr)")
    return float(scale)


def optimizer_for_groups(groups: List[Dict[str, Any]], cfg: Any,
                         adams_kernel: Optional[AdamSKernel] = None) -> torch.optim.Optimizer:
    """``build_optimizer`` on param groups that carry their own weight decay (ZeRO-1's shard
    pieces are flat, so the ndim rule cannot be read off them)."""
    scale = embedding_lr_scale(cfg)
    if scale != 1.0 and not any("lr_scale" in group for group in groups):
        raise ValueError(f"optimizer.embedding_lr_scale={scale:g}: this optimizer was built without the "
                         f"model's embedding tables (optimizer.shard=true and sdp.kind != none do not "
                         f"support the option); leave it 1")
    betas = (float(cfg.betas[0]), float(cfg.betas[1]))
    cuda = any(p.is_cuda for group in groups for p in group["params"])
    if cfg.name == "adamw":
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=betas, eps=cfg.eps, fused=True if cuda else None)
    if cfg.name == "adams":
        return AdamS(groups, lr=cfg.lr, betas=betas, eps=cfg.eps, kernel=adams_kernel if cuda else None)
    raise ValueError(f"optimizer.name={cfg.name!r} has no dense optimizer; choose adamw or adams")


class AdamS(torch.optim.Optimizer):
    def __init__(self, params: Iterable, lr: float = 1e-3, betas: Tuple[float, float] = (0.9, 0.95),
                 eps: float = 1e-8, weight_decay: float = 0.1, kernel: Optional[AdamSKernel] = None) -> None:
        if lr < 0:
            raise ValueError(f"optimizer.lr must be >= 0, got {lr}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"optimizer.betas must lie in [0, 1), got {tuple(betas)}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        # the fused kernel, or None for the PyTorch reference below (CPU; the numerics the tests pin)
        self.kernel = kernel

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            b1, b2 = group["betas"]
            lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                step = int(state["step"].item())  # a CPU tensor (torch's convention): no device sync
                if self.kernel is not None:
                    self.kernel(p.view(-1), state["exp_avg"].view(-1), p.grad.view(-1), lr, b1, b2, eps,
                                1.0 - b1 ** step, wd, p.numel() if wd != 0.0 else 0)
                else:
                    adams_update_(p, p.grad, state["exp_avg"], step, lr, b1, b2, eps, wd)
        return loss


def adams_update_(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, step: int, lr: float,
                  b1: float, b2: float, eps: float, wd: float) -> None:
    """One AdamS step on tensors in place (the reference the fused SCAPE kernels are tested against)."""
    c = 1.0 - b1 ** step
    if wd != 0.0:
        p.mul_(1.0 - lr * wd)
    # One temporary: denom = sqrt(b2 (m/c)^2 + (1 - b2) g^2) + eps, built in place.
    denom = torch.mul(m, m).mul_(b2 / (c * c)).addcmul_(g, g, value=1.0 - b2).sqrt_().add_(eps)
    m.mul_(b1).add_(g, alpha=1.0 - b1)
    p.addcdiv_(m, denom, value=-lr / c)
