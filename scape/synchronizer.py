"""SCAPE: the gradient synchroniser and optimizer of docs/specs/SCAPE.md, one object.

Per step the loop calls reduce_gradients -> clip_gradients -> step(lr, skip) -> after_step:

- reduce_gradients: wait for the mask M_t (all-gathered during the previous step's forward and
  backward), gather this rank's contribution a[M_t] = e[M_t] + (1 - b1) g[M_t] without changing
  the residual, and run THE one all-reduce of the masked values (fp32 or bf16). Dense steps
  all-reduce the gradient instead. With ``overlap_backward`` (scape/overlap.py) that all-reduce
  was already started, bucket by bucket, during the last micro-batch's backward; here it is
  waited for.
- clip_gradients: norm and clipping of ghat, which is replicated, so no collective; the norm
  stays on the device.
- step: ``skip`` (non-finite loss or norm, a device flag alike on every rank) is read here, the
  step's one host read: a skipped step changes nothing (the residual was not touched yet), so
  the retry uses the same mask; SCAPE's step count, schedule and bias correction are host
  numbers, as dense AdamS's are. Otherwise one pass over the residual folds the gradient in
  (a = e + (1 - b1) g), clears the sent coordinates and writes the score of this rank's
  partitions, and the update (lazy on the mask by default) runs with decoupled weight decay
  everywhere (the post-step score reads the updated momentum: the update runs first).
- after_step: top-k (``topk_method``) of this rank's partitions -> M_{t+1}, packed and all-gathered
  asynchronously; the wait happens in the next reduce_gradients.

Where the host must know how the mask falls on the flat buffer (the bucket slices of the
overlapped all-reduce, an offloaded residual's chunks), it reads that once per mask
(``MaskExchange.host_view``), at the first bucket or the reduction, never per bucket.

Replicated state (parameters, momentum, mask, step, staleness) is identical on all ranks by
construction: every rank applies the same ghat to it. The residual is the only per-rank state.
"""
from __future__ import annotations

import contextlib
import math
from typing import Any, ContextManager, Dict, List, Optional

import torch

from core.checkpoint import repad
from core.comm import Collectives
from core.optim import embedding_lr_scale, group_parameter_ids
from scape import kernels
from scape.config import OptimizerConfig
from scape.masking import MaskedSynchronizer
from scape.options import SPARSE_AVG_ONLY_KEYS, as_dataclass, refuse_foreign_keys, validate_config
from scape.overlap import BUCKET_NUMEL, OverlappedValues
from scape.residual import DEFAULT_CHUNK_NUMEL, Residual
from scape.update import ScapeOptimizer


