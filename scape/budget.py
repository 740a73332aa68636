"""Sparse averaging's byte budget (``optimizer.byte_budget``): each step's density, planned from
the run's own learning-rate schedule so that the run sends its budget.

The budget is bytes per rank per step, averaged over the run's steps, as core/comm.py counts
them: ``byte_budget: 0`` is SCAPE-99's sparse step for the same model and world
(``scape.accounting.scape_step_bytes`` at 99%: fp32 values, the auto mask transport), a number in
(0, 1] that fraction of the dense fp32 all-reduce of the gradients. Every exchange of the drifts
is counted (kind scape_values): step 1's norms, the dense warm-up's whole drift, the sparsity
warm-up. Not counted: step 1's dense all-reduce of the clipped gradient (kind grad_allreduce), the
one dense exchange that starts the copies equal, which SCAPE-99 pays too and which does not grow
with the run (counted, it alone would exceed SCAPE-99's budget of any run under ~67 steps); with
``ranks_per_copy`` > 1 the dense gradient average inside a copy (kind copy_gradients), which runs
on the node's own links.

The plan keeps the density's shape: after the dense warm-up, step t exchanges

    density_t = min(1, max(c sqrt(lr_{t-1} / lr), c^(t / S)))

(the second term over the sparsity warm-up's S steps only: SCAPE's geometric decay from 1 to c),
and c, the density at the peak lr, is the largest whose run sends at most the budget. Where the
cap at 1 binds, the bytes it cuts go to the other steps through a larger c.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Dict, List

from core.comm import all_gather_bytes, all_reduce_bytes, all_to_all_bytes
from core.schedule import lr_at
from scape.accounting import VALUE_BYTES, dense_step_bytes, scape_step_bytes
from scape.partition import Partitioning
from scape.quantize import packed_nbytes

# the budget's default: SCAPE at this sparsity, as conf/optimizer/scape.yaml sends it
SCAPE99_SPARSITY = 0.99


def exchange_bytes(count: int, copies: int, value_bits: int, value_bytes: int) -> float:
    """Bytes per rank of one exchange of ``count`` drifts among ``copies``, the squared norm beside
    them: value_bits-bit codes through the compressed all-reduce (an all-to-all of C chunks, an
    all-gather of the owners' codes with the fp32 norm), or with value_bits 0 the values and the
    norm in one all-reduce of value_bytes each."""
    if value_bits:
        chunk = packed_nbytes(count // copies, value_bits, value_bytes) if count else 0
        return all_to_all_bytes(copies * chunk, copies) + all_gather_bytes(chunk + 4, copies)
    return all_reduce_bytes((count + 1) * value_bytes, copies)


def budget_bytes(cfg: Any, numel: int, world: int) -> float:
    """``optimizer.byte_budget`` in bytes per rank per step (0: SCAPE-99's)."""
    if float(cfg.byte_budget) > 0:
        return float(cfg.byte_budget) * dense_step_bytes(numel, world)
    return scape_step_bytes(numel, world, SCAPE99_SPARSITY)["total"]


@dataclass(frozen=True)
class DensityPlan:
    """The density of each step's exchange (steps 1..len; a later step keeps the last one's) and
    what the run sends by it, in bytes per rank (``sent``) and against its budget."""
    densities: List[float]
    sent: float
    budget: float

    def at(self, step: int) -> float:
        return self.densities[min(max(step, 1), len(self.densities)) - 1]


class _RunBytes:
    """What a run of ``steps`` steps sends at a given peak density c (the terms of the sum above)."""

    def __init__(self, cfg: Any, layout: Partitioning, copies: int, steps: int) -> None:
        self.layout, self.copies, self.steps = layout, copies, steps
        self.bits, self.value_bytes = int(cfg.value_bits), VALUE_BYTES[cfg.value_dtype]
        self.dense_until = int(cfg.dense_warmup_steps)
        self.warmup = int(cfg.sparsity_warmup_steps)
        lrs = [lr_at(s, 1.0, cfg.warmup_steps, steps, cfg.min_lr_ratio, cfg.lr_schedule, cfg.decay_fraction)
               for s in range(1, steps + 1)]
        # the shape of step t's density: sqrt of the lr of the step before over the peak lr (the
        # drift exchanged at t is what the steps before it moved; step 1 is always dense)
        self.shape = [1.0] + [math.sqrt(max(lr, 0.0)) for lr in lrs[:-1]]
        padded = layout.padded_numel
        # step 1's norms, then the dense warm-up's whole drift on steps 2..W
        self.fixed = (exchange_bytes(0, copies, self.bits, self.value_bytes)
                      + max(0, min(self.dense_until, steps) - 1) * exchange_bytes(padded, copies, self.bits,
                                                                                   self.value_bytes))
        self._per_k: Dict[int, float] = {}

    def density(self, t: int, c: float) -> float:
        density = c * self.shape[t - 1]
        if self.warmup > 0 and t < self.warmup:
            density = max(density, c ** (t / self.warmup))
        return min(1.0, density)

    def step_bytes(self, k: int) -> float:
        if k not in self._per_k:
            count = self.layout.num_partitions * k
            self._per_k[k] = exchange_bytes(count, self.copies, self.bits, self.value_bytes)
        return self._per_k[k]

    def total(self, c: float) -> float:
        sparse = range(self.dense_until + 1, self.steps + 1)
        return self.fixed + sum(self.step_bytes(self.layout.k(self.density(t, c))) for t in sparse)

    def densities(self, c: float) -> List[float]:
        return [1.0 if t <= self.dense_until else self.density(t, c) for t in range(1, self.steps + 1)]


def density_plan(cfg: Any, numel: int, world: int, copies: int, steps: int,
                 budget_of: Callable[[Any, int, int], float] = budget_bytes) -> DensityPlan:
    """The plan of a run of ``steps`` steps of optimizer=sparse_avg (``cfg``) on ``world`` ranks
    training ``copies`` copies of ``numel`` parameters; refused where the dense warm-up and the
    smallest sparse steps alone exceed the budget."""
    if steps < 1:
        raise ValueError(f"sparse averaging plans its densities for a run of train.steps >= 1, got {steps}")
    layout = Partitioning(numel, world, world)
    run = _RunBytes(cfg, layout, copies, steps)
    budget = budget_of(cfg, numel, world)
    target = budget * steps
    lo, hi = 0.0, 1.0
    if run.total(lo) > target:
        least = run.total(lo) / steps
        raise ValueError(f"optimizer.byte_budget={cfg.byte_budget:g} ({budget:,.0f} bytes per rank per step) is "
                         f"below what this run sends at its least: {least:,.0f} a step on average over its "
                         f"{steps} steps ({run.dense_until - 1} dense warm-up steps after step 1, then one "
                         f"value per partition a step): raise optimizer.byte_budget, lower "
                         f"optimizer.dense_warmup_steps or train more steps")
    while run.total(hi) <= target and hi < 1e12:  # the cap at 1 binds somewhere: c may exceed 1
        lo, hi = hi, hi * 2.0
    for _ in range(48):  # the largest c whose run sends at most the budget
        mid = 0.5 * (lo + hi)
        if run.total(mid) <= target:
            lo = mid
        else:
            hi = mid
    return DensityPlan(run.densities(lo), run.total(lo), budget)
