"""Sparse model averaging (``optimizer.name=sparse_avg``): local AdamS, sparse averaging of drifts.

SCAPE keeps one model on every rank and sends a sparse slice of the gradient statistics; this
optimizer keeps one model *per* rank and sends a sparse slice of how far each model has moved
away from the others. At most SCAPE's bytes per step, the same number of state buffers, one
compressed all-reduce per step on the critical path.

State
    replicated (identical on every rank by construction): the consensus x (flat fp32, padded as
    ``scape.partition.Partitioning`` says), the shared denominator D (``_SharedNormalizer``), the
    step t and the position in the cycle of coordinates.
    per rank: the local copy y_i -- the model's parameters ARE y_i (views into one flat buffer,
    ``core.flat.FlatParameters``) -- and the local momentum m_i. The drift is d_i = y_i - x; it
    is never stored, so a checkpoint holds y_i bit for bit. Each chunk owner of the compressed
    all-reduce also keeps what its re-quantized mean left out (``mean_error``).
    ranks_per_copy: G > 1 consecutive ranks train one copy (a node's GPUs): reduce_gradients
    first averages their gradients densely (kind copy_gradients, inside the node), so they hold
    the same y_i; every exchange below then runs among the W / G copies, in the group of the
    ranks with this rank's index in its copy (one rail per GPU of a node).

One step t, in the loop's order
    reduce_gradients  the mask M_t is the next window of one fixed permutation of every
                      partition (the same on every rank: no mask crosses the network). The
                      drifts d_i[M_t] travel as value_bits-bit codes with one value_dtype scale
                      per 64 values through a compressed all-reduce (an all-to-all to each
                      chunk's owner, which averages them, adds its pending error and quantizes
                      the mean again, then an all-gather of the owners' codes; both kind
                      scape_values), with this rank's squared local gradient norm beside them;
                      value_bits 0 sends value_dtype values through one all-reduce instead.
                      D folds in the mean momentum the averaged drift reveals; then
                      x[M_t] += mean_i d_i[M_t] and y_i[M_t] = x[M_t] + what its own codes
                      left out.
    clip_gradients    every copy is clipped by its own norm; the returned norm is
                      sqrt(mean_i ||g_i||^2) from the exchanged squared norms, the same number
                      on every rank, so a non-finite step is skipped by all ranks together.
    step              the local step over the shared denominator:
                      y_i -= s lr clamp((m_i / bc) / D, +-c) with decoupled weight decay on the
                      matrices (``_SharedNormalizer.local_step``): linear in m_i, so the mean of
                      the copies moves by the step on the mean momentum.
    after_step        the next window of the cycle, k = ceil(density(t+1) |P_r|): the densities
                      the byte budget plans from the run's lr schedule (scape/budget.py).

Why this shape
    * Off the mask nothing is lost: a coordinate that is not sent keeps moving locally, and its
      accumulated drift is averaged in at its next exchange. The exchange never changes the
      average model x + mean_i d_i (in exact arithmetic): it only moves mass from the drifts
      into the consensus.
    * A fixed cycle exchanges every coordinate once every |P_r| / k steps: no coordinate waits
      longer than that, and no bytes go to a mask.
    * Step 1 has no drift (all copies start from the same seed): the clipped gradient is
      all-reduced once, its mean starts D and is every rank's gradient, so the copies start
      equal. ``dense_warmup_steps: W`` exchanges the whole drift on steps 2..W.

The model to validate, save and export is the average mean_i y_i = x + mean_i d_i (plus the
owners' pending errors): one dense all-reduce (kind ``average``), only at evaluation and
checkpoint time (``evaluation_weights``, ``model_state_dict``), not part of the per-step bytes.

Checkpoints: ``state_dict`` (rank 0) holds x, the step, the cycle's position, the pending mask as
a bitmap and the shared denominator's buffers; ``local_state_dict`` (every rank) holds y_i, m_i
and the owner's pending error. The trainer loads the model weights (the average) first, then
these two, so y_i is restored exactly and a resumed run is bit-identical. On another number of
ranks (``load_resharded_state``) every new rank starts from the mean of the old copies and of the
old momenta: the average model is kept, the drift is shared equally.
"""
from __future__ import annotations

import contextlib
import math
from typing import Any, Callable, Dict, Iterator, Optional, Set

import torch

from core.checkpoint import repad
from core.comm import Collectives, new_groups
from core.optim import group_parameter_ids, override_group
from scape import kernels
from scape.accounting import VALUE_BYTES
from scape.budget import DensityPlan, density_plan, exchange_bytes
from scape.config import SparseAverageConfig
from scape.masking import MaskedSynchronizer
from scape.options import as_dataclass, validate_sparse_avg
from scape.partition import Partitioning
from scape.quantize import dequantize, quantize

NAME = "sparse_avg"


