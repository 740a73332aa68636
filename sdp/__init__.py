"""Subnetwork data parallelism (docs/specs/SDP.md): the planner and holder-set aggregation.

Importing the package registers the synchroniser ``sdp`` with core.sync; the Trainer builds it
through the registry when ``sdp.kind != none`` and asks it (never the config) for the step budget,
the parameter counts, the subnetwork it computes and the model to validate.
"""
from __future__ import annotations

from typing import Any, Tuple

import torch

from core.comm import Collectives
from core.optim import DENSE_OPTIMIZERS, build_optimizer
from core.sync import group_synchronizer_builder, register_synchronizer
from sdp.config import SDPConfig
from sdp.synchronizer import SubnetworkSynchronizer

__all__ = ["SDPConfig", "SubnetworkSynchronizer", "build_synchronizer", "step_budget"]


def _as_dataclass(cfg: Any, cls):
    if isinstance(cfg, cls):
        return cfg
    if not isinstance(cfg, dict):
        from omegaconf import OmegaConf

        cfg = OmegaConf.to_container(cfg, resolve=True)
    return cls(**cfg)


def step_budget(train_steps: int, sdp_cfg: Any) -> int:
    """Optimizer steps to run: with ``flop_matched`` the paper's budget, steps / C (rounded)."""
    sdp_cfg = _as_dataclass(sdp_cfg, SDPConfig)
    if sdp_cfg.kind == "none" or not sdp_cfg.flop_matched:
        return int(train_steps)
    from sdp.plan import validate_coverage

    validate_coverage(sdp_cfg.coverage)
    return int(round(train_steps / float(sdp_cfg.coverage)))


def build_synchronizer(model_cfg: Any, sdp_cfg: Any, opt_cfg: Any, world_size: int, rank: int,
                       device: torch.device, comm: Collectives | None = None
                       ) -> Tuple[torch.nn.Module, SubnetworkSynchronizer]:
    """This worker's model (its subnetwork, or the full model under backward masking) and its
    synchroniser. Collective: every rank calls it (process groups are created here).

    The model is initialised from the current torch RNG state, which the trainer seeds alike on
    every rank, so holders start identical and a subnetwork equals the same-seed full model
    restricted to what it holds (the factory draws every tensor from a per-name generator and
    never allocates unheld blocks).
    """
    from models import build_model
    from models.config import ModelConfig
    from sdp.layout import ComponentLayout, skip_meta_init
    from sdp.plan import make_plan

    model_cfg = _as_dataclass(model_cfg, ModelConfig)
    sdp_cfg = _as_dataclass(sdp_cfg, SDPConfig)
    if getattr(opt_cfg, "shard", False):
        raise ValueError("optimizer.shard=true is not supported with SDP (sdp.kind must be none): SDP "
                         "already keeps optimizer state only for the parameters a rank holds; set "
                         "optimizer.shard=false")
    if getattr(opt_cfg, "name", "adamw") == "sparse_avg":
        raise ValueError("optimizer=sparse_avg is not supported with SDP (sdp.kind must be none); "
                         "use optimizer=adams or optimizer=adamw")
    plan = make_plan(model_cfg, sdp_cfg, world_size)
    spec = plan.subnet_spec(rank) if sdp_cfg.masking == "forward" else None
    with skip_meta_init():  # the factory sizes sliced tensors on a meta copy of the full model
        model = build_model(model_cfg, spec, device=device)
    layout = ComponentLayout(model_cfg, plan)
    coverage = float(sdp_cfg.coverage) if sdp_cfg.flop_matched else None
    name = getattr(opt_cfg, "name", "adamw")
    if name in DENSE_OPTIMIZERS:
        sync = SubnetworkSynchronizer(model, plan, layout, rank, sdp_cfg.masking,
                                      lambda params: build_optimizer(params, opt_cfg),
                                      flop_matched_coverage=coverage, comm=comm)
    else:  # an optimizer that communicates itself (SCAPE) runs inside each holder group
        from sdp.groups import HolderGroupSynchronizer

        sync = HolderGroupSynchronizer(model, plan, layout, rank, sdp_cfg.masking,
                                       group_synchronizer_builder(name), opt_cfg,
                                       flop_matched_coverage=coverage, comm=comm)
    if rank == 0:
        print(f"sdp: {plan.kind} {plan.strategy} C={plan.coverage} masking={sdp_cfg.masking}, "
              f"{plan.workers} workers, {len(plan.components)} components, "
              f"{len(set(plan.holder_sets()))} holder sets; rank 0 holds {sync.held_numel:,} of "
              f"{sync.full_numel:,} parameters", flush=True)
    return model, sync


def _build(cfg: Any, device: torch.device, comm: Collectives) -> SubnetworkSynchronizer:
    import torch.distributed as dist

    world, rank = (dist.get_world_size(), dist.get_rank()) if dist.is_initialized() else (1, 0)
    return build_synchronizer(cfg.model, cfg.sdp, cfg.optimizer, world, rank, device, comm)[1]


register_synchronizer("sdp", _build)
