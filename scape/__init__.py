"""AdamS, the SCAPE distributed optimizer, its kernels and its communication accounting.

The trainer builds SCAPE through ``build_synchronizer`` (docs/specs/SCAPE.md; notes in
docs/SCAPE.md). Importing this package is cheap: the synchroniser is imported on first use.
"""
from __future__ import annotations

import torch

from scape.config import OptimizerConfig


def build_synchronizer(model: torch.nn.Module, cfg: OptimizerConfig):
    """The SCAPE gradient synchroniser for ``model`` (``cfg.name`` must be ``scape``)."""
    name = cfg["name"] if hasattr(cfg, "keys") else cfg.name
    if name != "scape":
        raise ValueError(f"scape.build_synchronizer needs optimizer.name=scape, got {name!r}")
    from scape.synchronizer import ScapeSynchronizer

    return ScapeSynchronizer(model, cfg)
