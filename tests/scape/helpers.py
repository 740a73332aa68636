"""A small model, deterministic per-rank data and a loop over the trainer's own step."""
from __future__ import annotations

from typing import Callable, List, Optional, Union

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


class TokenModel(torch.nn.Module):
    """A token table and a head: only the rows of the tokens a batch holds get gradients."""

    def __init__(self, vocab: int = 16) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.tokens = torch.nn.Embedding(vocab, 8)
        self.head = torch.nn.Linear(8, 3)

    def forward(self, ids: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(self.head(self.tokens(ids).mean(dim=1)), y)


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
          lr: Union[float, Callable[[int], float]] = 1e-2, accum: int = 2,
          hook: Optional[Callable[[int], None]] = None,
          before_reduce: Optional[Callable[[int], None]] = None,
          after: Optional[Callable[[int], None]] = None) -> List[float]:
    """Steps of the trainer's own ``train_step``; ``lr`` a number or a function of the step;
    ``before_reduce``, ``hook`` (after reduce, before clip) and ``after`` (after after_step) let
    tests observe each stage. Returns this rank's losses."""
    import torch.distributed as dist

    from trainer.step import train_step

    world = dist.get_world_size() if dist.is_initialized() else 1
    losses = []
    for step in range(start + 1, start + steps + 1):
        stages = {"before_reduce": before_reduce, "after_reduce": hook, "after_step": after}

        def observe(stage: str, step: int = step) -> None:
            if stages[stage] is not None:
                stages[stage](step)

        micro_batches = iter([batch(rank, step, micro) for micro in range(accum)])
        step_lr = lr(step) if callable(lr) else lr
        result = train_step(model, sync, micro_batches, accum, step_lr, max_norm, sync.comm, world, hook=observe)
        losses.append(result.local_loss)
    return losses
