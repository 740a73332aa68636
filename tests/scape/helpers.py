"""A small model, deterministic per-rank data and a loop that drives a synchroniser like the trainer."""
from __future__ import annotations

from typing import Callable, List, Optional

import torch

from scape.config import OptimizerConfig


class TinyNet(torch.nn.Module):
    """Matrices (weight decay) and vectors (none), about 2.5k parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(16, 48)
        self.norm = torch.nn.LayerNorm(48)
        self.head = torch.nn.Linear(48, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = self.head(torch.tanh(self.norm(self.embed(x))))
        return torch.nn.functional.cross_entropy(logits, y)


def make_model(seed: int = 0) -> TinyNet:
    torch.manual_seed(seed)
    return TinyNet()


def batch(rank: int, step: int, micro: int = 0):
    gen = torch.Generator().manual_seed(1000 * step + 10 * rank + micro)
    x = torch.randn(8, 16, generator=gen)
    return x, (x[:, :4].argmax(dim=1) + (x[:, 5] > 1).long()) % 4


def scape_config(**overrides) -> OptimizerConfig:
    base = dict(name="scape", lr=1e-2, weight_decay=0.1, sparsity=0.9)
    base.update(overrides)
    return OptimizerConfig(**base)


def train(model, sync, steps: int, rank: int, start: int = 0, max_norm: float = 1.0,
          lr: float = 1e-2, accum: int = 2,
          hook: Optional[Callable[[int], None]] = None,
          before_reduce: Optional[Callable[[int], None]] = None,
          after: Optional[Callable[[int], None]] = None) -> List[float]:
    """The trainer's loop order; ``before_reduce``, ``hook`` (after reduce, before clip) and
    ``after`` (after after_step) let tests observe each stage."""
    losses = []
    for step in range(start + 1, start + steps + 1):
        sync.zero_grad()
        total = 0.0
        for micro in range(accum):
            x, y = batch(rank, step, micro)
            loss = model(x, y)
            (loss / accum).backward()
            total += loss.item() / accum
        if before_reduce is not None:
            before_reduce(step)
        sync.reduce_gradients()
        if hook is not None:
            hook(step)
        sync.clip_gradients(max_norm)
        sync.step(lr)
        sync.after_step()
        if after is not None:
            after(step)
        losses.append(total)
    return losses
