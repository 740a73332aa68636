"""The run's parts from its config: the synchroniser (and through it the model and optimizer).

Which synchroniser runs is the one decision taken from the config here; everything the Trainer
needs to know afterwards it asks the synchroniser. scape/ and sdp/ register theirs when imported;
the dense all-reduce is registered here because it needs the model factory.
"""
from __future__ import annotations

from typing import Any, Tuple

import torch

import scape  # noqa: F401 - registers the "scape" and "sparse_avg" synchronisers
import sdp  # noqa: F401 - registers the "sdp" synchroniser
from core.comm import Collectives
from core.optim import build_optimizer, group_parameter_ids
from core.zero import ZeroDenseSynchronizer
from core.sync import DenseAllReduce, GradientSynchronizer, register_synchronizer, synchronizer_builder

def _build_dense(cfg: Any, device: torch.device, comm: Collectives) -> DenseAllReduce:
    from models import build_model

    from scape import kernels

    model = build_model(cfg.model, device=device)
    tables = group_parameter_ids(model, cfg.optimizer)
    return DenseAllReduce(model, lambda params: build_optimizer(params, cfg.optimizer, kernels.adams_dense_update,
                                                                tables),
                          comm, grad_sync=cfg.optimizer.grad_sync)


def _build_dense_sharded(cfg: Any, device: torch.device, comm: Collectives) -> ZeroDenseSynchronizer:
    from models import build_model

    return ZeroDenseSynchronizer(build_model(cfg.model, device=device), cfg.optimizer, comm)


register_synchronizer("dense", _build_dense)
register_synchronizer("dense_sharded", _build_dense_sharded)


def synchronizer_name(cfg: Any) -> str:
    if cfg.sdp.kind != "none":
        return "sdp"
    name = cfg.optimizer.name if cfg.optimizer.name in ("scape", "sparse_avg") else "dense"
    # sparse_avg has no sharded form; its builder refuses optimizer.shard=true by name
    return f"{name}_sharded" if cfg.optimizer.shard and name != "sparse_avg" else name


def build_synchronizer(cfg: Any, device: torch.device, comm: Collectives) -> GradientSynchronizer:
    """This rank's synchroniser; its model is ``sync.model``.

    Every rank seeds identically before building, so dense replicas start equal without a
    broadcast (asserted in tests).
    """
    torch.manual_seed(cfg.seed)
    return synchronizer_builder(synchronizer_name(cfg))(cfg, device, comm)


def build_model_and_sync(cfg: Any, device: torch.device, comm: Collectives
                         ) -> Tuple[torch.nn.Module, GradientSynchronizer]:
    sync = build_synchronizer(cfg, device, comm)
    return sync.model, sync
