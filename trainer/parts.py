"""Builders that turn the config into the run's parts: optimizer, model, gradient synchroniser."""
from __future__ import annotations

from typing import List, Tuple

import torch

from scape.adams import AdamS
from scape.config import OptimizerConfig
from trainer.grad_sync import DenseAllReduce, GradientSynchronizer, param_groups

OPTIMIZERS = ("adamw", "adams", "scape", "sparse_avg")


def build_optimizer(params: List[torch.nn.Parameter], cfg: OptimizerConfig) -> torch.optim.Optimizer:
    """A dense optimizer over ``params``: AdamW (torch's) or AdamS, weight decay on matrices only."""
    groups = param_groups(params, cfg.weight_decay)
    betas = (float(cfg.betas[0]), float(cfg.betas[1]))
    if cfg.name == "adamw":
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=betas, eps=cfg.eps)
    if cfg.name == "adams":
        return AdamS(groups, lr=cfg.lr, betas=betas, eps=cfg.eps)
    raise ValueError(f"optimizer.name={cfg.name!r} has no dense optimizer; choose adamw or adams")


def build_model_and_sync(cfg, world_size: int, rank: int, device: torch.device
                         ) -> Tuple[torch.nn.Module, GradientSynchronizer]:
    """This rank's model and the synchroniser that owns its one gradient-crossing point.

    Every rank seeds identically before building, so dense replicas start equal without a
    broadcast (asserted in tests).
    """
    from models import build_model

    if cfg.optimizer.name not in OPTIMIZERS:
        raise ValueError(f"optimizer.name must be one of {', '.join(OPTIMIZERS)}, got {cfg.optimizer.name!r}")
    torch.manual_seed(cfg.seed)
    if cfg.sdp.kind != "none" and cfg.optimizer.name == "sparse_avg":
        raise ValueError("optimizer=sparse_avg is not supported with SDP (sdp.kind must be none); "
                         "use optimizer=adams or optimizer=adamw")
    if cfg.sdp.kind != "none":
        import sdp

        return sdp.build_synchronizer(cfg.model, cfg.sdp, cfg.optimizer, world_size, rank, device)
    model = build_model(cfg.model, device=device)
    if cfg.optimizer.name in ("scape", "sparse_avg"):
        import scape

        return model, scape.build_synchronizer(model, cfg.optimizer)
    return model, DenseAllReduce(model, lambda params: build_optimizer(params, cfg.optimizer))