class ScapeSynchronizer(MaskedSynchronizer):
    """SCAPE over one flat fp32 view of the model's trainable parameters.

    ``num_partitions`` defaults to the world size (one partition per rank, as the spec says); a
    multiple of it lets one process emulate the partitioning of a larger job (tests compare a
    single-rank run with a 2-rank one this way, and the benchmarks use it).
    """

    # a parameter group's lr_scale (optimizer.param_groups): the embedding tables' coordinates
    # train at k lr (False where a subclass's state does not cover the whole model: the sharded
    # optimizer, SDP's groups)
    TABLE_LR_SCALE = True

    def __init__(self, model: torch.nn.Module, cfg: OptimizerConfig,
                 num_partitions: Optional[int] = None,
                 residual_chunk_numel: int = DEFAULT_CHUNK_NUMEL, comm: Optional[Collectives] = None,
                 overlap_bucket_numel: int = BUCKET_NUMEL) -> None:
        cfg = as_dataclass(cfg)
        # a sparse_avg key is refused by name first: its own checks would ask for sparse_avg settings
        refuse_foreign_keys(cfg, SPARSE_AVG_ONLY_KEYS, "a sparse_avg", "scape")
        self.table_lr_scale = embedding_lr_scale(cfg)
        if self.table_lr_scale != 1 and not self.TABLE_LR_SCALE:
            raise ValueError(f"optimizer.param_groups[0].lr_scale={self.table_lr_scale:g} is not supported with "
                             f"optimizer.shard=true or SDP (their optimizer state does not hold whole tables): "
                             f"leave it 1")
        validate_config(cfg)
        self.cfg = cfg
        self.beta1, self.beta2 = float(cfg.betas[0]), float(cfg.betas[1])
        decay_numel = self._flatten(model, "SCAPE", num_partitions, comm)
        self.table_ranges = self._table_ranges(model) if self.table_lr_scale != 1 else []
        # stale_scale_cap 0: one partition's refresh period
        cap = float(cfg.stale_scale_cap) or 1.0 / self.masks.density
        super().__init__(model, self._build_optimizer(decay_numel, cap), self.comm)
        self.residual = Residual(self.layout.padded_numel, self.device, cfg.offload_residual,
                                 residual_chunk_numel)
        self.value_dtype = torch.bfloat16 if cfg.value_dtype == "bf16" else torch.float32

        self.step_count = 0  # steps completed
        self._ghat: Optional[torch.Tensor] = None  # ghat on the mask (or dense), after clipping
        self._sent_local: Optional[torch.Tensor] = None  # this rank's payload, for a rollback
        self._dense = True
        self._folded = False  # this step's gradient is in the residual already (lag=false)
        self._skipped = False  # step() skipped: after_step leaves the mask for the retry
        self._scored = False  # step() wrote the post-step score in its residual pass
        self._residual_at_mask: Optional[torch.Tensor] = None  # e[M_t], gathered once a step
        self.backward_overlap: Optional[OverlappedValues] = None
        edges = [lo for lo, _ in self.residual.bounds()] + [self.layout.padded_numel]
        if cfg.overlap_backward and cfg.lag:
            self.backward_overlap = OverlappedValues(
                self.flat.params, self.flat.offsets, self.layout.padded_numel, self.params,
                self.comm, self._pack_contribution, overlap_bucket_numel, self.rank)
            edges += self.backward_overlap.edges()
        self.masks.set_edges(edges)
        self.masks.host_mask = self.residual.offload

    # --- the loop's calls --------------------------------------------------------------------
    def zero_grad(self) -> None:
        if self.backward_overlap is not None and self.backward_overlap.active:
            self.backward_overlap.wait()  # a skipped step: its payload is dropped, no state changed
        self._residual_at_mask = None
        self.flat.zero_grad()

    def micro_batch_context(self, last: bool) -> ContextManager:
        step = self.step_count + 1
        if not (last and self.backward_overlap is not None and not self.is_dense(step)):
            return contextlib.nullcontext()
        return self._overlapped_backward(step)

    @contextlib.contextmanager
    def _overlapped_backward(self, step: int):
        self.masks.start_step()  # the mask wait is timed in here now
        overlap = self.backward_overlap
        overlap.arm(lambda: self._mask_and_positions(step), self.value_dtype, self.device)
        try:
            yield
        except BaseException:
            overlap.disarm()
            raise
        with torch.no_grad():
            overlap.finish_backward()

    def _mask_and_positions(self, step: int):
        """M_t and {flat offset: mask entries below it} for the registered edges (one host read)."""
        mask = self.masks.mask_for(step)
        return mask, self.masks.host_view()[0]

    @torch.no_grad()
    def _pack_contribution(self, first: int, last: int, out: torch.Tensor) -> None:
        """out = a[M_t[first:last]] = e + (1 - b1) g there (cast to the payload's dtype), with the
        same arithmetic as the residual fold, and without changing the residual."""
        if self._residual_at_mask is None:  # an offloaded residual is gathered on the host, once
            host_mask = self.masks.host_view()[1] if self.residual.offload else None
            self._residual_at_mask = self.residual.gather(self.masks.mask, host_mask)
        indices = self.masks.mask[first:last]
        out.copy_(torch.add(self._residual_at_mask[first:last], self.flat.grad.index_select(0, indices),
                            alpha=1.0 - self.beta1))

    @torch.no_grad()
    def reduce_gradients(self) -> None:
        step = self.step_count + 1
        grad = self.flat.grad
        overlapped = self.backward_overlap is not None and self.backward_overlap.active
        if not overlapped:
            self.masks.start_step()
        self._dense = self.is_dense(step)
        pre_send = self.cfg.score_timing == "pre_send"
        if self._dense:
            if self.cfg.lag and pre_send and not self.is_dense(step + 1):
                self._score_dense_step(grad)
            self._ghat = self._reduce_dense(grad)
            return
        k = self.k_at(step)
        self._folded = False
        if overlapped:  # the payload was packed and its all-reduce started during backward
            self.masks.mask_for(step)
            summed = self.backward_overlap.wait()
            self._ghat = summed.float().div_(self.world * (1.0 - self.beta1))
            return
        if self.cfg.lag:
            mask = self.masks.mask_for(step)
            values = torch.empty(mask.numel(), dtype=self.value_dtype, device=self.device)
            self._pack_contribution(0, mask.numel(), values)
            self._ghat = self._reduce_values(values)
            return
        # ablation: this step's own mask, exchanged on the critical path (folded here, rolled
        # back on a skip, with host reads: not the default path)
        self._folded = True
        self._contribute(grad, accumulate=True, score=True, mask=None, values=None)
        self.masks.exchange(step, k, async_op=False)
        mask = self.masks.mask_for(step)
        values = torch.empty(mask.numel(), dtype=self.value_dtype, device=self.device)
        self._contribute(grad, accumulate=False, score=False, mask=mask, values=values)
        self._sent_local = values.clone()
        self._ghat = self._reduce_values(values)

    @torch.no_grad()
    def clip_gradients(self, max_norm: float) -> torch.Tensor:
        """Pre-clip L2 norm of ghat, on the device; replicated on every rank, so no collective is
        needed (sharded SCAPE, whose ranks each hold their owned part of ghat, sums it in
        ``_ghat_norm``)."""
        norm = self._ghat_norm()
        if max_norm > 0:
            self._ghat.mul_(torch.clamp(max_norm / (norm + 1e-6), max=1.0))
        if self._folded and not self._dense and not math.isfinite(float(norm)):
            self._rollback()  # lag=false folded already: put the contribution back
            self._folded = False
        return norm

    @torch.no_grad()
    def step(self, lr: float, skip: Optional[torch.Tensor] = None) -> None:
        step = self.step_count + 1
        self._skipped = self._skips(skip)
        if self._skipped:  # nothing was changed but the lag=false ablation's residual
            if self._folded:
                self._rollback()
            self._ghat = self._sent_local = self._residual_at_mask = None
            self._folded = False
            return
        pre_send = self.cfg.score_timing == "pre_send"
        if not self._dense and not self._folded and pre_send:
            self._fold_sent(score=True)  # the pre-send score reads the momentum before the update
        if self._dense:
            self.optimizer.dense_update(self._ghat, lr, step)
        elif self.cfg.update == "lazy":
            self.optimizer.masked_update(self.mask, self._ghat, lr, step)
        else:
            full = torch.zeros_like(self.flat.data)
            kernels.scatter(full, self.mask, self._ghat)
            self.optimizer.dense_update(full, lr, step, all_sent=False)
        if not self._dense and not self._folded and not pre_send:
            self._fold_sent(score=self.cfg.lag and not self.is_dense(step + 1))
        self.step_count = step
        self._ghat = self._sent_local = self._residual_at_mask = None
        self._folded = False

    def _fold_sent(self, score: bool) -> None:
        """The residual pass of a sparse step: e += (1 - b1) g, e[M_t] = what was not sent
        (zero, or a bf16 payload's rounding error), and the score of the owned partitions:
        pre-send |b1 m + a| before the clearing, post-step |b1 m_t + e| after it."""
        self._contribute(self.flat.grad, accumulate=True, score=score, mask=self.mask,
                         values=torch.empty(self.mask.numel(), dtype=self.value_dtype, device=self.device),
                         score_after_clear=self.cfg.score_timing != "pre_send")
        self._scored = score

    @torch.no_grad()
    def after_step(self) -> None:
        if self._retrying():
            return
        following = self.step_count + 1
        self.masks.overlap = None
        if self.cfg.lag and not self.is_dense(following):
            if self.cfg.score_timing == "post_step" and not self._scored:
                self._score_residual()
            self.masks.exchange(following, self.k_at(following), async_op=True)
        self._scored = False

    # --- the pieces (scape/sharded.py overrides the first five: its state covers one shard) --
    def _table_ranges(self, model: torch.nn.Module) -> list:
        """``[start, end)`` in the flat buffer of each parameter the group matches (the
        ``torch.nn.Embedding`` weights; one that matches none is refused)."""
        return self.flat.ranges(group_parameter_ids(model, self.cfg))

    def _build_optimizer(self, decay_numel: int, cap: float) -> ScapeOptimizer:
        cfg = self.cfg
        return ScapeOptimizer(self.flat.data, decay_numel, cfg.lr, cfg.betas, cfg.eps,
                              cfg.weight_decay, cfg.base, cfg.stale_scale, cap,
                              self.table_ranges, self.table_lr_scale)

    def _reduce_dense(self, grad: torch.Tensor) -> torch.Tensor:
        """ghat of a dense step: the mean gradient."""
        self.comm.all_reduce(grad, kind="grad_allreduce")
        if self.world > 1:
            grad.div_(self.world)
        return grad

    def _reduce_values(self, values: torch.Tensor) -> torch.Tensor:
        """ghat on the mask from this rank's masked contribution: THE one all-reduce."""
        self.comm.all_reduce(values, kind="scape_values")
        # ghat = mean_i(b_i) / (1 - b1): one division folds both
        return values.float().div_(self.world * (1.0 - self.beta1))

    def _ghat_norm(self) -> torch.Tensor:
        return torch.linalg.vector_norm(self._ghat)

    def _momentum(self, start: int, stop: int) -> torch.Tensor:
        """The momentum of flat coordinates [start, stop) (inside this rank's owned region)."""
        return self.optimizer.momentum[start:stop]

    def _write_score(self, lo: int, hi: int, contribution: torch.Tensor) -> None:
        """score[j] = |b1 m_j + a_j| (or |a_j|) for owned j in [lo, hi); ``contribution`` = a[lo:hi]."""
        own_lo = self.layout.owned_start
        start, stop = max(lo, own_lo), min(hi, own_lo + self.layout.owned_numel)
        if start >= stop:
            return
        a = contribution[start - lo:stop - lo]
        out = self.score[start - own_lo:stop - own_lo]
        if self.cfg.score == "moment":
            torch.add(a, self._momentum(start, stop), alpha=self.beta1, out=out)
            out.abs_()
        else:
            torch.abs(a, out=out)

    def _score_dense_step(self, grad: torch.Tensor) -> None:
        """First mask from a dense step: s = b1 m + (1 - b1) g (the residual is still zero)."""
        own = slice(self.layout.owned_start, self.layout.owned_start + self.layout.owned_numel)
        self._write_score(own.start, own.stop, grad[own] * (1.0 - self.beta1))

    def _score_residual(self) -> None:
        """Post-step score |b1 m_t + e| (or |e|): the updated momentum and the residual with this
        step's mask already cleared, so the coordinates just sent do not score on mass they no
        longer hold. Reads the owned region only (offloaded: streamed in, not back out)."""
        own_lo, own_hi = self.layout.owned_start, self.layout.owned_start + self.layout.owned_numel
        for lo, hi, residual in self.residual.chunks(own_lo, own_hi, write_back=False):
            self._write_score(lo, hi, residual)

    def _chunk_slices(self) -> List[tuple]:
        """[first, last) of M_t in each residual chunk: positions the host read once per mask."""
        bounds = self.residual.bounds()
        if len(bounds) == 1:
            return [(0, self.mask.numel())]
        positions = self.masks.host_view()[0]
        return [(positions[lo], positions[hi]) for lo, hi in bounds]

    def _mask_chunks(self):
        """Each residual chunk (lo, hi, view) with the slice [first, last) of M_t that falls in it."""
        slices = self._chunk_slices()
        for chunk, (lo, hi, residual) in enumerate(self.residual.chunks()):
            yield lo, hi, residual, slices[chunk][0], slices[chunk][1]

    def _contribute(self, grad: torch.Tensor, accumulate: bool, score: bool,
                    mask: Optional[torch.Tensor], values: Optional[torch.Tensor],
                    score_after_clear: bool = False) -> None:
        """One pass over the residual: e += (1 - b1) g, score, values = e[mask], e[mask] = 0
        (``score_after_clear``: the score last)."""
        slices = self._chunk_slices() if mask is not None else []
        for chunk, (lo, hi, residual) in enumerate(self.residual.chunks()):
            if accumulate:
                residual.add_(grad[lo:hi], alpha=1.0 - self.beta1)
            if score and not score_after_clear:
                self._write_score(lo, hi, residual)
            if mask is not None:
                first, last = slices[chunk]
                local = mask[first:last] - lo if lo else mask[first:last]
                kernels.gather_and_clear(residual, local, values[first:last])
            if score and score_after_clear:
                self._write_score(lo, hi, residual)

    def _rollback(self) -> None:
        """Undo this step's residual change (a skipped, non-finite step); non-finite entries -> 0."""
        grad, mask, sent = self.flat.grad, self.mask, self._sent_local.float()
        for lo, hi, residual, first, last in self._mask_chunks():
            residual.index_add_(0, mask[first:last] - lo, sent[first:last])
            residual.sub_(grad[lo:hi], alpha=1.0 - self.beta1)
            torch.nan_to_num_(residual, nan=0.0, posinf=0.0, neginf=0.0)

    # --- metrics -----------------------------------------------------------------------------
    def metrics(self) -> Dict[str, float]:
        dense = self._dense
        sent = self.layout.padded_numel if dense else self.layout.num_partitions * self.mask_k
        out = {"scape/density": sent / self.layout.padded_numel,
               "scape/dense_step": float(dense),
               "scape/residual_norm": self.residual.norm()}
        out.update(self.masks.metrics())
        return out

    # --- checkpoints -------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        """Replicated state at a step boundary; waits for the in-flight mask all-gather."""
        self.masks.wait()
        state: Dict[str, Any] = {"step": self.step_count, "layout": self.masks.layout_record(),
                                 "optimizer": self.optimizer.state_dict()}
        state.update(self.masks.state_dict(self.step_count + 1))
        return state

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.masks.check_layout(state["layout"])
        self.masks.wait()
        self.optimizer.load_state_dict(state["optimizer"])
        self.step_count = int(state["step"])
        self.masks.load_state_dict(state)

    def local_state_dict(self) -> Dict[str, Any]:
        return {"residual": self.residual.cpu_copy(), "rank": self.rank,
                "layout": self.masks.layout_record()}

    def load_local_state_dict(self, state: Dict[str, Any]) -> None:
        self.masks.check_layout(state["layout"])
        if int(state["rank"]) != self.rank:
            raise ValueError(f"SCAPE residual of rank {state['rank']} loaded on rank {self.rank}")
        self.residual.load(state["residual"])

    def load_resharded_state(self, state: Dict[str, Any], shards: Any) -> None:
        """Elastic resume from a checkpoint of ``shards.world`` ranks (collective).

        - Replicated state (momentum, second moment, staleness counters, step): the same
          coordinates on any number of ranks (the flat layout pads at the end only), re-padded.
        - Residual: every new rank starts from the mean of the old ranks' residuals. What a sparse
          step delivers is ghat = mean_i (e_i + (1 - b1) g_i)[M] / (1 - b1): the mean of the
          residuals is exactly what the next all-reduce would have added, so none of the delayed
          gradient mass is lost or counted twice (M copies of mean_i e_i average to it again).
        - The pending mask M_{t+1} was k per old partition; it is re-selected for this run's
          partitions from the restored state with the post-step score |b1 m + e| (``score``
          decides |e| or the moment form) and all-gathered now, synchronously.
        """
        old = state.get("layout") or {}
        if old.get("numel") != self.layout.numel:
            raise ValueError(f"SCAPE checkpoint has {old.get('numel')} parameters, this model has "
                             f"{self.layout.numel}: resume with the model the run was started with")
        numel, padded = self.layout.numel, self.layout.padded_numel
        self.masks.wait()
        flat_state = ("momentum", "second_moment", "last_sent")  # one value per flat coordinate
        self.optimizer.load_state_dict({name: repad(t, numel, padded) if name in flat_state else t
                                        for name, t in state["optimizer"].items()})
        self.step_count = int(state["step"])
        self.masks.load_state_dict({})  # the old mask is k per old partition: re-selected below

        def residual_of(local: Dict[str, Any]) -> Dict[str, torch.Tensor]:
            if "residual" not in local or (local.get("layout") or {}).get("numel") != numel:
                raise ValueError("a rank's checkpoint file holds no SCAPE residual for this model; it was "
                                 "written by another optimizer or model")
            return {"residual": local["residual"]}

        like = {"residual": torch.empty(old["padded_numel"])}
        mean = shards.mean(residual_of, like, self.comm, self.rank, self.world, self.device)["residual"]
        self.residual.load(repad(mean.cpu(), numel, padded).to(self.residual.storage.device))
        following = self.step_count + 1
        if "mask" in state and self.cfg.lag and not self.is_dense(following):
            self._score_residual()
            self.masks.exchange(following, self.k_at(following), async_op=False, overlap=False)
            self.masks.wait()  # hold it now, as a checkpoint's mask is held after loading
