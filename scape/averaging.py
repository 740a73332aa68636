"""Sparse model averaging (``optimizer.name=sparse_avg``): local AdamS, sparse averaging of drifts.

SCAPE keeps one model on every rank and sends a sparse slice of the gradient statistics; this
optimizer keeps one model *per* rank and sends a sparse slice of how far each model has moved
away from the others. At most SCAPE's bytes per step, the same number of state buffers, one
(compressed) all-reduce per step on the critical path.

State
    replicated (identical on every rank by construction): the consensus x (flat fp32, padded as
    ``scape.partition.Partitioning`` says), the mask M, the step t.
    per rank: the local copy y_i -- the model's parameters ARE y_i (views into one flat buffer,
    ``core.flat.FlatParameters``) -- and the local AdamS momentum m_i. The drift is
    d_i = y_i - x; it is never stored, so a checkpoint holds y_i bit for bit.
    ranks_per_copy: G > 1 consecutive ranks train one copy (a node's GPUs): reduce_gradients
    first averages their gradients densely (kind copy_gradients, inside the node), so they hold
    the same y_i; every exchange below then runs among the W / G copies, in the group of the
    ranks with this rank's index in its copy (one rail per GPU of a node).

One step t, in the loop's order
    reduce_gradients  wait for M_t's all-gather (started in the previous after_step); payload =
                      d_i[M_t] (k values per partition, in flat order) plus one float, this rank's
                      squared local gradient norm; ONE all-reduce (kind scape_values);
                      x[M_t] += mean_i d_i[M_t];  y_i[M_t] = x[M_t]  (d_i = 0 there).
                      value_bits (the default 2): the drifts travel as b-bit codes with a scale
                      per 64 values instead, through a compressed all-reduce (an all-to-all to
                      each chunk's owner, then an all-gather of the owners' re-quantized means;
                      both kind scape_values) or one all-gather of every rank's codes, and
                      y_i[M_t] = x[M_t] + what its own codes left out.
                      average_momentum: the payload also holds m_i[M_t] and every rank's
                      momentum becomes their mean there; normalizer=oracle: one more, dense
                      all-reduce of the momenta (kind oracle) feeds D everywhere (a decomposition
                      tool).
    clip_gradients    every worker is its own optimizer: this rank's gradient is clipped by its
                      own norm, or (grad_clip_scope=shared) every rank's by one factor, grad_clip
                      over the returned norm. The returned norm is sqrt(mean_i ||g_i||^2), the
                      root mean square of the local norms, from the all-reduced squared norms:
                      every rank gets the same number, so a non-finite step is skipped by all
                      ranks together.
    step              normalizer=local: dense AdamS on y_i with the local gradient and the
                      local momentum (``scape.kernels.adams_dense_update``: decoupled weight
                      decay on the ndim >= 2 prefix of the flat layout, dense AdamS's arithmetic);
                      normalizer=shared: the same momentum and decay over one replicated
                      denominator D (``_SharedNormalizer``), so the local steps are linear;
                      local_momentum=consensus: the step is b1 M + (1 - b1) g_i over D, with
                      M one replicated momentum (held in the momentum buffer, the same on
                      every rank), re-estimated at each exchange from the averaged drift.
    after_step        score |d_i| = |y_i - x| on this rank's own partition(s); exact top-k per
                      partition (``scape.topk``), k = ceil(density(t+1) |P_r|) with SCAPE's
                      sparsity warm-up; encode (``scape.transport``: bitmap / indices / auto) and
                      start the async all-gather of M_{t+1} (kind scape_mask), waited on in the
                      next reduce_gradients.

Why this shape
    * The values sent at t+1 are exactly the drift that was scored at t (nothing changes y_i in
      between), so the mask is fresh: no lag error, unlike SCAPE's score of the statistics before
      the send.
    * Off the mask nothing is lost: a coordinate that is not sent keeps moving locally with full
      dense AdamS steps, and its accumulated drift is averaged in whenever it is selected. The
      exchange never changes the average model x + mean_i d_i (in exact arithmetic): it only moves
      mass from the drifts into the consensus.
    * With density 1 every step ends in the dense average of the ranks' models: the copies are
      identical after the exchange and x(t+1) = mean_i AdamS_i(x(t)) (local SGD with H = 1,
      using AdamS with local momentum).
    * Step 1 has no mask and no drift (all copies start from the same seed), so only the norm
      crosses (a 1-float all-reduce). ``dense_warmup_steps: W`` exchanges the whole drift on
      steps 2..W (the dense average of the models); the first sparse mask is scored after step W.
    * ``value_dtype=bf16`` sends the drift in bf16; the rounding error stays in y_i
      (y_i[M] = x[M] + d_i[M] - bf16(d_i[M])), as SCAPE keeps it in its residual, so the average
      model is not changed by the cast.

The model to validate, save and export is the average mean_i y_i = x + mean_i d_i: one dense
all-reduce (kind ``average``), only at evaluation and checkpoint time (``evaluation_weights``,
``model_state_dict``). The trainer counts bytes per training step, so -- like the validation
loss all-reduce -- it is not part of the per-step bytes or the compression ratio.

Checkpoints: ``state_dict`` (rank 0) holds x, the step, the pending mask as a bitmap and the
shared denominator's buffers; ``local_state_dict`` (every rank) holds y_i and m_i (and A_i with
``exchange=momentum``). The trainer loads the model weights (the
average) first, then these two, so y_i is restored exactly and a resumed run is bit-identical.
On another number of ranks (``load_resharded_state``) every new rank starts from the mean of the
old copies and of the old momenta: the average model x + mean_i d_i is kept, the drift is shared
equally.
"""
from __future__ import annotations

import contextlib
import math
from typing import Any, Dict, Iterator, Optional

import torch

from core.checkpoint import repad
from core.comm import Collectives, all_gather_bytes, all_reduce_bytes, all_to_all_bytes, new_groups
from core.flat import embedding_weight_ids
from scape import kernels
from scape.accounting import VALUE_BYTES, scape_step_bytes
from scape.config import OptimizerConfig
from scape.masking import MaskedSynchronizer
from scape.options import (as_dataclass, embedding_denominator_beta, embedding_step_bound, refuse_foreign_keys,
                           validate_config)
from scape.quantize import dequantize, packed_nbytes, quantize

NAME = "sparse_avg"
# SCAPE keys that have no meaning here: a non-default value is an error, not silently ignored.
SCAPE_ONLY_KEYS = ("offload_residual", "lag", "overlap_backward", "update", "stale_scale_cap", "stale_scale", "base",
                   "score", "score_timing", "lossless_clip")


def validate_sparse_avg(cfg: OptimizerConfig) -> None:
    """SCAPE's checks of the shared keys, and no SCAPE-only key away from its default."""
    refuse_foreign_keys(cfg, SCAPE_ONLY_KEYS, "a SCAPE", NAME)
    validate_config(cfg)
    scale = cfg.local_step_scale
    if scale not in (0, 1) and (cfg.normalizer == "local" or cfg.exchange != "drift"):
        raise ValueError(f"optimizer.local_step_scale={scale} scales the local steps over a shared denominator "
                         f"and the averaged drift back; it needs optimizer.normalizer=shared, revealed or "
                         f"oracle and optimizer.exchange=drift")


