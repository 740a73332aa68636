"""AdamS, the SCAPE distributed optimizer, sparse model averaging, their kernels and their
communication accounting.

Importing the package registers the synchronisers ``scape``, ``scape_sharded``
(``optimizer.shard=true``, scape/sharded.py) and ``sparse_avg`` with core.sync, and SCAPE as
the optimizer inside SDP holder groups (scape/holder_group.py)
(docs/specs/SCAPE.md; notes in docs/SCAPE.md); the synchroniser modules themselves are imported
on first use.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from core.comm import Collectives
from core.optim import group_parameter_ids
from core.sync import register_group_synchronizer, register_synchronizer
from scape.config import OptimizerConfig

__all__ = ["OptimizerConfig", "build_synchronizer"]


def build_synchronizer(model: torch.nn.Module, cfg: OptimizerConfig, comm: Optional[Collectives] = None,
                       steps: Optional[int] = None):
    """The synchroniser for ``model``: SCAPE (``cfg.name=scape``; sharded with ``cfg.shard``) or
    sparse model averaging (``cfg.name=sparse_avg``, scape/sparse_averaging.py), whose byte budget is
    spread over the run's ``steps``."""
    name = cfg["name"] if hasattr(cfg, "keys") else cfg.name
    shard = bool(cfg.get("shard", False) if hasattr(cfg, "keys") else cfg.shard)
    if name == "sparse_avg":
        if shard:
            raise ValueError("optimizer.shard=true is not supported with optimizer=sparse_avg (each "
                             "rank keeps its own model copy and momentum); set optimizer.shard=false")
        from scape.sparse_averaging import SparseAverageSynchronizer

        return SparseAverageSynchronizer(model, cfg, comm=comm, steps=steps)
    if name != "scape":
        raise ValueError(f"scape.build_synchronizer needs optimizer.name=scape or sparse_avg, "
                         f"got {name!r}")
    from scape.options import as_dataclass

    group_parameter_ids(model, as_dataclass(cfg))  # a parameter group that matches nothing is refused
    if shard:
        from scape.sharded import ShardedScapeSynchronizer

        return ShardedScapeSynchronizer(model, cfg, comm=comm)
    from scape.synchronizer import ScapeSynchronizer

    return ScapeSynchronizer(model, cfg, comm=comm)


def _build(cfg: Any, device: torch.device, comm: Collectives):
    from models import build_model

    return build_synchronizer(build_model(cfg.model, device=device), cfg.optimizer, comm, steps=int(cfg.train.steps))


register_synchronizer("scape", _build)
register_synchronizer("scape_sharded", _build)
register_synchronizer("sparse_avg", _build)


def _build_in_holder_group(module: torch.nn.Module, cfg: Any, comm: Collectives):
    """SCAPE over ``module``'s parameters among the ranks of ``comm``'s group (SDP's holder group)."""
    shard = bool(cfg.get("shard", False) if hasattr(cfg, "keys") else cfg.shard)
    if shard:
        raise ValueError("optimizer.shard=true is not supported with SDP; set optimizer.shard=false")
    from scape.holder_group import HolderGroupScape

    return HolderGroupScape(module, cfg, comm=comm)


register_group_synchronizer("scape", _build_in_holder_group)