def sparse_avg_step_bytes(numel: int, world: int, sparsity: float, value_dtype: str = "bf16",
                          value_bits: int = 2) -> Dict[str, float]:
    """Bytes per rank of a sparse step at density 1 - ``sparsity``, a copy per rank (no mask
    crosses: every rank computes the cycle alike; scape.budget.exchange_bytes)."""
    layout = Partitioning(numel, world, world, 0)
    k = layout.k(round(1.0 - sparsity, 12))
    values = exchange_bytes(layout.num_partitions * k, world, value_bits, VALUE_BYTES[value_dtype])
    return {"values": values, "mask": 0, "total": values, "transport": "none", "k": k,
            "padded_numel": layout.padded_numel}


class _LocalMomentum:
    """This rank's momentum over the flat buffer y_i and torch-like ``param_groups`` (the step
    itself is ``_SharedNormalizer.local_step``)."""

    def __init__(self, param: torch.Tensor, decay_end: int, cfg: SparseAverageConfig) -> None:
        self.param, self.decay_end = param, decay_end
        self.beta1, self.beta2 = float(cfg.betas[0]), float(cfg.betas[1])
        self.eps, self.weight_decay = float(cfg.eps), float(cfg.weight_decay)
        self.param_groups = [{"lr": cfg.lr, "betas": (self.beta1, self.beta2), "eps": self.eps,
                              "weight_decay": self.weight_decay}]
        self.momentum = torch.zeros_like(param)