def sparse_avg_step_bytes(numel: int, world: int, sparsity: float, mask_transport: str = "auto",
                          value_dtype: str = "fp32", mask_rule: str = "drift",
                          normalizer: str = "local", average_momentum: bool = False,
                          value_bits: int = 0, quantized_collective: str = "all_gather") -> Dict[str, float]:
    """Bytes per rank of a sparse step: SCAPE's formula plus the one norm value in the payload
    (and no mask with ``mask_rule=cyclic``, which every rank computes alike); with
    ``normalizer=revealed`` or ``average_momentum`` the momenta travel beside the drifts (twice
    the values); ``normalizer=oracle`` adds a dense fp32 all-reduce of the momenta (``oracle``);
    ``value_bits`` all-gathers the packed codes, their scales and the fp32 norm instead, or with
    ``quantized_collective=compressed_all_reduce`` sends each of the world's chunks of codes to
    its owner (an all-to-all) and all-gathers the owners' codes of the mean with the norm."""
    out = dict(scape_step_bytes(numel, world, sparsity, mask_transport, value_dtype))
    if value_bits:
        count, scale_bytes = world * out["k"], VALUE_BYTES[value_dtype]
        if quantized_collective == "all_gather":
            out["values"] = all_gather_bytes(packed_nbytes(count, value_bits, scale_bytes) + 4, world)
        else:
            chunk = packed_nbytes(count // world, value_bits, scale_bytes)
            out["values"] = all_to_all_bytes(world * chunk, world) + all_gather_bytes(chunk + 4, world)
    else:
        if normalizer == "revealed" or average_momentum:
            out["values"] *= 2
        out["values"] += all_reduce_bytes(VALUE_BYTES[value_dtype], world)
    if mask_rule == "cyclic":
        out["mask"], out["transport"] = 0, "none"
    out["oracle"] = all_reduce_bytes(4 * numel, world) if normalizer == "oracle" else 0
    out["total"] = out["values"] + out["mask"] + out["oracle"]
    return out


class _LocalAdamS:
    """This rank's AdamS over the flat buffer y_i: the momentum and torch-like ``param_groups``."""

    def __init__(self, param: torch.Tensor, decay_end: int, cfg: OptimizerConfig) -> None:
        self.param, self.decay_end = param, decay_end
        self.beta1, self.beta2 = float(cfg.betas[0]), float(cfg.betas[1])
        self.eps, self.weight_decay = float(cfg.eps), float(cfg.weight_decay)
        self.param_groups = [{"lr": cfg.lr, "betas": (self.beta1, self.beta2), "eps": self.eps,
                              "weight_decay": self.weight_decay}]
        self.momentum = torch.zeros_like(param)

    def step(self, grad: torch.Tensor, lr: float, step: int) -> None:
        self.param_groups[0]["lr"] = lr
        kernels.adams_dense_update(self.param, self.momentum, grad, lr, self.beta1, self.beta2,
                                   self.eps, 1.0 - self.beta1 ** step, self.weight_decay,
                                   self.decay_end)


def _take(buffer: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
    """The exchanged coordinates of a flat buffer, as a new tensor (all of them without a mask)."""
    return buffer.clone() if mask is None else buffer.index_select(0, mask)


def default_local_step_scale(copies: int, power: float) -> float:
    """The share of its local step a copy takes by default: min(1, (4 / C)^power) on C copies.

    Where gradient noise dominates, a copy's local steps stray from x by sqrt(C) times the mean
    step's noise (each copy's momentum holds 1 / C of the batch). Some of that spread is worth
    having (on 4 copies a smaller share is worse), beyond it the copies' gradients are taken too
    far from x. power 0.5 holds the spread at what 4 copies have at their whole step; the best
    shares measured on 8 and 16 copies fall more slowly than that (docs/RESULTS.md "Copies that
    take part of their step" and "A milder slope").
    """
    return min(1.0, (4.0 / copies) ** power)


def default_step_bound(beta2: float, copies: int) -> float:
    """The clamp of a local step over the shared denominator, in lr: sqrt(C / (1 - b2)) on C copies.

    1 / sqrt(1 - b2) is the furthest AdamS moves a coordinate in one step (|m| / sqrt(v) with v the
    average of m^2): the bound of a single copy. D is the scale of the *mean* momentum over the C
    copies, while each copy's momentum holds the gradient noise of 1 / C of the batch: where noise
    dominates |m_i| / D is sqrt(C) times what it is at one copy, so a fixed bound clamps more
    coordinates the more copies are averaged. Scaled by sqrt(C), the bound clamps a copy's step
    where AdamS on that copy's own share of the batch would be at its largest.
    """
    return math.sqrt(copies) / math.sqrt(1.0 - beta2)


class _SharedNormalizer:
    """``normalizer=shared``: one replicated denominator D for every rank's local step.

    With each rank's own AdamS denominator the average of the local steps is not an AdamS step
    on the mean gradient: a rank sees a quarter of the batch (on 4 ranks), so its denominator
    holds four times the gradient noise and noise-dominated coordinates move about half as far
    as under dense AdamS (docs/RESULTS.md, the density-1 decomposition). With one D on every rank a local step
    y_i -= lr (m_i / bc) / D is linear in m_i, so the mean of the copies moves by
    lr (mean_i m_i / bc) / D: the momentum of the mean gradient, whatever the density.

    D is built from what the exchange reveals. When a coordinate's drifts are averaged after
    local steps with learning rates lr_s, the copies all left x there with the same D, so
    q = -mean_i d_i D / sum_s lr_s is the lr-weighted mean of the bias-corrected mean momentum
    over those steps (the weight decay's share, about lr wd |x| a step, is left in). D^2 is an
    exponential average of q^2 with beta2, bias-corrected, updated at each exchange with the
    weight 1 - beta2^S of the S steps it covers: at density 1 the second moment of the
    momentum, one step late (AdaMomentum's normaliser). Step 1 all-reduces the clipped gradient
    once: its mean starts D (D = |mean g|) and is every rank's step-1 gradient, so step 1 is one
    dense sign step and the copies start equal. A local step is clamped at AdamS's largest step
    on a copy's share of the batch (see ``local_step``). Costs three replicated buffers
    (the raw average, the lr sum, the last exchange's step) and no bytes after step 1.
    """

    def __init__(self, like: torch.Tensor, beta: float, eps: float, max_covered: Optional[float] = None,
                 bound: float = 0.0, copies: int = 1, fresh_bound: float = 0.0,
                 own_floor: float = 0.0, memory: Optional[float] = None) -> None:
        self.beta, self.eps = beta, eps
        # denominator_beta: D^2's average of q^2 per step covered (beta, AdamS's b2, if None); a
        # tensor where the embedding tables have their own (embedding_denominator_beta)
        self.memory: Any = float(beta if memory is None else memory)
        # normalizer=revealed: one revealed momentum is one sample, worth at most the momentum's
        # correlation time 1 / (1 - b1) of steps however long the interval was
        self.max_covered = max_covered
        self.bound = bound or default_step_bound(beta, copies)
        # fresh_step_bound: the bound where D was refreshed at this step's exchange
        self.fresh_bound = fresh_bound or self.bound
        # embedding_step_bound: the bound per coordinate, where a part of the model has its own
        self.bounds: Optional[torch.Tensor] = None
        # own_denominator_floor f: D floored at the copy's own AdamS denominator / (f copies); 0 = none
        self.own_floor, self.copies = own_floor, copies
        # embedding_lr_scale: the lr's multiplier per coordinate (k on the embedding tables); None = 1
        self.lr_scales: Optional[torch.Tensor] = None
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
        if self.max_covered is not None:
            covered.clamp_(max=self.max_covered)
        memory = (torch.full_like(second, self.memory) if not isinstance(self.memory, torch.Tensor)
                  else _take(self.memory, mask))
        weight = torch.pow(memory, covered)
        folded = second * weight + q.square() * (1.0 - weight)
        second = torch.where(lr_sum > 0, folded, second)  # no lr since: nothing was revealed
        # a scalar memory's bias correction in Python's double, as before the per-table memory
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

    def reveal(self, q: torch.Tensor, mask: Optional[torch.Tensor], step: int) -> None:
        """normalizer=revealed: the mean momentum itself, sent beside the drift, folded into D."""
        self.commit(*self.fold(q, mask, step), mask, step)

    def exchange(self, mean_drift: torch.Tensor, mask: Optional[torch.Tensor], step: int) -> None:
        """normalizer=shared: q = -mean drift D / lr sum, folded into D (before the copies snap to x).

        A coordinate whose own steps are tiny beside the others in its 64-value block (the rows
        of absent tokens, with the table at 16 lr) receives half a quantization step at each
        exchange whatever it did, which reads as q = D x (that step / lr sum): proportional to D,
        so D compounds at every exchange and the coordinate stops moving (docs/RESULTS.md, "Where
        D runs away"). |q| is capped at ``LARGEST_Q`` so that q^2 stays finite in fp32: past it D
        would be inf, and nan where such a drift is exactly 0. At that D a step is far below a
        weight's rounding, so the cap changes no trajectory; capping q lower (at grad_clip, which
        bounds a mean momentum of clipped gradients) lets those coordinates move and measured worse.
        """
        lr_sum = _take(self.lr_sum, mask)
        q = -mean_drift * _take(self.denominator, mask) / lr_sum.clamp(min=torch.finfo(lr_sum.dtype).tiny)
        q.clamp_(-self.LARGEST_Q, self.LARGEST_Q)
        self.reveal(q, mask, step)

    def local_step(self, param: torch.Tensor, momentum: torch.Tensor, grad: torch.Tensor, lr: float,
                   beta1: float, bias_correction: float, weight_decay: float, decay_end: int, step: int,
                   frozen: bool = False, scale: Any = 1.0, excess: Optional[torch.Tensor] = None) -> None:
        """y *= 1 - s lr wd (decay range); m = b1 m + (1 - b1) g; y -= s lr clamp((m / bc) / D, +-c).

        s is ``local_step_scale``: the copy takes that share of its step, while the lr sum that
        q divides by counts the whole lr (the exchange divides the mean drift by s first).

        ``frozen`` (local_momentum=consensus): m is the consensus momentum M and stays as it is;
        the step is y -= lr clamp((b1 M + (1 - b1) g) / D, +-c), with no bias correction (M
        starts at the mean gradient of step 1).

        c = sqrt(C / (1 - beta2)) on C copies (``default_step_bound``; ``optimizer.step_bound``
        sets it by hand). It binds where this rank's momentum is far above the shared scale: a coordinate
        whose D is still tiny, and -- at long exchange intervals, where q's average over the
        interval shrinks D under noise -- most coordinates late in training at 99% sparsity
        (docs/RESULTS.md), whose local steps are then sign steps. Logged as
        ``scape/clamped_fraction``. Where D was refreshed at this step's exchange (every coordinate
        at density 1) the bound is ``optimizer.fresh_step_bound`` if set: there D holds the mean
        momentum of the step before, so a step over it is not taken over an old scale. The
        embedding tables' coordinates have ``optimizer.embedding_step_bound`` if set.

        ``own_floor`` f (own_denominator_floor): D is floored at this copy's own AdamS denominator
        sqrt(b2 (m / bc)^2 + (1 - b2) g^2) / (f C). Where the copy holds a coordinate's gradient
        alone its step is then at most f C times its own AdamS step, so the mean over the copies is
        at most f times that step (f = 1: what dense AdamS takes on that mean gradient).

        ``excess`` (clamp_excess=send): what the bound cuts, -s lr (u - clamp(u)), is added to it,
        to be sent with the drift at the coordinate's next exchange.

        ``lr_scales`` (embedding_lr_scale k): the lr is k lr on the embedding tables, in the step,
        its weight decay and the lr sum, so q (the drift over the lr sum) is the mean momentum there
        too. The table's drifts are k times larger, which the top-k masks see (embedding_score_scale
        1 / k scores them in the rest's units). ``scale`` is a
        tensor where the tables have their own share (embedding_local_step_scale).
        """
        lr_scales = self.lr_scales
        # the copy moves by share x lr x mult: mult None (1), or the per-coordinate part of it
        if isinstance(scale, torch.Tensor):
            share, mult = 1.0, (scale if lr_scales is None else scale * lr_scales)
        else:
            share, mult = scale, lr_scales
        if weight_decay != 0.0 and decay_end > 0:
            if mult is None:
                param[:decay_end].mul_(1.0 - share * lr * weight_decay)
            else:
                param[:decay_end].mul_(torch.mul(mult[:decay_end], -share * lr * weight_decay).add_(1.0))
        if frozen:
            update = torch.add(grad, momentum, alpha=beta1 / (1.0 - beta1)).mul_(1.0 - beta1)
            update.div_(self.denominator)
        else:
            denominator = self.denominator
            if self.own_floor:  # AdamS's denominator of this copy's own step, over the copies
                own = (momentum / bias_correction).square_().mul_(self.beta)
                own.addcmul_(grad, grad, value=1.0 - self.beta).sqrt_().div_(self.own_floor * self.copies)
                denominator = torch.maximum(denominator, own)
            momentum.mul_(beta1).add_(grad, alpha=1.0 - beta1)
            update = torch.div(momentum, denominator).mul_(1.0 / bias_correction)
        bound: Any = self.bound if self.bounds is None else self.bounds
        if self.fresh_bound != self.bound:
            bound = torch.where(self.last == step, self.fresh_bound, bound)
        self.clamped = (update.abs() > bound).sum()  # a device tensor: read at log steps only
        if excess is not None:
            clamped = update.clamp(-bound, bound)
            cut = update.sub_(clamped)
            excess.add_(cut if mult is None else cut.mul_(mult), alpha=-share * lr)
            update = clamped
        else:
            update.clamp_(-bound, bound)
        param.add_(update if mult is None else update.mul_(mult), alpha=-share * lr)
        if lr_scales is None:
            self.lr_sum.add_(lr)
        else:
            self.lr_sum.add_(lr_scales, alpha=lr)

    # the largest |q| folded into D: q^2 = 1e34 stays finite in fp32 (at most 3.4e38) through a bias
    # correction of down to 1e-4 (see ``exchange``)
    LARGEST_Q = 1e17

    STATE_KEYS = ("second", "lr_sum", "last", "denominator")

    def state_dict(self) -> Dict[str, torch.Tensor]:
        return {f"normalizer_{key}": getattr(self, key).detach().cpu().clone() for key in self.STATE_KEYS}

    def load_state_dict(self, state: Dict[str, Any], fit=lambda tensor: tensor) -> None:
        missing = [key for key in self.STATE_KEYS if f"normalizer_{key}" not in state]
        if missing:
            raise ValueError("this checkpoint has no shared normalizer: it was written with "
                             "optimizer.normalizer=local; resume with the normalizer that wrote it")
        for key in self.STATE_KEYS:
            buffer = getattr(self, key)
            buffer.copy_(fit(state[f"normalizer_{key}"]).to(buffer.dtype))
        self.denominator.clamp_(min=self.eps)  # re-padded coordinates hold 0: m / 0 would be nan


class SparseAverageSynchronizer(MaskedSynchronizer):
    """Sparse model averaging over one flat fp32 view of the model's trainable parameters."""

    def __init__(self, model: torch.nn.Module, cfg: OptimizerConfig,
                 comm: Optional[Collectives] = None) -> None:
        cfg = as_dataclass(cfg)
        validate_sparse_avg(cfg)
        self.cfg = cfg
        decay_numel = self._flatten(model, NAME, comm=comm)  # self.flat.data is y_i
        super().__init__(model, _LocalAdamS(self.flat.data, decay_numel, cfg), self.comm)
        self.consensus = self.flat.data.clone()  # x: every rank seeds identically, so y_i = x
        # ranks_per_copy: this rank trains one copy with the others of its group (their gradients
        # averaged densely, as DDP would), and every exchange among the copies runs in a group of
        # one rank per copy, so the copies, not the ranks, are what the drifts are averaged over
        self.ranks_per_copy = int(cfg.ranks_per_copy)
        self.copies = self.world // self.ranks_per_copy
        self.copy_comm: Optional[Collectives] = None
        self.exchange_comm = self.comm
        if self.ranks_per_copy > 1:
            size = self.ranks_per_copy
            if self.world % size or self.comm.group is not None:
                raise ValueError(f"optimizer.ranks_per_copy={size} must divide the number of ranks "
                                 f"({self.world}): set it to the GPUs per node, or 1")
            groups = new_groups([range(c * size, (c + 1) * size) for c in range(self.copies)]
                                + [range(j, self.world, size) for j in range(size)])
            self.copy_comm = self.comm.in_group(groups[self.rank // size])
            self.exchange_comm = self.comm.in_group(groups[self.copies + self.rank % size])
        self.outer_lr, self.outer_momentum = float(cfg.outer_lr), float(cfg.outer_momentum)
        self.clip_scope = cfg.grad_clip_scope
        # the share of its local step a copy takes; the mean drift is divided by it into x. 0:
        # default_local_step_scale over a shared denominator, the whole step over local ones
        shared_steps = cfg.normalizer != "local" and cfg.exchange == "drift"
        self.local_step_scale = (float(cfg.local_step_scale)
                                 or (default_local_step_scale(self.copies, cfg.local_step_scale_power)
                                     if shared_steps else 1.0))
        # embedding_local_step_scale: the tables' own share (step_shares: the share per coordinate)
        self.table_step_scale = float(cfg.embedding_local_step_scale) or self.local_step_scale
        self.step_shares: Optional[torch.Tensor] = None
        # the outer momentum u (replicated like x); None = plain averaging
        self.outer_velocity = torch.zeros_like(self.consensus) if self.outer_momentum else None
        self.mask_rule = cfg.mask_rule
        # mask_rule=deviation: the consensus's drift per local step at each coordinate's last
        # exchange, and that exchange's step (replicated: both follow from the all-reduced mean)
        deviation = self.mask_rule == "deviation"
        self.consensus_rate = torch.zeros_like(self.consensus) if deviation else None
        # step 1 counts as an exchange: every copy starts at x
        self.last_exchange = torch.ones(self.consensus.numel(), dtype=torch.int32,
                                        device=self.device) if deviation else None
        # mask_rule=cyclic: one fixed permutation of a partition's offsets (the same on every
        # rank and for every partition), held as each offset's place in it (int32), and how far
        # along it the masks have come
        self.cycle_place: Optional[torch.Tensor] = None
        if self.mask_rule == "cyclic":
            order = torch.randperm(self.layout.partition_size, generator=torch.Generator().manual_seed(0))
            place = torch.empty(order.numel(), dtype=torch.int32)
            place[order] = torch.arange(order.numel(), dtype=torch.int32)
            self.cycle_place = place.to(self.device)
        self.cycle_position = 0
        self.value_dtype = torch.bfloat16 if cfg.value_dtype == "bf16" else torch.float32
        self.value_bits = int(cfg.value_bits)  # 0: value_dtype values; else codes (value_dtype scales)
        self.midtread = cfg.value_quantizer == "midtread"
        self.quantized_collective = cfg.quantized_collective
        # requantization_error=owner: the owner's pending error of its chunk's mean, over the chunk
        # of the flat layout this copy owns in the compressed all-reduce (1 / C of it, from
        # mean_error_start); the copies' mean model is x + mean_i d_i + this, summed over the owners
        self.mean_error: Optional[torch.Tensor] = None
        self.mean_error_start = 0
        if cfg.requantization_error == "owner":
            region = self.layout.padded_numel // self.copies
            self.mean_error_start = self.exchange_comm.rank() * region
            self.mean_error = torch.zeros(region, dtype=torch.float32, device=self.device)
        momentum_exchange = cfg.exchange == "momentum"
        self.revealed = cfg.normalizer == "revealed"
        self.oracle = cfg.normalizer == "oracle"
        self.average_momentum = bool(cfg.average_momentum)
        self.consensus_momentum = cfg.local_momentum == "consensus"
        self.normalizer = _SharedNormalizer(
            self.consensus, float(cfg.betas[1]), float(cfg.eps),
            1.0 / (1.0 - float(cfg.betas[0])) if self.revealed else None, float(cfg.step_bound), self.copies,
            float(cfg.fresh_step_bound), float(cfg.own_denominator_floor),
            None if cfg.denominator_beta is None else float(cfg.denominator_beta),
        ) if cfg.normalizer in ("shared", "revealed", "oracle") or momentum_exchange else None
        table_bound = embedding_step_bound(cfg)
        if table_bound and self.normalizer is not None:
            key = "embedding_step_bound" if cfg.embedding_step_bound else "scaled_embedding_step_bound"
            self.normalizer.bounds = self._per_table(model, self.normalizer.bound, table_bound, key,
                                                     "bounds the steps on", 0)
        if self.table_step_scale != self.local_step_scale:
            self.step_shares = self._per_table(model, self.local_step_scale, self.table_step_scale,
                                               "embedding_local_step_scale", "sets the copies' share of the step on", 0)
        # embedding_score_scale: the top-k score's factor per coordinate of this rank's partitions
        self.score_scales: Optional[torch.Tensor] = None
        if cfg.embedding_score_scale != 1:
            own = slice(self.layout.owned_start, self.layout.owned_start + self.layout.owned_numel)
            self.score_scales = self._per_table(model, 1.0, float(cfg.embedding_score_scale),
                                                "embedding_score_scale", "scales the score on", 1)[own].clone()
        if cfg.embedding_lr_scale != 1 and self.normalizer is not None:
            self.normalizer.lr_scales = self._per_table(model, 1.0, float(cfg.embedding_lr_scale),
                                                        "embedding_lr_scale", "scales the lr on", 1)
        table_memory = embedding_denominator_beta(cfg)
        if table_memory is not None and self.normalizer is not None:
            key = ("embedding_denominator_beta" if cfg.embedding_denominator_beta is not None
                   else "scaled_embedding_denominator_beta")
            self.normalizer.memory = self._per_table(model, float(self.normalizer.memory), table_memory,
                                                     key, "sets D's memory on", "null")
        # exchange=momentum: A_i, this rank's lr-weighted sum of its bias-corrected momentum
        # since each coordinate's last exchange (what the ranks average instead of the drift)
        self.accumulated = torch.zeros_like(self.consensus) if momentum_exchange else None
        # clamp_excess=send: what the step bound cut off this copy's local steps since each
        # coordinate's last exchange, part of the drift it sends there
        self.clamp_excess = torch.zeros_like(self.consensus) if cfg.clamp_excess == "send" else None

        self.step_count = 0  # steps completed
        self._local_norm: Optional[torch.Tensor] = None
        self._global_sq: Optional[torch.Tensor] = None  # sum over ranks of ||g_i||^2
        self._sent = 0  # coordinates averaged this step

    def _per_table(self, model: torch.nn.Module, elsewhere: float, on_tables: float, key: str, does: str,
                   off: Any) -> torch.Tensor:
        """A value per flat coordinate: ``on_tables`` on the weights of the model's
        ``torch.nn.Embedding`` tables (a tied output head shares them), ``elsewhere`` elsewhere."""
        tables = embedding_weight_ids(model)
        if not tables:
            raise ValueError(f"optimizer.{key}={on_tables:g} {does} the embedding tables, but the model has "
                             f"no torch.nn.Embedding: leave it {off if isinstance(off, str) else format(off, 'g')}")
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
        # normalizer=revealed / average_momentum: the momenta, after the drifts
        revealed = count if self.revealed or self.average_momentum else 0
        kept = None  # bf16 or quantized payload: what the sent values do not say, kept in y_i
        sent = None
        if count:
            if self.accumulated is not None:
                sent = _take(self.accumulated, mask)
            else:
                sent = y - x if mask is None else y.index_select(0, mask) - x.index_select(0, mask)
                if self.clamp_excess is not None:  # what the bound cut goes with it, and is then sent
                    sent.add_(_take(self.clamp_excess, mask))
                    if mask is None:
                        self.clamp_excess.zero_()
                    else:
                        self.clamp_excess.index_fill_(0, mask, 0.0)
        if self.value_bits:
            mean, kept = self._exchange_quantized(sent, count, mask)
        else:
            payload = torch.empty(count + revealed + 1, dtype=self.value_dtype, device=self.device)
            if count:
                payload[:count].copy_(sent)
                if self.value_dtype != torch.float32:
                    kept = sent.sub_(payload[:count].float())
                if revealed:
                    payload[count:2 * count].copy_(_take(self.optimizer.momentum, mask))
            payload[-1] = self._local_norm.square()
            self.exchange_comm.all_reduce(payload, kind="scape_values")
            self._global_sq = payload[-1].float()
            mean = payload[:count].float().div_(self.copies)
        self._sent = count
        bias_correction = 1.0 - self.optimizer.beta1 ** (step - 1)
        if self.oracle and step > 1:  # every coordinate's mean momentum (after step t - 1) into D
            numel = self.layout.numel
            summed = self.optimizer.momentum[:numel].clone()
            self.exchange_comm.all_reduce(summed, kind="oracle")
            q = torch.zeros_like(self.optimizer.momentum)
            q[:numel] = summed.div_(self.copies * bias_correction)
            self.normalizer.reveal(q, None, step)
        if not count:
            return
        if self.accumulated is not None:
            self._consensus_step(mean, mask, step, kept)
            return
        mean_momentum = payload[count:2 * count].float().div_(self.copies) if revealed else None
        mean = self._outer_step(mean, mask)
        if self.step_shares is not None:  # the copies took those shares of their steps
            mean.div_(_take(self.step_shares, mask))
        elif self.local_step_scale != 1.0:
            mean.div_(self.local_step_scale)
        self._record_rate(mean, mask, step)
        if self.revealed:  # q: the mean momentum now (after step t - 1), bias-corrected
            self.normalizer.reveal(mean_momentum / bias_correction, mask, step)
        elif self.consensus_momentum:
            momentum = self._consensus_momentum(mean, mask, step)
            self.normalizer.exchange(mean, mask, step)
            bound = _take(self.normalizer.denominator, mask).mul_(self.normalizer.bound)
            momentum = momentum.clamp_(-bound, bound)
            if mask is None:
                self.optimizer.momentum.copy_(momentum)
            else:
                kernels.scatter(self.optimizer.momentum, mask, momentum)
        elif self.normalizer is not None and not self.oracle:
            self.normalizer.exchange(mean, mask, step)
        if self.average_momentum:  # every rank's momentum becomes the mean there (as y_i becomes x)
            if mask is None:
                self.optimizer.momentum.copy_(mean_momentum)
            else:
                kernels.scatter(self.optimizer.momentum, mask, mean_momentum)
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

    def _exchange_quantized(self, sent: Optional[torch.Tensor], count: int, mask: Optional[torch.Tensor]):
        """value_bits: (the mean of the copies' quantized drifts, what this copy keeps of them).

        quantized_collective=all_gather: ONE all-gather (kind scape_values) of every rank's packed
        codes and block scales (``scape.quantize``) with its squared local gradient norm in fp32
        behind them; every rank reads all of them back and sums them in rank order, so the mean is
        the same bits everywhere. It sends (C - 1) times the payload (C copies).

        compressed_all_reduce (1-bit Adam's two phases, at 2 (C - 1) / C times the payload, as
        an all-reduce): the selection is cut into C equal chunks, chunk c owned by the exchange
        rank c (always the same partitions). An all-to-all sends each chunk's codes to its owner,
        which averages them, quantizes the mean again and all-gathers those codes (with the norm)
        to every rank. What the second quantization leaves out goes into the owner's own copy, C
        times over, so the mean of the copies is not changed by the exchange and the owner's next
        drift sends it again (error feedback through the copy: no state of its own); with
        requantization_error=owner it stays in the owner's buffer instead and is added to the
        mean of those coordinates the next time they are exchanged (``mask``: the exchanged
        coordinates, None for all), so the copies do not carry it.
        """
        bits, scale_dtype, copies = self.value_bits, self.value_dtype, self.copies
        norm = self._local_norm.square().float().reshape(1).view(torch.uint8)
        if not count:  # step 1: only the norms cross
            gathered = torch.empty(copies * 4, dtype=torch.uint8, device=self.device)
            self.exchange_comm.all_gather_into_tensor(gathered, norm, kind="scape_values")
            self._global_sq = gathered.view(torch.float32).sum()
            return None, None

        def encode(values: torch.Tensor):
            """(the codes and scales as one byte row, what they read back as)."""
            packed, scale, read_back = quantize(values, bits, scale_dtype, self.midtread)
            return torch.cat([packed, scale.view(torch.uint8)]), read_back

        def decode(row: torch.Tensor, n: int) -> torch.Tensor:
            # (a copy of the scales' slice: a view as a wider dtype needs an aligned offset)
            codes = math.ceil(n * bits / 8)
            return dequantize(row[:codes], row[codes:].clone().view(scale_dtype), bits, n, self.midtread)

        own = self.exchange_comm.rank()
        if self.quantized_collective == "all_gather":
            row, read_back = encode(sent)
            local = torch.cat([row, norm])
            gathered = torch.empty(copies * local.numel(), dtype=torch.uint8, device=self.device)
            self.exchange_comm.all_gather_into_tensor(gathered, local, kind="scape_values")
            rows = gathered.view(copies, -1)
            self._global_sq = rows[:, -4:].reshape(-1).clone().view(torch.float32).sum()
            total = torch.zeros(count, dtype=torch.float32, device=self.device)
            for copy, row in enumerate(rows):  # in rank order: the same sum on every rank
                total.add_(read_back if copy == own else decode(row[:-4], count))
            return total.div_(copies), sent.sub_(read_back)

        chunk = count // copies  # count = partitions x k, and the copies divide the partitions
        pieces = []
        for part in sent.split(chunk):
            piece, read_back = encode(part)
            part.sub_(read_back)  # the client's error feedback: kept in the copy
            pieces.append(piece)
        received = torch.empty(copies * pieces[0].numel(), dtype=torch.uint8, device=self.device)
        self.exchange_comm.all_to_all_single(received, torch.cat(pieces), kind="scape_values")
        mean_here = torch.zeros(chunk, dtype=torch.float32, device=self.device)
        for row in received.view(copies, -1):
            mean_here.add_(decode(row, chunk))
        mean_here.div_(copies)
        if self.mean_error is not None:  # chunk `own` lies in the region the buffer covers
            start = self.mean_error_start
            mine = (torch.arange(chunk, device=self.device) if mask is None
                    else mask[own * chunk:(own + 1) * chunk] - start)
            mean_here.add_(self.mean_error.index_select(0, mine))
        row, own_mean = encode(mean_here)
        local = torch.cat([row, norm])
        gathered = torch.empty(copies * local.numel(), dtype=torch.uint8, device=self.device)
        self.exchange_comm.all_gather_into_tensor(gathered, local, kind="scape_values")
        rows = gathered.view(copies, -1)
        self._global_sq = rows[:, -4:].reshape(-1).clone().view(torch.float32).sum()
        mean = torch.cat([own_mean if copy == own else decode(row[:-4], chunk) for copy, row in enumerate(rows)])
        if self.mean_error is not None:  # the owner keeps the second quantization's error
            kernels.scatter(self.mean_error, mine, mean_here.sub_(own_mean))
        else:  # the owner's copy takes it, once for every copy
            sent[own * chunk:(own + 1) * chunk].add_(mean_here.sub_(own_mean), alpha=copies)
        return mean, sent

    def _consensus_momentum(self, mean_drift: torch.Tensor, mask: Optional[torch.Tensor], step: int) -> torch.Tensor:
        """local_momentum=consensus: the new M on the exchanged coordinates (before D folds them in).

        Every rank stepped b1 M + (1 - b1) g_i over D since the last exchange, so the averaged
        drift, less the weight decay's known share (lr wd x a step), reveals the lr-weighted
        mean step r = b1 M + (1 - b1) gbar over the S steps covered, hence gbar, the mean
        gradient there. M then moves as dense momentum would under a steady gbar:
        M <- b1^S M + (1 - b1^S) gbar (at S = 1 exactly dense momentum on the mean gradient).
        The caller bounds |M| by c D (c: the step bound), as a local step is bounded, so that
        the bias the clamp puts in r cannot feed back into M.
        """
        n, beta1 = self.normalizer, self.optimizer.beta1
        lr_sum, momentum = _take(n.lr_sum, mask), _take(self.optimizer.momentum, mask)
        decayed = -mean_drift
        wd, decay_end = self.optimizer.weight_decay, self.optimizer.decay_end
        if wd and decay_end > 0:
            index = torch.arange(lr_sum.numel(), device=self.device) if mask is None else mask
            decay = (index < decay_end).float().mul_(wd).mul_(lr_sum).mul_(_take(self.consensus, mask))
            decayed.sub_(decay)
        step_mean = decayed.mul_(_take(n.denominator, mask)).div_(lr_sum.clamp(min=torch.finfo(lr_sum.dtype).tiny))
        gradient = step_mean.sub_(momentum, alpha=beta1).div_(1.0 - beta1)
        keep = torch.pow(torch.full_like(lr_sum, beta1), (step - _take(n.last, mask)).float())
        updated = momentum * keep + gradient * (1.0 - keep)
        return torch.where(lr_sum > 0, updated, momentum)  # no lr since: nothing was revealed

    def _consensus_update(self, mean_sum: torch.Tensor, mask: Optional[torch.Tensor], step: int):
        """exchange=momentum: (x, second, D) on the selection after a step on the mean momentum sum.

        mean_sum = sum_s lr_s mean_i m_i,s / bc_s over the steps since the last exchange, so
        q = mean_sum / sum_s lr_s is the revealed mean momentum; D folds it in (as Adam's
        denominator holds the current gradient, which also bounds the step by 1 / sqrt(1 - b2^S)),
        then x = x (1 - wd sum_s lr_s) - mean_sum / D (the decay on the matrices only; exact at
        density 1, to first order in lr wd over an interval).
        """
        lr_sum = _take(self.normalizer.lr_sum, mask)
        q = mean_sum / lr_sum.clamp(min=torch.finfo(lr_sum.dtype).tiny)
        second, denom = self.normalizer.fold(q, mask, step)
        x = _take(self.consensus, mask)
        decay_end, wd = self.optimizer.decay_end, self.optimizer.weight_decay
        if wd:
            index = torch.arange(x.numel(), device=self.device) if mask is None else mask
            x.mul_(torch.where(index < decay_end, 1.0 - wd * lr_sum, torch.ones_like(lr_sum)))
        return x.sub_(mean_sum / denom), second, denom

    def _consensus_step(self, mean_sum: torch.Tensor, mask: Optional[torch.Tensor], step: int,
                        kept: Optional[torch.Tensor]) -> None:
        """exchange=momentum: the consensus steps on the exchanged coordinates, the copies snap to
        it there and their sums restart (from the bf16 rounding error of what was sent)."""
        x, second, denom = self._consensus_update(mean_sum, mask, step)
        self.normalizer.commit(second, denom, mask, step)
        rest = torch.zeros_like(x) if kept is None else kept
        if mask is None:
            self.consensus.copy_(x)
            self.flat.data.copy_(x)
            self.accumulated.copy_(rest)
        else:
            kernels.scatter(self.consensus, mask, x)
            kernels.scatter(self.flat.data, mask, x)
            kernels.scatter(self.accumulated, mask, rest)

    def _outer_step(self, mean_drift: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
        """The consensus increment on the exchanged coordinates (in place of ``mean_drift``).

        DiLoCo's outer Nesterov step, per coordinate: the averaged drift is the outer "gradient";
        u = mu u + delta, x += eta (delta + mu u). A coordinate's u moves only when it is exchanged,
        so at 99% sparsity each coordinate sees an outer step about every 1/density steps (DiLoCo
        with a per-coordinate H). eta = 1, mu = 0 is plain averaging, the default.
        """
        if self.outer_velocity is None:
            return mean_drift.mul_(self.outer_lr) if self.outer_lr != 1.0 else mean_drift
        u = self.outer_velocity if mask is None else self.outer_velocity.index_select(0, mask)
        u.mul_(self.outer_momentum).add_(mean_drift)
        if mask is not None:
            kernels.scatter(self.outer_velocity, mask, u)
        return mean_drift.add_(u, alpha=self.outer_momentum).mul_(self.outer_lr)

    def _record_rate(self, increment: torch.Tensor, mask: Optional[torch.Tensor], step: int) -> None:
        """mask_rule=deviation: remember the consensus's drift per local step on the exchanged
        coordinates (the drift exchanged at ``step`` built up over step - last local steps)."""
        if self.consensus_rate is None:
            return
        last = self.last_exchange if mask is None else self.last_exchange.index_select(0, mask)
        rate = increment / (step - last).clamp_(min=1).float()
        if mask is None:
            self.consensus_rate.copy_(rate)
            self.last_exchange.fill_(step)
        else:
            kernels.scatter(self.consensus_rate, mask, rate)
            self.last_exchange.index_fill_(0, mask, step)

    def _cyclic_mask(self, k: int) -> torch.Tensor:
        """The next k offsets of the permutation in every partition, as ascending flat indices.

        Every coordinate is exchanged once every size / k steps (in steady state), the same
        period for all: no coordinate waits longer than that, as it can with a score or a draw.
        """
        size, start = self.layout.partition_size, self.cycle_position
        end = start + k  # the window [start, end) of places, wrapping around at size
        place = self.cycle_place
        if end <= size:
            chosen = (place >= start) & (place < end)
        else:
            chosen = (place >= start) | (place < end - size)
        # a pass over the partition, not a sort of the k offsets (the same ascending offsets);
        # exactly k places are in the window, and a static size keeps a GPU from syncing here
        offsets = torch.nonzero_static(chosen, size=k).squeeze(1)
        self.cycle_position = end % size
        starts = torch.arange(self.layout.num_partitions, device=self.device) * size
        return (starts[:, None] + offsets[None, :]).reshape(-1)

    def _score_drifts(self, following: int) -> None:
        """This rank's score of its own partition(s) for the mask of step ``following``."""
        own = slice(self.layout.owned_start, self.layout.owned_start + self.layout.owned_numel)
        if self.mask_rule == "random":  # the same draw on a resumed run: seeded by step and rank
            generator = torch.Generator(device=self.device).manual_seed(1_000_003 * following + self.rank)
            self.score.copy_(torch.rand(self.score.shape, generator=generator, device=self.device))
            return
        if self.accumulated is not None:  # exchange=momentum: the pending consensus movement
            torch.abs(self.accumulated[own], out=self.score)
        else:
            self._drift_score(own, following)
        if self.score_scales is not None:  # the tables scored in the rest's units
            self.score.mul_(self.score_scales)

    def _drift_score(self, own: slice, following: int) -> None:
        """|what this copy would send| on its own partitions (mask_rule drift or deviation)."""
        torch.sub(self.flat.data[own], self.consensus[own], out=self.score)
        if self.clamp_excess is not None:  # the drift it would send holds what the bound cut
            self.score.add_(self.clamp_excess[own])
        if self.mean_error is not None:  # what the mean still owes there (this rank's partitions
            # lie in its copy's chunk of the compressed all-reduce)
            start = self.layout.owned_start - self.mean_error_start
            self.score.add_(self.mean_error[start:start + self.layout.owned_numel])
        if self.consensus_rate is not None:  # minus what the consensus is predicted to do
            age = (following - self.last_exchange[own]).float()
            self.score.sub_(self.consensus_rate[own] * age)
        self.score.abs_()

    @torch.no_grad()
    def clip_gradients(self, max_norm: float) -> float:
        """Clip this rank's gradient by its own norm (grad_clip_scope=rank) or by the ranks' RMS norm
        (shared: one factor everywhere); return the ranks' RMS norm (the same everywhere)."""
        total = float(self._global_sq)
        rms = math.sqrt(total / self.copies) if math.isfinite(total) else total
        if max_norm > 0 and self.clip_scope == "rank":
            self.flat.grad.mul_(torch.clamp(max_norm / (self._local_norm + 1e-6), max=1.0))
        elif max_norm > 0:
            self.flat.grad.mul_(min(1.0, max_norm / (rms + 1e-6)))
        return rms

    @torch.no_grad()
    def step(self, lr: float) -> None:
        step = self.step_count + 1
        # the density of the next exchanges follows this step's lr (density_lr_power)
        self.masks.lr_ratio = lr / self.cfg.lr
        if self.normalizer is None or self.accumulated is not None:
            self.optimizer.step(self.flat.grad, lr, step)
            if self.accumulated is not None:
                self.accumulated.add_(self.optimizer.momentum, alpha=lr / (1.0 - self.optimizer.beta1 ** step))
                self.normalizer.lr_sum.add_(lr)
        else:
            if step == 1:  # the only dense exchange of normalizer=shared: the clipped gradient,
                # whose mean starts D and is every rank's step-1 gradient (a dense first step)
                self.exchange_comm.all_reduce(self.flat.grad, kind="grad_allreduce")
                self.normalizer.start(self.flat.grad.div_(self.copies))
                if self.consensus_momentum:  # M starts at the mean gradient
                    self.optimizer.momentum.copy_(self.flat.grad)
            opt = self.optimizer
            opt.param_groups[0]["lr"] = lr
            self.normalizer.local_step(self.flat.data, opt.momentum, self.flat.grad, lr, opt.beta1,
                                       1.0 - opt.beta1 ** step, opt.weight_decay, opt.decay_end, step,
                                       frozen=self.consensus_momentum,
                                       scale=self.local_step_scale if self.step_shares is None else self.step_shares,
                                       excess=self.clamp_excess)
        self.step_count = step

    @torch.no_grad()
    def after_step(self) -> None:
        following = self.step_count + 1
        self.masks.overlap = None
        if self.is_dense(following):
            return
        # a mask loaded or waited for without a step since is not the one M_{t+1} follows
        self._choose_mask(following, async_op=True, overlap=self.mask_step == self.step_count)

    def _choose_mask(self, following: int, async_op: bool, overlap: bool) -> None:
        """M_{following} by the mask rule: held at once (cyclic) or its all-gather started."""
        k = self.k_at(following)
        if self.cycle_place is not None:
            self.masks.hold(following, self._cyclic_mask(k), k)
            return
        self._score_drifts(following)
        self.masks.exchange(following, k, async_op=async_op, overlap=overlap)

    # --- the averaged model --------------------------------------------------------------------
    @torch.no_grad()
    def averaged_weights(self) -> torch.Tensor:
        """x + mean_i d_i as a new flat buffer: one dense all-reduce (kind ``average``), collective.

        With exchange=momentum: the consensus after exchanging every coordinate now (the
        all-reduce is of the momentum sums), which changes no state."""
        if self.accumulated is not None:
            mean_sum = self.accumulated.clone()
            self.exchange_comm.all_reduce(mean_sum, kind="average")
            # the exchange of step t + 1 covers the local steps up to t
            return self._consensus_update(mean_sum.div_(self.copies), None, self.step_count + 1)[0]
        drift = self.flat.data - self.consensus
        if self.clamp_excess is not None:  # what the bound cut is the copy's drift too
            drift.add_(self.clamp_excess)
        if self.mean_error is not None:  # the owners' pending errors: C e_i, so the mean adds sum_i e_i
            start = self.mean_error_start
            drift[start:start + self.mean_error.numel()].add_(self.mean_error, alpha=self.copies)
        self.exchange_comm.all_reduce(drift, kind="average")
        shares = self.local_step_scale if self.step_shares is None else self.step_shares
        return drift.div_(shares).div_(self.copies).add_(self.consensus)

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
        if self.normalizer is not None and self.normalizer.clamped is not None:
            out["scape/clamped_fraction"] = float(self.normalizer.clamped) / self.layout.numel
        out.update(self.masks.metrics())
        return out

    # --- checkpoints ---------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        """Replicated state at a step boundary; waits for the in-flight mask all-gather."""
        self.masks.wait()
        state: Dict[str, Any] = {"optimizer": NAME, "step": self.step_count,
                                 "layout": self.masks.layout_record(),
                                 "consensus": self.consensus.detach().cpu().clone(),
                                 # the last step's lr / peak lr sizes the next mask (density_lr_power)
                                 "lr_ratio": float(self.masks.lr_ratio),
                                 # the copies' drifts are in its units
                                 "local_step_scale": self.local_step_scale,
                                 "embedding_local_step_scale": self.table_step_scale}
        if self.outer_velocity is not None:
            state["outer_velocity"] = self.outer_velocity.detach().cpu().clone()
        if self.cycle_place is not None:
            state["cycle_position"] = self.cycle_position
        if self.consensus_rate is not None:
            state["consensus_rate"] = self.consensus_rate.detach().cpu().clone()
            state["last_exchange"] = self.last_exchange.detach().cpu().clone()
        if self.normalizer is not None:
            state.update(self.normalizer.state_dict())
        state.update(self.masks.state_dict(self.step_count + 1))
        return state

    def _check_local_step_scale(self, state: Dict[str, Any]) -> None:
        written = float(state.get("local_step_scale", 1.0))  # 1.0: written before it existed
        if written != self.local_step_scale:
            raise ValueError(f"this checkpoint was written with optimizer.local_step_scale={written}, this "
                             f"run has {self.local_step_scale}: the copies' drifts are in its units; resume "
                             f"with optimizer.local_step_scale={written}")
        table = float(state.get("embedding_local_step_scale", written))  # written before it existed: the same
        if table != self.table_step_scale:
            raise ValueError(f"this checkpoint was written with the copies taking {table} of their step on the "
                             f"embedding tables, this run {self.table_step_scale}: the drifts there are in its "
                             f"units; resume with optimizer.embedding_local_step_scale={table}")

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        if state.get("optimizer") != NAME or "consensus" not in state:
            raise ValueError("this checkpoint was not written by optimizer=sparse_avg (no consensus "
                             "weights); resume it with the optimizer that wrote it")
        self.masks.check_layout(state.get("layout"))
        self.masks.wait()
        self.consensus.copy_(state["consensus"])
        if (self.outer_velocity is None) != ("outer_velocity" not in state):
            written = "> 0" if "outer_velocity" in state else "= 0"
            raise ValueError(f"this checkpoint was written with optimizer.outer_momentum {written}, "
                             f"this run has optimizer.outer_momentum={self.outer_momentum}; resume "
                             f"with the outer momentum that wrote it")
        if self.outer_velocity is not None:
            self.outer_velocity.copy_(state["outer_velocity"])
        self._check_local_step_scale(state)
        if self.cycle_place is not None:
            if "cycle_position" not in state:
                raise ValueError("this checkpoint has no cyclic mask position: it was written with "
                                 "another optimizer.mask_rule; resume with the one that wrote it")
            self.cycle_position = int(state["cycle_position"])
        if self.consensus_rate is not None:
            if "consensus_rate" not in state:
                raise ValueError("this checkpoint has no consensus drift rate: it was written with "
                                 "another optimizer.mask_rule; resume with the one that wrote it")
            self.consensus_rate.copy_(state["consensus_rate"])
            self.last_exchange.copy_(state["last_exchange"])
        if self.normalizer is not None:
            self.normalizer.load_state_dict(state)
        elif "normalizer_denominator" in state:
            raise ValueError("this checkpoint was written with optimizer.normalizer=shared; resume "
                             "with the normalizer that wrote it")
        self.step_count = int(state["step"])
        self.masks.lr_ratio = float(state.get("lr_ratio", 1.0))  # 1.0: written before it was kept
        self.masks.load_state_dict(state)

    def local_state_dict(self) -> Dict[str, Any]:
        state = {"params": self.flat.data.detach().cpu().clone(),
                 "momentum": self.optimizer.momentum.detach().cpu().clone(),
                 "rank": self.rank, "layout": self.masks.layout_record()}
        if self.accumulated is not None:
            state["accumulated"] = self.accumulated.detach().cpu().clone()
        if self.clamp_excess is not None:
            state["clamp_excess"] = self.clamp_excess.detach().cpu().clone()
        if self.mean_error is not None:
            state.update(mean_error=self.mean_error.detach().cpu().clone(),
                         mean_error_start=self.mean_error_start, copies=self.copies)
        return state

    def load_local_state_dict(self, state: Dict[str, Any]) -> None:
        self.masks.check_layout(state.get("layout"))
        if "params" not in state or "momentum" not in state:
            raise ValueError("this rank's checkpoint file holds no sparse_avg copy and momentum; "
                             "it was written by another optimizer")
        if int(state["rank"]) != self.rank:
            raise ValueError(f"sparse_avg state of rank {state['rank']} loaded on rank {self.rank}")
        if (self.accumulated is None) != ("accumulated" not in state):
            written = "momentum" if "accumulated" in state else "drift"
            raise ValueError(f"this rank's checkpoint was written with optimizer.exchange={written}; "
                             f"resume with the exchange that wrote it")
        if (self.clamp_excess is None) != ("clamp_excess" not in state):
            written = "send" if "clamp_excess" in state else "drop"
            raise ValueError(f"this rank's checkpoint was written with optimizer.clamp_excess={written}; "
                             f"resume with the clamp_excess that wrote it")
        with torch.no_grad():
            self.flat.data.copy_(state["params"])
            self.optimizer.momentum.copy_(state["momentum"])
            if self.accumulated is not None:
                self.accumulated.copy_(state["accumulated"])
            if self.clamp_excess is not None:
                self.clamp_excess.copy_(state["clamp_excess"])
            # requantization_error: a pending error moves losslessly between its two homes (the
            # owner's buffer, or C times into the owner's copy), so either setting resumes either
            if self.mean_error is not None:
                self.mean_error.zero_()
            if "mean_error" in state:
                error, start = state["mean_error"].to(self.device), int(state["mean_error_start"])
                if self.mean_error is not None and start == self.mean_error_start:
                    self.mean_error.copy_(error)
                else:
                    self.flat.data[start:start + error.numel()].add_(error, alpha=int(state["copies"]))

    def load_resharded_state(self, state: Dict[str, Any], shards: Any) -> None:
        """Elastic resume from a checkpoint of ``shards.world`` ranks (collective).

        The consensus x and the step are replicated (re-padded for this run's partitions). Every
        new rank takes y = mean_i y_i and m = mean_i m_i over the old ranks: the average model
        x + mean_i d_i, the one validated and saved, is unchanged, and the drift left to average
        in is the mean drift on every rank. The pending mask (k per old partition) is re-selected
        from |y - x| on this run's partitions and all-gathered now."""
        if state.get("optimizer") != NAME or "consensus" not in state:
            raise ValueError("this checkpoint was not written by optimizer=sparse_avg (no consensus "
                             "weights); resume it with the optimizer that wrote it")
        old = state.get("layout") or {}
        numel, padded = self.layout.numel, self.layout.padded_numel
        if old.get("numel") != numel:
            raise ValueError(f"sparse_avg checkpoint has {old.get('numel')} parameters, this model has "
                             f"{numel}: resume with the model the run was started with")
        self._check_local_step_scale(state)
        self.masks.wait()
        self.consensus.copy_(repad(state["consensus"], numel, padded))
        # the other replicated buffers follow the coordinates too; the cycle restarts (this run's
        # partitions have another size, so the old position means nothing here)
        for key, buffer in (("outer_velocity", self.outer_velocity), ("consensus_rate", self.consensus_rate),
                            ("last_exchange", self.last_exchange)):
            if buffer is not None:
                if key not in state:
                    raise ValueError(f"this checkpoint has no {key!r}: it was written with other "
                                     f"optimizer.outer_momentum / mask_rule settings; resume with those")
                buffer.copy_(repad(state[key], numel, padded).to(buffer.dtype))
        if self.normalizer is not None:
            self.normalizer.load_state_dict(state, fit=lambda tensor: repad(tensor, numel, padded))
        self.cycle_position = 0
        self.step_count = int(state["step"])
        self.masks.lr_ratio = float(state.get("lr_ratio", 1.0))  # the re-selected mask's density
        self.masks.load_state_dict({})

        def copy_and_momentum(local: Dict[str, Any]) -> Dict[str, torch.Tensor]:
            if "params" not in local or "momentum" not in local:
                raise ValueError("a rank's checkpoint file holds no sparse_avg copy and momentum; "
                                 "it was written by another optimizer")
            if self.accumulated is not None and "accumulated" not in local:
                raise ValueError("a rank's checkpoint file holds no momentum sums: it was written with "
                                 "optimizer.exchange=drift; resume with the exchange that wrote it")
            out = {key: local[key] for key in keys}
            if self.clamp_excess is not None:  # none cut (written with clamp_excess=drop): zeros
                out["clamp_excess"] = local.get("clamp_excess", torch.zeros_like(local["params"]))
            if "mean_error" in local:  # the owner's pending error joins its copy (C times): the
                # mean of the old copies is then the average model, and no error is pending here
                error, start = local["mean_error"], int(local["mean_error_start"])
                out["params"] = out["params"].clone()
                out["params"][start:start + error.numel()].add_(error, alpha=int(local["copies"]))
            return out

        keys = ("params", "momentum") + (("accumulated",) if self.accumulated is not None else ())
        like = {key: torch.empty(old["padded_numel"]) for key in keys}
        if self.clamp_excess is not None:
            like["clamp_excess"] = torch.empty(old["padded_numel"])
        mean = shards.mean(copy_and_momentum, like, self.comm, self.rank, self.world, self.device)
        with torch.no_grad():
            self.flat.data.copy_(repad(mean["params"].cpu(), numel, padded))
            self.optimizer.momentum.copy_(repad(mean["momentum"].cpu(), numel, padded))
            if self.accumulated is not None:
                self.accumulated.copy_(repad(mean["accumulated"].cpu(), numel, padded))
            if self.clamp_excess is not None:
                self.clamp_excess.copy_(repad(mean["clamp_excess"].cpu(), numel, padded))
        following = self.step_count + 1
        if "mask" in state and not self.is_dense(following):
            self._choose_mask(following, async_op=False, overlap=False)
            self.masks.wait()  # hold it now, as a checkpoint's mask is held after loading
