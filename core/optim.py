"""The dense optimizers, AdamW (torch's) and AdamS, and the config keys every optimizer shares.

AdamS: Adam with the second moment replaced by the momentum itself. Formula and defaults: docs/specs/SCAPE.md, "AdamS (dense)" (official reference:
pku-huzhang/AdamS). One state buffer per parameter (half of AdamW's optimizer memory); the
update |m_t / c| / denom is bounded, which is what lets SCAPE feed it sparse, stale statistics.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any, Callable, ClassVar, Dict, Iterable, List, Optional, Set, Tuple

import torch

from core.flat import embedding_weight_ids, param_groups

DENSE_OPTIMIZERS = ("adamw", "adams")
# what ParamGroupConfig.match can select
GROUP_MATCHES = ("embedding",)
# each setting of a group: what it overrides, for the refusal of an optimizer without it
_GROUP_SETTINGS = {"lr_scale": "the lr's multiple",
                   "step_bound": "the bound on a local step (sparse_avg)",
                   "denominator_beta": "the shared denominator's memory (sparse_avg)"}


@dataclass
class ParamGroupConfig:
    """One entry of ``optimizer.param_groups``: the parameters ``match`` selects train with these
    settings, the others with the optimizer's own (torchtitan's parameter-group override).

    ``match: embedding`` selects the weights of the model's ``torch.nn.Embedding`` tables (a head
    tied to them shares them; ``core.flat.embedding_weight_ids``). ``lr_scale``: their lr is
    ``optimizer.lr`` times this. ``step_bound`` and ``denominator_beta``: sparse_avg's bound on a
    local step (in lr) and its shared denominator's memory there; None = the optimizer's own. An
    optimizer without such a setting refuses it (``DenseOptimizerConfig.GROUP_FIELDS``)."""
    match: str
    lr_scale: float = 1.0
    step_bound: Optional[float] = None
    denominator_beta: Optional[float] = None


def as_param_groups(groups: Any) -> List[ParamGroupConfig]:
    """``optimizer.param_groups`` as ParamGroupConfig entries (from mappings, as Hydra gives them):
    an unknown field, a missing ``match`` or a second group is refused, naming the key."""
    if groups is None:
        return []
    if isinstance(groups, (str, bytes)) or not hasattr(groups, "__iter__") or hasattr(groups, "keys"):
        raise ValueError(f"optimizer.param_groups={groups!r} must be a list of groups, e.g. "
                         f"[{{match: embedding, lr_scale: 16}}] ([] = none)")
    out = []
    known = tuple(f.name for f in fields(ParamGroupConfig))
    for i, group in enumerate(groups):
        if isinstance(group, ParamGroupConfig):
            out.append(group)
            continue
        if not hasattr(group, "keys"):
            raise ValueError(f"optimizer.param_groups[{i}]={group!r} must be a mapping, e.g. "
                             f"{{match: embedding, lr_scale: 16}}")
        values = {str(key): group[key] for key in group.keys()}
        for key in values:
            if key not in known:
                raise ValueError(f"optimizer.param_groups[{i}].{key} is not a field of a parameter group "
                                 f"(its fields: {', '.join(known)}): remove it")
        if "match" not in values:
            raise ValueError(f"optimizer.param_groups[{i}] has no match: give the parameters it selects "
                             f"(match: {' | '.join(GROUP_MATCHES)})")
        out.append(ParamGroupConfig(**values))
    if len(out) > 1:
        raise ValueError(f"optimizer.param_groups holds {len(out)} groups; one override group is supported "
                         f"(match: {' | '.join(GROUP_MATCHES)}): merge their settings into one")
    return out


def check_param_groups(cfg: Any) -> None:
    """Every group's values, and only the settings ``cfg``'s optimizer has (``GROUP_FIELDS``)."""
    for i, group in enumerate(as_param_groups(getattr(cfg, "param_groups", []))):
        key = f"optimizer.param_groups[{i}]"
        if group.match not in GROUP_MATCHES:
            raise ValueError(f"{key}.match={group.match!r} is not supported; allowed values: "
                             f"{', '.join(GROUP_MATCHES)} (the torch.nn.Embedding weights and a head tied to them)")
        scale = group.lr_scale
        if not (_is_number(scale) and scale > 0):
            raise ValueError(f"{key}.lr_scale={scale!r} must be a number > 0 (1 = the group trains at optimizer.lr)")
        bound, beta = group.step_bound, group.denominator_beta
        if bound is not None and not (_is_number(bound) and bound > 0):
            raise ValueError(f"{key}.step_bound={bound!r} must be a number > 0 (null = optimizer.step_bound)")
        if beta is not None and not (_is_number(beta) and 0 <= beta < 1):
            raise ValueError(f"{key}.denominator_beta={beta!r} must be a number in [0, 1) (null = betas[1])")
        for name, default in (("lr_scale", 1.0), ("step_bound", None), ("denominator_beta", None)):
            value = getattr(group, name)
            if value != default and name not in getattr(type(cfg), "GROUP_FIELDS", ("lr_scale",)):
                raise ValueError(f"{key}.{name}={value!r} sets {_GROUP_SETTINGS[name]}, which optimizer="
                                 f"{cfg.name} does not have: remove it (leave it {'null' if default is None else default})")


def check_group_shard(cfg: Any) -> None:
    """A group's lr multiple needs the optimizer to hold whole tables, which a sharded one does not."""
    group = override_group(cfg)
    if group is not None and group.lr_scale != 1 and getattr(cfg, "shard", False):
        raise ValueError(f"optimizer.param_groups[0].lr_scale={group.lr_scale:g} is not supported with "
                         f"optimizer.shard=true (each rank's optimizer state holds flat pieces of the model, "
                         f"not its tables): leave it 1, or set optimizer.shard=false")