def _take(buffer: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
    """The exchanged coordinates of a flat buffer, as a new tensor (all of them without a mask)."""
    return buffer.clone() if mask is None else buffer.index_select(0, mask)


def default_local_step_scale(copies: int, power: float) -> float:
    """The share of its local step a copy takes by default: min(1, (4 / C)^power) on C copies.

    Where gradient noise dominates, a copy's local steps stray from x by sqrt(C) times the mean
    step's noise (each copy's momentum holds 1 / C of the batch). Some of that spread is worth
    having (on 4 copies a smaller share is worse), beyond it the copies' gradients are taken too
    far from x; the exchange divides the mean drift by the share, so x moves as at 1.
    """
    return min(1.0, (4.0 / copies) ** power)


def default_step_bound(beta2: float, copies: int) -> float:
    """The clamp of a local step over the shared denominator, in lr: sqrt(C / (1 - b2)) on C copies.

    1 / sqrt(1 - b2) is the furthest AdamS moves a coordinate in one step (|m| / sqrt(v) with v the
    average of m^2): the bound of a single copy. D is the scale of the *mean* momentum over the C
    copies, while each copy's momentum holds the gradient noise of 1 / C of the batch: where noise
    dominates |m_i| / D is sqrt(C) times what it is at one copy. Scaled by sqrt(C), the bound
    clamps a copy's step where AdamS on that copy's own share of the batch would be at its largest.
    """
    return math.sqrt(copies) / math.sqrt(1.0 - beta2)


class _SharedNormalizer:
    """One replicated denominator D for every rank's local step.

    With each rank's own AdamS denominator the average of the local steps is not an AdamS step
    on the mean gradient: a rank's denominator holds C times the gradient noise of the mean's.
    With one D on every rank a local step y_i -= lr (m_i / bc) / D is linear in m_i, so the mean
    of the copies moves by lr (mean_i m_i / bc) / D: the momentum of the mean gradient.

    D is built from what the exchange reveals. When a coordinate's drifts are averaged after
    local steps with learning rates lr_s, the copies all left x there with the same D, so
    q = -mean_i d_i D / sum_s lr_s is the lr-weighted mean of the bias-corrected mean momentum
    over those steps. D^2 is an exponential average of q^2 (memory b2), bias-corrected, updated at each exchange with the weight 1 - beta^S of the S steps
    it covers. Step 1's clipped mean gradient starts it (D = |mean g|). Three replicated buffers
    besides D: the raw average, the lr sum since the last exchange, and that exchange's step.
    """

    # the largest |q| folded into D: q^2 = 1e34 stays finite in fp32 (at most 3.4e38) through a bias
    # correction of down to 1e-4 (see ``exchange``)
    LARGEST_Q = 1e17
    STATE_KEYS = ("second", "lr_sum", "last", "denominator")

    def __init__(self, like: torch.Tensor, beta: float, eps: float, bound: float = 0.0, copies: int = 1,
                 memory: Optional[float] = None) -> None:
        self.eps = eps
        # D^2's average of q^2 per step covered (b2 unless given): a number, or a tensor where a
        # parameter group has its own
        self.memory: Any = float(beta if memory is None else memory)
        self.bound = bound or default_step_bound(beta, copies)
        self.bounds: Optional[torch.Tensor] = None  # the bound per coordinate, where a group has its own
        self.lr_scales: Optional[torch.Tensor] = None  # the lr's multiple per coordinate; None = 1
        self.second = torch.zeros_like(like)  # the average of q^2, not bias-corrected
        self.lr_sum = torch.zeros_like(like)  # learning rates summed since the last exchange
        self.last = torch.zeros(like.numel(), dtype=torch.int32, device=like.device)
        self.denominator = torch.ones_like(like)
        self.clamped: Optional[torch.Tensor] = None  # coordinates whose last local step was clamped

    def start(self, mean_grad: torch.Tensor) -> None:
        """Step 1: the (clipped) mean gradient is the first q."""
        self.second.copy_(mean_grad.square().mul_(1.0 - self.memory if isinstance(self.memory, float)
                                                  else torch.sub(1.0, self.memory)))
        self.last.fill_(1)
        torch.add(mean_grad.abs(), self.eps, out=self.denominator)

    def fold(self, q: torch.Tensor, mask: Optional[torch.Tensor], step: int):
        """(second, D) on the selection after folding in q, the revealed mean momentum (not stored)."""
        second, lr_sum = _take(self.second, mask), _take(self.lr_sum, mask)
        covered = (step - _take(self.last, mask)).float()
        memory = (torch.full_like(second, self.memory) if not isinstance(self.memory, torch.Tensor)
                  else _take(self.memory, mask))
        weight = torch.pow(memory, covered)
        folded = second * weight + q.square() * (1.0 - weight)
        second = torch.where(lr_sum > 0, folded, second)  # no lr since: nothing was revealed
        # a scalar memory's bias correction in Python's double
        correction = (1.0 - self.memory ** step if isinstance(self.memory, float)
                      else torch.sub(1.0, memory.pow(step)))
        return second, (second / correction).sqrt_().add_(self.eps)

    def commit(self, second: torch.Tensor, denom: torch.Tensor, mask: Optional[torch.Tensor], step: int) -> None:
        if mask is None:
            self.second.copy_(second)
            self.denominator.copy_(denom)
            self.lr_sum.zero_()
            self.last.fill_(step)
        else:
            kernels.scatter(self.second, mask, second)
            kernels.scatter(self.denominator, mask, denom)
            self.lr_sum.index_fill_(0, mask, 0.0)
            self.last.index_fill_(0, mask, step)

    def exchange(self, mean_drift: torch.Tensor, mask: Optional[torch.Tensor], step: int) -> None:
        """q = -mean drift D / lr sum, folded into D (before the copies snap to x).

        A coordinate whose own steps are tiny beside the others in its 64-value block (the rows
        of absent tokens, with the table at a raised lr) receives half a quantization step at each
        exchange whatever it did, which reads as q proportional to D, so D compounds at every
        exchange. |q| is capped at ``LARGEST_Q`` so that q^2 stays finite in fp32: past it D would
        be inf, and nan where such a drift is exactly 0. At that D a step is far below a weight's
        rounding, so the cap changes no trajectory.
        """
        lr_sum = _take(self.lr_sum, mask)
        q = -mean_drift * _take(self.denominator, mask) / lr_sum.clamp(min=torch.finfo(lr_sum.dtype).tiny)
        q.clamp_(-self.LARGEST_Q, self.LARGEST_Q)
        self.commit(*self.fold(q, mask, step), mask, step)

    def local_step(self, param: torch.Tensor, momentum: torch.Tensor, grad: torch.Tensor, lr: float,
                   beta1: float, bias_correction: float, weight_decay: float, decay_end: int,
                   share: float = 1.0) -> None:
        """y *= 1 - s lr wd (decay range); m = b1 m + (1 - b1) g; y -= s lr clamp((m / bc) / D, +-c).

        s is the share of its step the copy takes (``local_step_scale``), while the lr sum that q
        divides by counts the whole lr (the exchange divides the mean drift by s first). c is
        ``default_step_bound`` (``optimizer.step_bound`` sets it by hand), per coordinate where a
        parameter group has its own; it binds where this rank's momentum is far above the shared
        scale (logged as ``scape/clamped_fraction``). ``lr_scales``: the lr's multiple per coordinate, in
        the step, its weight decay and the lr sum, so q is the mean momentum there too.
        """
        mult = self.lr_scales
        if weight_decay != 0.0 and decay_end > 0:
            if mult is None:
                param[:decay_end].mul_(1.0 - share * lr * weight_decay)
            else:
                param[:decay_end].mul_(torch.mul(mult[:decay_end], -share * lr * weight_decay).add_(1.0))
        momentum.mul_(beta1).add_(grad, alpha=1.0 - beta1)
        update = torch.div(momentum, self.denominator).mul_(1.0 / bias_correction)
        bound: Any = self.bound if self.bounds is None else self.bounds
        self.clamped = (update.abs() > bound).sum()  # a device tensor: read at log steps only
        update.clamp_(-bound, bound)
        param.add_(update if mult is None else update.mul_(mult), alpha=-share * lr)
        if mult is None:
            self.lr_sum.add_(lr)
        else:
            self.lr_sum.add_(mult, alpha=lr)

    def state_dict(self) -> Dict[str, torch.Tensor]:
        return {f"normalizer_{key}": getattr(self, key).detach().cpu().clone() for key in self.STATE_KEYS}

    def load_state_dict(self, state: Dict[str, Any], fit=lambda tensor: tensor) -> None:
        missing = [key for key in self.STATE_KEYS if f"normalizer_{key}" not in state]
        if missing:
            raise ValueError("this checkpoint has no shared denominator: it was written by another "
                             "sparse_avg rule; resume with the code that wrote it")
        for key in self.STATE_KEYS:
            buffer = getattr(self, key)
            buffer.copy_(fit(state[f"normalizer_{key}"]).to(buffer.dtype))
        self.denominator.clamp_(min=self.eps)  # re-padded coordinates hold 0: m / 0 would be nan


class _CompressedAllReduce:
    """The drifts' exchange as value_bits-bit codes (1-bit Adam's two phases, at 2 (C - 1) / C
    times the payload, as an all-reduce): the selection is cut into C equal chunks, chunk c owned
    by exchange rank c. An all-to-all sends each chunk's codes to its owner, which averages them,
    adds what its earlier re-quantized means left out at these coordinates, quantizes the mean
    again and all-gathers those codes (with the norms) to every rank. The owner keeps the second
    quantization's error in ``error`` (over its region of the flat layout, 1 / C of it, from
    ``start``), so no copy carries it."""

    def __init__(self, comm: Collectives, copies: int, bits: int, scale_dtype: torch.dtype,
                 padded_numel: int, device: torch.device) -> None:
        self.comm, self.copies, self.bits, self.scale_dtype, self.device = comm, copies, bits, scale_dtype, device
        region = padded_numel // copies
        self.start = comm.rank() * region
        self.error = torch.zeros(region, dtype=torch.float32, device=device)

    def _encode(self, values: torch.Tensor):
        """(the codes and scales as one byte row, what they read back as)."""
        packed, scale, read_back = quantize(values, self.bits, self.scale_dtype)
        return torch.cat([packed, scale.view(torch.uint8)]), read_back

    def _decode(self, row: torch.Tensor, n: int) -> torch.Tensor:
        # (a copy of the scales' slice: a view as a wider dtype needs an aligned offset)
        codes = math.ceil(n * self.bits / 8)
        return dequantize(row[:codes], row[codes:].clone().view(self.scale_dtype), self.bits, n)

    def _gather_norms(self, row: torch.Tensor, norm: torch.Tensor):
        """All-gather every owner's ``row`` with its squared norm: (the rows, the summed squares)."""
        local = torch.cat([row, norm])
        gathered = torch.empty(self.copies * local.numel(), dtype=torch.uint8, device=self.device)
        self.comm.all_gather_into_tensor(gathered, local, kind="scape_values")
        rows = gathered.view(self.copies, -1)
        return rows, rows[:, -4:].reshape(-1).clone().view(torch.float32).sum()

    def __call__(self, sent: Optional[torch.Tensor], count: int, mask: Optional[torch.Tensor],
                 local_sq: torch.Tensor):
        """(the mean of the copies' drifts, what this copy keeps of its own, the summed squared
        norms); ``sent`` becomes what its codes left out. Step 1 (``count`` 0): only the norms."""
        copies = self.copies
        norm = local_sq.float().reshape(1).view(torch.uint8)
        if not count:
            gathered = torch.empty(copies * 4, dtype=torch.uint8, device=self.device)
            self.comm.all_gather_into_tensor(gathered, norm, kind="scape_values")
            return None, None, gathered.view(torch.float32).sum()
        own = self.comm.rank()
        chunk = count // copies  # count = partitions x k, and the copies divide the partitions
        pieces = []
        for part in sent.split(chunk):
            piece, read_back = self._encode(part)
            part.sub_(read_back)  # the client's error feedback: kept in the copy
            pieces.append(piece)
        received = torch.empty(copies * pieces[0].numel(), dtype=torch.uint8, device=self.device)
        self.comm.all_to_all_single(received, torch.cat(pieces), kind="scape_values")
        mean_here = torch.zeros(chunk, dtype=torch.float32, device=self.device)
        for row in received.view(copies, -1):
            mean_here.add_(self._decode(row, chunk))
        mean_here.div_(copies)
        # chunk `own` lies in the region the owner's error covers
        mine = (torch.arange(chunk, device=self.device) if mask is None
                else mask[own * chunk:(own + 1) * chunk] - self.start)
        mean_here.add_(self.error.index_select(0, mine))
        row, own_mean = self._encode(mean_here)
        rows, global_sq = self._gather_norms(row, norm)
        mean = torch.cat([own_mean if copy == own else self._decode(row[:-4], chunk)
                          for copy, row in enumerate(rows)])
        kernels.scatter(self.error, mine, mean_here.sub_(own_mean))
        return mean, sent, global_sq


class _Cycle:
    """The mask: one fixed permutation of a partition's offsets (the same on every rank and for
    every partition), walked k a step. Every coordinate is exchanged once every size / k steps
    (in steady state), the same period for all: none waits longer, as it can with a score."""

    def __init__(self, layout: Partitioning, device: torch.device) -> None:
        self.layout, self.device = layout, device
        order = torch.randperm(layout.partition_size, generator=torch.Generator().manual_seed(0))
        place = torch.empty(order.numel(), dtype=torch.int32)
        place[order] = torch.arange(order.numel(), dtype=torch.int32)
        self.place = place.to(device)  # each offset's place in the permutation
        self.position = 0  # how far along it the masks have come

    def next(self, k: int) -> torch.Tensor:
        """The next k offsets of the permutation in every partition, as ascending flat indices."""
        size, start = self.layout.partition_size, self.position
        end = start + k  # the window [start, end) of places, wrapping around at size
        if end <= size:
            chosen = (self.place >= start) & (self.place < end)
        else:
            chosen = (self.place >= start) | (self.place < end - size)
        # a pass over the partition, not a sort of the k offsets (the same ascending offsets);
        # exactly k places are in the window, and a static size keeps a GPU from syncing here
        offsets = torch.nonzero_static(chosen, size=k).squeeze(1)
        self.position = end % size
        starts = torch.arange(self.layout.num_partitions, device=self.device) * size
        return (starts[:, None] + offsets[None, :]).reshape(-1)


class SparseAverageSynchronizer(MaskedSynchronizer):
    """Sparse model averaging over one flat fp32 view of the model's trainable parameters."""

    def __init__(self, model: torch.nn.Module, cfg: SparseAverageConfig, comm: Optional[Collectives] = None,
                 steps: Optional[int] = None, density: Optional[Callable[[int], float]] = None) -> None:
        """``steps``: the run's length, which the byte budget's plan spreads its bytes over
        (scape.budget.density_plan; the builder passes train.steps). ``density``: the density of
        each step's exchange instead of the plan (a fixed rule, for the tests of the arithmetic)."""
        cfg = as_dataclass(cfg)
        if not isinstance(cfg, SparseAverageConfig):
            raise ValueError(f"sparse averaging needs optimizer=sparse_avg's config, got optimizer={cfg.name}")
        validate_sparse_avg(cfg)
        self.cfg = cfg
        decay_numel = self._flatten(model, NAME, comm=comm)  # self.flat.data is y_i
        super().__init__(model, _LocalMomentum(self.flat.data, decay_numel, cfg), self.comm)
        self.consensus = self.flat.data.clone()  # x: every rank seeds identically, so y_i = x
        self._copy_groups(int(cfg.ranks_per_copy))
        # the share of its local step a copy takes; the mean drift is divided by it into x
        self.local_step_scale = (float(cfg.local_step_scale)
                                 or default_local_step_scale(self.copies, cfg.local_step_scale_power))
        self.cycle = _Cycle(self.layout, self.device)
        self.value_dtype = torch.bfloat16 if cfg.value_dtype == "bf16" else torch.float32
        self.quantized = (_CompressedAllReduce(self.exchange_comm, self.copies, int(cfg.value_bits),
                                               self.value_dtype, self.layout.padded_numel, self.device)
                          if cfg.value_bits else None)
        self.normalizer = _SharedNormalizer(self.consensus, float(cfg.betas[1]), float(cfg.eps), float(cfg.step_bound),
                                            self.copies)
        self._table_settings(model, cfg)
        self.plan: Optional[DensityPlan] = None
        self._density = density or self._planned(steps)
        self.step_count = 0  # steps completed
        self._local_norm: Optional[torch.Tensor] = None
        self._global_sq: Optional[torch.Tensor] = None  # sum over ranks of ||g_i||^2
        self._sent = 0  # coordinates averaged this step
        self._skipped = False  # step() skipped: after_step leaves the mask for the retry

    def _planned(self, steps: Optional[int]) -> Callable[[int], float]:
        if steps is None:
            raise ValueError("sparse averaging plans each step's density from the run's length: give "
                             "SparseAverageSynchronizer steps=train.steps (or a density rule)")
        self.plan = density_plan(self.cfg, self.layout.numel, self.world, self.copies, int(steps))
        return self.plan.at

    def density_at(self, step: int) -> float:
        """The density of step ``step``'s exchange (the plan's, or the rule given)."""
        return float(self._density(step))

    def k_at(self, step: int) -> int:
        return self.layout.k(self.density_at(step))

    def _copy_groups(self, size: int) -> None:
        """ranks_per_copy: this rank trains one copy with the others of its group (their gradients
        averaged densely, as DDP would), and every exchange among the copies runs in a group of
        one rank per copy, so the copies, not the ranks, are what the drifts are averaged over."""
        self.ranks_per_copy = size
        self.copies = self.world // size
        self.copy_comm: Optional[Collectives] = None
        self.exchange_comm = self.comm
        if size > 1:
            if self.world % size or self.comm.group is not None:
                raise ValueError(f"optimizer.ranks_per_copy={size} must divide the number of ranks "
                                 f"({self.world}): set it to the GPUs per node, or 1")
            groups = new_groups([range(c * size, (c + 1) * size) for c in range(self.copies)]
                                + [range(j, self.world, size) for j in range(size)])
            self.copy_comm = self.comm.in_group(groups[self.rank // size])
            self.exchange_comm = self.comm.in_group(groups[self.copies + self.rank % size])

    def _table_settings(self, model: torch.nn.Module, cfg: SparseAverageConfig) -> None:
        """The override group's lr multiple, step bound and D's memory (``optimizer.param_groups``),
        per flat coordinate; a setting the group leaves None is the rest's."""
        group, n = override_group(cfg), self.normalizer
        if group is None:
            return
        tables = group_parameter_ids(model, cfg)  # a group that matches nothing is refused
        if group.step_bound is not None:
            n.bounds = self._per_table(tables, n.bound, float(group.step_bound))
        if group.lr_scale != 1:
            n.lr_scales = self._per_table(tables, 1.0, float(group.lr_scale))
        if group.denominator_beta is not None:
            n.memory = self._per_table(tables, float(n.memory), float(group.denominator_beta))

    def _per_table(self, tables: Set[int], elsewhere: float, on_tables: float) -> torch.Tensor:
        """A value per flat coordinate: ``on_tables`` on the parameters whose ids are ``tables``
        (the group's: the embedding tables, a tied output head with them), ``elsewhere`` elsewhere."""
        values = torch.full_like(self.consensus, elsewhere)
        for start, end in self.flat.ranges(tables):
            values[start:end] = on_tables
        return values

    # --- the loop's calls ----------------------------------------------------------------------
    def zero_grad(self) -> None:
        self.flat.zero_grad()

    @torch.no_grad()
    def reduce_gradients(self) -> None:
        step = self.step_count + 1
        self.masks.start_step()
        if self.copy_comm is not None:  # the copy's gradient: the mean over its ranks
            self.copy_comm.all_reduce(self.flat.grad, kind="copy_gradients")
            self.flat.grad.div_(self.ranks_per_copy)
        y, x = self.flat.data, self.consensus
        self._local_norm = torch.linalg.vector_norm(self.flat.grad)
        if step == 1:  # no drift yet (every copy starts at x), no mask: only the norm crosses
            mask, count = None, 0
        elif self.is_dense(step):
            mask, count = None, self.layout.padded_numel
        else:
            mask = self.masks.mask_for(step)
            count = mask.numel()
        sent = None
        if count:
            sent = y - x if mask is None else y.index_select(0, mask) - x.index_select(0, mask)
        mean, kept = (self._exchange(sent, count) if self.quantized is None
                      else self._exchange_codes(sent, count, mask))
        self._sent = count
        if not count:
            return
        if self.local_step_scale != 1.0:  # the copies took that share of their steps
            mean.div_(self.local_step_scale)
        self.normalizer.exchange(mean, mask, step)
        if mask is None:
            x.add_(mean)
            if kept is None:
                y.copy_(x)
            else:
                torch.add(x, kept, out=y)
        else:
            x.index_add_(0, mask, mean)
            snapped = x.index_select(0, mask)
            kernels.scatter(y, mask, snapped if kept is None else snapped.add_(kept))

    def _exchange_codes(self, sent: Optional[torch.Tensor], count: int, mask: Optional[torch.Tensor]):
        """value_bits: (the mean of the copies' quantized drifts, what this copy keeps of them)."""
        mean, kept, self._global_sq = self.quantized(sent, count, mask, self._local_norm.square())
        return mean, kept

    def _exchange(self, sent: Optional[torch.Tensor], count: int):
        """value_bits 0: the drifts in value_dtype and the squared norm in one all-reduce (bf16's
        rounding stays in the copy, as SCAPE keeps it in its residual)."""
        kept = None
        payload = torch.empty(count + 1, dtype=self.value_dtype, device=self.device)
        if count:
            payload[:count].copy_(sent)
            if self.value_dtype != torch.float32:
                kept = sent.sub_(payload[:count].float())
        payload[-1] = self._local_norm.square()
        self.exchange_comm.all_reduce(payload, kind="scape_values")
        self._global_sq = payload[-1].float()
        return payload[:count].float().div_(self.copies), kept

    @torch.no_grad()
    def clip_gradients(self, max_norm: float) -> torch.Tensor:
        """Clip this rank's gradient by its own norm; return the ranks' RMS norm (the same
        everywhere), on the device (float64, as the loop logs it)."""
        if max_norm > 0:
            self.flat.grad.mul_(torch.clamp(max_norm / (self._local_norm + 1e-6), max=1.0))
        return self._global_sq.double().div(self.copies).sqrt_().reshape(())

    @torch.no_grad()
    def step(self, lr: float, skip: Optional[torch.Tensor] = None) -> None:
        """The local step, unless ``skip`` (some rank's loss or the ranks' norm is not finite):
        then nothing moves, and after_step keeps the mask for the retry. The drifts the
        reduction averaged stay averaged: the copies moved toward their mean, not by a step."""
        self._skipped = self._skips(skip)
        if self._skipped:
            return
        step = self.step_count + 1
        if step == 1:  # the only dense gradient exchange: the clipped gradient, whose mean
            # starts D and is every rank's step-1 gradient (a dense first step)
            self.exchange_comm.all_reduce(self.flat.grad, kind="grad_allreduce")
            self.normalizer.start(self.flat.grad.div_(self.copies))
        opt = self.optimizer
        opt.param_groups[0]["lr"] = lr
        self.normalizer.local_step(self.flat.data, opt.momentum, self.flat.grad, lr, opt.beta1,
                                   1.0 - opt.beta1 ** step, opt.weight_decay, opt.decay_end,
                                   share=self.local_step_scale)
        self.step_count = step

    @torch.no_grad()
    def after_step(self) -> None:
        if self._retrying():
            return
        following = self.step_count + 1
        self.masks.overlap = None
        if self.is_dense(following):
            return
        self._choose_mask(following)

    def _choose_mask(self, following: int) -> None:
        """M_{following}: the cycle's next window, held at once (nothing to exchange)."""
        k = self.k_at(following)
        self.masks.hold(following, self.cycle.next(k), k)

    # --- the averaged model --------------------------------------------------------------------
    @torch.no_grad()
    def averaged_weights(self) -> torch.Tensor:
        """x + mean_i d_i (+ the owners' pending errors) as a new flat buffer: one dense
        all-reduce (kind ``average``), collective."""
        drift = self.flat.data - self.consensus
        if self.quantized is not None:  # the owners' pending errors: C e_i, so the mean adds sum_i e_i
            start, error = self.quantized.start, self.quantized.error
            drift[start:start + error.numel()].add_(error, alpha=self.copies)
        self.exchange_comm.all_reduce(drift, kind="average")
        return drift.div_(self.local_step_scale).div_(self.copies).add_(self.consensus)

    @contextlib.contextmanager
    def evaluation_weights(self) -> Iterator[None]:
        """Inside, the model holds the average of the ranks' copies; y_i is restored exactly after."""
        with torch.no_grad():
            average = self.averaged_weights()
            local = self.flat.data.clone()
            self.flat.data.copy_(average)
            del average
        try:
            yield
        finally:
            with torch.no_grad():
                self.flat.data.copy_(local)

    def model_state_dict(self) -> Dict[str, torch.Tensor]:
        """The averaged model (collective: every rank calls)."""
        with self.evaluation_weights():
            return {name: t.detach().clone() for name, t in self.model.state_dict().items()}

    def load_model_state_dict(self, state: Dict[str, torch.Tensor]) -> None:
        """Load weights as the consensus with zero drift (a checkpoint's local state then restores y_i)."""
        super().load_model_state_dict(state)
        self.consensus.copy_(self.flat.data)

    # --- metrics -------------------------------------------------------------------------------
    def metrics(self) -> Dict[str, float]:
        out = {"scape/density": self._sent / self.layout.padded_numel,
               "scape/dense_step": float(self.is_dense(max(self.step_count, 1))),
               "scape/drift_norm": float(torch.linalg.vector_norm(self.flat.data - self.consensus))}
        if self._local_norm is not None:
            out["scape/local_grad_norm"] = float(self._local_norm)
        if self.normalizer.clamped is not None:
            out["scape/clamped_fraction"] = float(self.normalizer.clamped) / self.layout.numel
        out.update(self.masks.metrics())
        return out

    # --- checkpoints ---------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        """Replicated state at a step boundary."""
        self.masks.wait()
        state: Dict[str, Any] = {"optimizer": NAME, "step": self.step_count,
                                 "layout": self.masks.layout_record(),
                                 "consensus": self.consensus.detach().cpu().clone(),
                                 # the copies' drifts are in its units
                                 "local_step_scale": self.local_step_scale,
                                 "cycle_position": self.cycle.position}
        state.update(self.normalizer.state_dict())
        state.update(self.masks.state_dict(self.step_count + 1))
        return state

    def _check_written(self, state: Dict[str, Any]) -> None:
        if state.get("optimizer") != NAME or "consensus" not in state:
            raise ValueError("this checkpoint was not written by optimizer=sparse_avg (no consensus "
                             "weights); resume it with the optimizer that wrote it")
        written = float(state.get("local_step_scale", 1.0))
        if written != self.local_step_scale:
            raise ValueError(f"this checkpoint was written with optimizer.local_step_scale={written}, this "
                             f"run has {self.local_step_scale}: the copies' drifts are in its units; resume "
                             f"with optimizer.local_step_scale={written}")

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self._check_written(state)
        self.masks.check_layout(state.get("layout"))
        if "cycle_position" not in state:
            raise ValueError("this checkpoint has no cyclic mask position: it was written by another "
                             "sparse_avg rule; resume with the code that wrote it")
        self.masks.wait()
        self.consensus.copy_(state["consensus"])
        self.cycle.position = int(state["cycle_position"])
        self.normalizer.load_state_dict(state)
        self.step_count = int(state["step"])
        self.masks.load_state_dict(state)

    def local_state_dict(self) -> Dict[str, Any]:
        state = {"params": self.flat.data.detach().cpu().clone(),
                 "momentum": self.optimizer.momentum.detach().cpu().clone(),
                 "rank": self.rank, "layout": self.masks.layout_record()}
        if self.quantized is not None:
            state.update(mean_error=self.quantized.error.detach().cpu().clone(),
                         mean_error_start=self.quantized.start, copies=self.copies)
        return state

    def load_local_state_dict(self, state: Dict[str, Any]) -> None:
        self.masks.check_layout(state.get("layout"))
        if "params" not in state or "momentum" not in state:
            raise ValueError("this rank's checkpoint file holds no sparse_avg copy and momentum; "
                             "it was written by another optimizer")
        if int(state["rank"]) != self.rank:
            raise ValueError(f"sparse_avg state of rank {state['rank']} loaded on rank {self.rank}")
        with torch.no_grad():
            self.flat.data.copy_(state["params"])
            self.optimizer.momentum.copy_(state["momentum"])
            # a pending error moves losslessly between its two homes (the owner's buffer, or C
            # times into the owner's copy), so a run with other codes resumes it too
            if self.quantized is not None:
                self.quantized.error.zero_()
            if "mean_error" in state:
                error, start = state["mean_error"].to(self.device), int(state["mean_error_start"])
                if self.quantized is not None and start == self.quantized.start:
                    self.quantized.error.copy_(error)
                else:
                    self.flat.data[start:start + error.numel()].add_(error, alpha=int(state["copies"]))

    def load_resharded_state(self, state: Dict[str, Any], shards: Any) -> None:
        """Elastic resume from a checkpoint of ``shards.world`` ranks (collective).

        The consensus x, D's buffers and the step are replicated (re-padded for this run's
        partitions). Every new rank takes y = mean_i y_i and m = mean_i m_i over the old ranks
        (each owner's pending error joined to its copy first): the average model is unchanged,
        and the drift left to average in is the mean drift on every rank. The cycle restarts
        (this run's partitions have another size) and the pending mask is its first window."""
        self._check_written(state)
        old = state.get("layout") or {}
        numel, padded = self.layout.numel, self.layout.padded_numel
        if old.get("numel") != numel:
            raise ValueError(f"sparse_avg checkpoint has {old.get('numel')} parameters, this model has "
                             f"{numel}: resume with the model the run was started with")
        self.masks.wait()
        self.consensus.copy_(repad(state["consensus"], numel, padded))
        self.normalizer.load_state_dict(state, fit=lambda tensor: repad(tensor, numel, padded))
        self.cycle.position = 0
        self.step_count = int(state["step"])
        self.masks.load_state_dict({})
        like = {key: torch.empty(old["padded_numel"]) for key in ("params", "momentum")}
        mean = shards.mean(_copy_and_momentum, like, self.comm, self.rank, self.world, self.device)
        with torch.no_grad():
            self.flat.data.copy_(repad(mean["params"].cpu(), numel, padded))
            self.optimizer.momentum.copy_(repad(mean["momentum"].cpu(), numel, padded))
        following = self.step_count + 1
        if "mask" in state and not self.is_dense(following):
            self._choose_mask(following)


def _copy_and_momentum(local: Dict[str, Any]) -> Dict[str, torch.Tensor]:
    """A rank's copy (its owner's pending error joined to it, C times: the mean of the old copies
    is then the average model) and momentum, from its checkpoint file."""
    if "params" not in local or "momentum" not in local:
        raise ValueError("a rank's checkpoint file holds no sparse_avg copy and momentum; "
                         "it was written by another optimizer")
    out = {"params": local["params"], "momentum": local["momentum"]}
    if "mean_error" in local:
        error, start = local["mean_error"], int(local["mean_error_start"])
        out["params"] = out["params"].clone()
        out["params"][start:start + error.numel()].add_(error, alpha=int(local["copies"]))
    return out
