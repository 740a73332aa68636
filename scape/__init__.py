"""AdamS, the SCAPE distributed optimizer, its kernels and its communication accounting.

The trainer builds SCAPE through ``build_synchronizer`` (docs/specs/SCAPE.md; notes in
docs/SCAPE.md). Importing this package is cheap: the synchroniser is imported on first use.
"""
from __future__ import annotations

import torch

from scape.config import OptimizerConfig


def build_synchronizer(model: torch.nn.Module, cfg: OptimizerConfig):
    """The synchroniser for ``model``: SCAPE (``cfg.name=scape``) or sparse model averaging
    (``cfg.name=sparse_avg``, scape/averaging.py)."""
    name = cfg["name"] if hasattr(cfg, "keys") else cfg.name
    if name == "sparse_avg":
        from scape.averaging import SparseAverageSynchronizer

        return SparseAverageSynchronizer(model, cfg)
    if name != "scape":
        raise ValueError(f"scape.build_synchronizer needs optimizer.name=scape or sparse_avg, "
                         f"got {name!r}")
    from scape.synchronizer import ScapeSynchronizer

    return ScapeSynchronizer(model, cfg)