def group_parameter_ids(model: torch.nn.Module, cfg: Any) -> Set[int]:
    """The ids of the parameters the override group matches (none without a group); a group that
    matches no parameter of ``model`` is refused."""
    group = override_group(cfg)
    if group is None:
        return set()
    ids = embedding_weight_ids(model)
    if not ids:
        raise ValueError(f"optimizer.param_groups[0].match={group.match} selects the torch.nn.Embedding weights, "
                         f"but the model has no torch.nn.Embedding: remove the group")
    return ids


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def override_group(cfg: Any) -> Optional[ParamGroupConfig]:
    """The run's one override group (``optimizer.param_groups``), or None."""
    groups = as_param_groups(getattr(cfg, "param_groups", []))
    return groups[0] if groups else None


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
    lr_schedule: str = "cosine"  # cosine | wsd (warmup-stable-decay; core/schedule.py)
    decay_fraction: float = 0.2  # wsd: the final fraction of the steps that decays linearly to the floor
    # true: each rank keeps the optimizer state of its 1/N of the flat parameters (ZeRO-1 for
    # adamw/adams, core/zero.py; sharded SCAPE, scape/sharded.py)
    shard: bool = False
    grad_sync: str = "ddp"  # core.sync.GradSync, the dense arms: ddp (overlapped) | after_backward
    # at most one override group (ParamGroupConfig): the parameters it matches train with its
    # settings instead of the optimizer's own; [] = one setting for every parameter
    param_groups: List[ParamGroupConfig] = field(default_factory=list)

    # the ParamGroupConfig fields this optimizer has a setting for (the others are refused)
    GROUP_FIELDS: ClassVar[Tuple[str, ...]] = ("lr_scale",)

    def __post_init__(self) -> None:
        self.param_groups = as_param_groups(self.param_groups)
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
    check_param_groups(cfg)
    check_group_shard(cfg)


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
    (``core.flat.embedding_weight_ids``) are the tables the override group's ``lr_scale`` applies to."""
    groups = param_groups(params, cfg.weight_decay, embeddings, embedding_lr_scale(cfg))
    return optimizer_for_groups(groups, cfg, adams_kernel)


def embedding_lr_scale(cfg: Any) -> float:
    """The lr's multiple on the embedding tables: the override group's ``lr_scale`` (1 without one)."""
    group = override_group(cfg)
    return 1.0 if group is None else float(group.lr_scale)


def optimizer_for_groups(groups: List[Dict[str, Any]], cfg: Any,
                         adams_kernel: Optional[AdamSKernel] = None) -> torch.optim.Optimizer:
    """``build_optimizer`` on param groups that carry their own weight decay (ZeRO-1's shard
    pieces are flat, so the ndim rule cannot be read off them)."""
    scale = embedding_lr_scale(cfg)
    if scale != 1.0 and not any("lr_scale" in group for group in groups):
        raise ValueError(f"optimizer.param_groups[0].lr_scale={scale:g}: this optimizer was built without the "
                         f"model's embedding tables (optimizer.shard=true and sdp.kind != none do not "
                         f"support a parameter group's lr); leave it 1")
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
