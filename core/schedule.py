"""Learning-rate schedules, both after a linear warm-up and ending at ``min_lr_ratio`` x lr:

- ``cosine``: cosine decay over every step after the warm-up (nanoGPT / Chinchilla recipe);
- ``wsd``: warmup-stable-decay: the full rate until the last ``decay_fraction`` of the steps, then
  a linear decay (MiniCPM; Hägele et al. 2024). The stable phase does not depend on the run's
  length, so a checkpoint from it can be decayed later to any budget.
"""
from __future__ import annotations

import math
from typing import Literal

from core.choices import alternatives, options

LrSchedule = Literal["cosine", "wsd"]  # optimizer.lr_schedule


def lr_at(step: int, base_lr: float, warmup_steps: int, total_steps: int, min_lr_ratio: float,
          schedule: str = "cosine", decay_fraction: float = 0.2) -> float:
    """Learning rate for optimizer step ``step`` (1-based)."""
    min_lr = base_lr * min_lr_ratio
    if warmup_steps > 0 and step <= warmup_steps:
        return base_lr * step / warmup_steps
    if step >= total_steps:
        return min_lr
    if schedule == "cosine":
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (base_lr - min_lr)
    if schedule == "wsd":
        decay_start = max(warmup_steps, total_steps - decay_steps(total_steps, decay_fraction))
        if step <= decay_start:
            return base_lr
        progress = (step - decay_start) / (total_steps - decay_start)
        return base_lr + progress * (min_lr - base_lr)
    raise ValueError(f"optimizer.lr_schedule={schedule!r}: choose {alternatives(options(LrSchedule))}")


def decay_steps(total_steps: int, decay_fraction: float) -> int:
    """The number of final steps over which WSD decays (at least one)."""
    return max(1, round(decay_fraction * total_steps))
