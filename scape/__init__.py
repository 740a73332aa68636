"""AdamS, the SCAPE distributed optimizer, its kernels and its communication accounting.

Importing the package registers the synchroniser ``scape`` with core.sync (docs/specs/SCAPE.md;
notes in docs/SCAPE.md); the synchroniser module itself is imported on first use.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from core.comm import Collectives
from core.sync import register_synchronizer
from scape.config import OptimizerConfig

__all__ = ["OptimizerConfig", "build_synchronizer"]


def build_synchronizer(model: torch.nn.Module, cfg: OptimizerConfig, comm: Optional[Collectives] = None):
    """The SCAPE gradient synchroniser for ``model`` (``cfg.name`` must be ``scape``)."""
    name = cfg["name"] if hasattr(cfg, "keys") else cfg.name
    if name != "scape":
        raise ValueError(f"scape.build_synchronizer needs optimizer.name=scape, got {name!r}")
    from scape.synchronizer import ScapeSynchronizer

    return ScapeSynchronizer(model, cfg, comm=comm)


def _build(cfg: Any, device: torch.device, comm: Collectives):
    from models import build_model

    return build_synchronizer(build_model(cfg.model, device=device), cfg.optimizer, comm)


register_synchronizer("scape", _build)
