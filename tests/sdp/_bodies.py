"""Shared pieces of the SDP multi-process tests (module-level so spawned ranks can import them)."""
from __future__ import annotations

from typing import Dict, List

import torch
import torch.distributed as dist

import sdp
from models import build_model
from models.config import ModelConfig
from models.subnet import scatter_state_dict
from scape.config import OptimizerConfig
from sdp.config import SDPConfig
from sdp.layout import meta_full_model
from core.sync import DenseAllReduce
from core.optim import build_optimizer

SEED = 1234


def tiny(family: str = "llama") -> ModelConfig:
    if family == "gpt":
        return ModelConfig(name="test_gpt", family="gpt", n_layer=4, n_head=4, d_model=32, ffn_hidden=64,
                           vocab_size=128, seq_len=16, tie_embeddings=True)
    return ModelConfig(name="test_llama", family="llama", n_layer=4, n_head=4, n_kv_head=2, d_model=32,
                       ffn_hidden=64, vocab_size=128, seq_len=16)


def optimizer_cfg(name: str = "adamw") -> OptimizerConfig:
    return OptimizerConfig(name=name, lr=3e-3, weight_decay=0.1, grad_clip=1.0)


def build_sdp(cfg: ModelConfig, sdp_cfg: SDPConfig, rank: int, world: int, opt: str = "adamw"):
    torch.manual_seed(SEED)  # as the trainer does: every rank seeds alike before building
    return sdp.build_synchronizer(cfg, sdp_cfg, optimizer_cfg(opt), world, rank, torch.device("cpu"))


def build_ddp(cfg: ModelConfig, opt: str = "adamw"):
    torch.manual_seed(SEED)
    model = build_model(cfg)
    return model, DenseAllReduce(model, lambda params: build_optimizer(params, optimizer_cfg(opt)))


def batch(cfg: ModelConfig, rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(10_000 * step + rank)
    return torch.randint(0, cfg.vocab_size, (2, cfg.seq_len), generator=g)


def train_step(model, sync, cfg: ModelConfig, rank: int, step: int, lr: float = 3e-3) -> float:
    """One step of the trainer's own ``train_step`` on this rank's batch; the pre-clip norm."""
    import torch.distributed as dist

    from trainer.step import train_step as trainer_step

    x = batch(cfg, rank, step)
    world = dist.get_world_size() if dist.is_initialized() else 1
    return trainer_step(model, sync, iter([(x[:, :-1], x[:, 1:])]), 1, lr, 1.0, sync.comm, world).grad_norm


_SHAPES: Dict[str, Dict[str, torch.Size]] = {}


def full_shapes(cfg: ModelConfig) -> Dict[str, torch.Size]:
    if cfg.name not in _SHAPES:
        _SHAPES[cfg.name] = {n: t.shape for n, t in meta_full_model(cfg).state_dict().items()}
    return _SHAPES[cfg.name]


def full_flat(cfg: ModelConfig, state: Dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([state[n].detach().reshape(-1).float() for n in sorted(full_shapes(cfg))])


def held_values_flat(cfg: ModelConfig, model, spec) -> torch.Tensor:
    """This worker's values at their full-model positions, NaN where it holds nothing."""
    full = {n: torch.full(shape, float("nan")) for n, shape in full_shapes(cfg).items()}
    scatter_state_dict({n: t.detach() for n, t in model.state_dict().items()}, full, cfg, spec)
    return full_flat(cfg, full)


def all_gather_rows(x: torch.Tensor) -> torch.Tensor:
    rows: List[torch.Tensor] = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, x)
    return torch.stack(rows)


def assert_holders_identical(cfg: ModelConfig, model, sync, what: str) -> None:
    """Every element has a holder, and all of its holders agree bit for bit."""
    rows = all_gather_rows(held_values_flat(cfg, model, sync.spec))
    held = ~torch.isnan(rows)
    assert held.any(dim=0).all(), f"{what}: some full-model element is held by no worker"
    hi = torch.where(held, rows, torch.full_like(rows, -float("inf"))).max(dim=0).values
    lo = torch.where(held, rows, torch.full_like(rows, float("inf"))).min(dim=0).values
    assert torch.equal(hi, lo), f"{what}: holders differ by up to {float((hi - lo).abs().max())}"
    shared = held.sum(dim=0) > 1
    assert shared.any(), f"{what}: the test needs components with several holders"
