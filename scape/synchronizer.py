"""SCAPE: the gradient synchroniser and optimizer of docs/specs/SCAPE.md, one object.

Per step the loop calls reduce_gradients -> clip_gradients -> step -> after_step:

- reduce_gradients: wait for the mask M_t (all-gathered during the previous step's forward and
  backward), fold the local gradient into the residual (a = e + (1 - b1) g), score this rank's
  partitions for the next mask, gather a[M_t] and clear it from the residual, and run THE one
  all-reduce of the masked values (fp32 or bf16). Dense steps all-reduce the gradient instead.
- clip_gradients: norm and clipping of ghat, which is replicated, so no collective.
- step: the update (lazy on the mask by default) with decoupled weight decay everywhere.
- after_step: exact top-k of this rank's partitions -> M_{t+1}, packed and all-gathered
  asynchronously; the wait happens in the next reduce_gradients.

Replicated state (parameters, momentum, mask, step, staleness) is identical on all ranks by
construction: every rank applies the same ghat to it. The residual is the only per-rank state.
"""
from __future__ import annotations

import math
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist

from scape import kernels, transport
from scape.config import OptimizerConfig
from scape.options import as_dataclass, validate_config
from scape.partition import Partitioning
from scape.residual import DEFAULT_CHUNK_NUMEL, Residual
from scape.timing import StepTimers
from scape.topk import topk_mask
from scape.update import ScapeOptimizer
from trainer import comm
from trainer.grad_sync import FlatParameters, GradientSynchronizer

_TIMERS = ("topk", "pack", "wait")


class _PendingMask:
    """An all-gather of mask parts in flight, and what is needed to decode it."""

    def __init__(self, step: int, work, received: torch.Tensor, send: torch.Tensor, k: int) -> None:
        self.step, self.work, self.received, self.send, self.k = step, work, received, send, k


class ScapeSynchronizer(GradientSynchronizer):
    """SCAPE over one flat fp32 view of the model's trainable parameters.

    ``num_partitions`` defaults to the world size (one partition per rank, as the spec says); a
    multiple of it lets one process emulate the partitioning of a larger job (tests compare a
    single-rank run with a 2-rank one this way, and the benchmarks use it).
    """

    def __init__(self, model: torch.nn.Module, cfg: OptimizerConfig,
                 num_partitions: Optional[int] = None,
                 residual_chunk_numel: int = DEFAULT_CHUNK_NUMEL) -> None:
        cfg = as_dataclass(cfg)
        validate_config(cfg)
        self.cfg = cfg
        initialized = dist.is_available() and dist.is_initialized()
        self.world = dist.get_world_size() if initialized else 1
        self.rank = dist.get_rank() if initialized else 0
        self.beta1, self.beta2 = float(cfg.betas[0]), float(cfg.betas[1])
        self.density = round(1.0 - float(cfg.sparsity), 12)

        params = [p for p in model.parameters() if p.requires_grad]
        if not params:
            raise ValueError("SCAPE needs at least one trainable parameter")
        decay = [p for p in params if p.ndim >= 2]
        ordered = decay + [p for p in params if p.ndim < 2]  # decay range = one prefix
        self.layout = Partitioning(sum(p.numel() for p in params),
                                   num_partitions or self.world, self.world, self.rank)
        self.flat = FlatParameters(ordered, pad_to=self.layout.pad_multiple)
        assert self.flat.padded_numel == self.layout.padded_numel
        self.device = self.flat.data.device
        cap = float(cfg.stale_scale_cap) or 1.0 / self.density  # 0: one partition's refresh period
        optimizer = ScapeOptimizer(self.flat.data, sum(p.numel() for p in decay), cfg.lr, cfg.betas,
                                   cfg.eps, cfg.weight_decay, cfg.base, cfg.stale_scale, cap)
        super().__init__(model, optimizer)
        self.residual = Residual(self.layout.padded_numel, self.device, cfg.offload_residual,
                                 residual_chunk_numel)
        self.score = torch.zeros(self.layout.owned_numel, dtype=torch.float32, device=self.device)
        self.value_dtype = torch.bfloat16 if cfg.value_dtype == "bf16" else torch.float32
        self.timers = StepTimers(self.device)

        self.step_count = 0  # steps completed
        self.mask: Optional[torch.Tensor] = None  # ascending flat indices, k per partition
        self.mask_step = 0  # the step the mask is for
        self.mask_k = 0
        self._pending: Optional[_PendingMask] = None
        self._ghat: Optional[torch.Tensor] = None  # ghat on the mask (or dense), after clipping
        self._sent_local: Optional[torch.Tensor] = None  # this rank's payload, for a rollback
        self._dense = True
        self._overlap: Optional[torch.Tensor] = None

    # --- schedule ----------------------------------------------------------------------------
    def is_dense(self, step: int) -> bool:
        return step <= self.cfg.dense_warmup_steps

    def density_at(self, step: int) -> float:
        """Geometric decay from 1 to rho over the first sparsity_warmup_steps steps (DGC)."""
        warmup = self.cfg.sparsity_warmup_steps
        if warmup > 0 and step < warmup:
            return self.density ** (step / warmup)
        return self.density

    def k_at(self, step: int) -> int:
        return self.layout.k(self.density_at(step))

    def transport_at(self, step: int) -> str:
        return transport.resolve(self.cfg.mask_transport, self.layout.partition_size,
                                 self.k_at(step))

    # --- the loop's calls --------------------------------------------------------------------
    def zero_grad(self) -> None:
        self.flat.zero_grad()

    @torch.no_grad()
    def reduce_gradients(self) -> None:
        step = self.step_count + 1
        grad = self.flat.grad
        self.timers.start_step()
        self._dense = self.is_dense(step)
        pre_send = self.cfg.score_timing == "pre_send"
        if self._dense:
            if self.cfg.lag and pre_send and not self.is_dense(step + 1):
                self._score_dense_step(grad)
            comm.all_reduce(grad, kind="grad_allreduce")
            if self.world > 1:
                grad.div_(self.world)
            self._ghat = grad
            return
        k = self.k_at(step)
        if self.cfg.lag:
            mask = self._mask_for(step)
            values = torch.empty(mask.numel(), dtype=self.value_dtype, device=self.device)
            self._contribute(grad, accumulate=True, score=pre_send, mask=mask, values=values)
        else:  # ablation: this step's own mask, exchanged on the critical path
            self._contribute(grad, accumulate=True, score=True, mask=None, values=None)
            self._exchange_mask(step, k, async_op=False)
            mask = self._mask_for(step)
            values = torch.empty(mask.numel(), dtype=self.value_dtype, device=self.device)
            self._contribute(grad, accumulate=False, score=False, mask=mask, values=values)
        self._sent_local = values.clone()
        comm.all_reduce(values, kind="scape_values")
        # ghat = mean_i(b_i) / (1 - b1): one division folds both
        self._ghat = values.float().div_(self.world * (1.0 - self.beta1))

    @torch.no_grad()
    def clip_gradients(self, max_norm: float) -> float:
        """Pre-clip L2 norm of ghat; replicated on every rank, so no collective is needed."""
        norm = torch.linalg.vector_norm(self._ghat)
        factor = torch.clamp(max_norm / (norm + 1e-6), max=1.0) if max_norm > 0 else None
        if factor is not None:
            self._ghat.mul_(factor)
        value = float(norm)
        if not math.isfinite(value) and not self._dense:
            self._rollback()  # the loop skips this step: put the contribution back
        elif self.cfg.lossless_clip and factor is not None and not self._dense and float(factor) < 1.0:
            self._return_clipped(1.0 - float(factor))
        return value

    @torch.no_grad()
    def step(self, lr: float) -> None:
        step = self.step_count + 1
        if self._dense:
            self.optimizer.dense_update(self._ghat, lr, step)
        elif self.cfg.update == "lazy":
            self.optimizer.masked_update(self.mask, self._ghat, lr, step)
        else:
            full = torch.zeros_like(self.flat.data)
            kernels.scatter(full, self.mask, self._ghat)
            self.optimizer.dense_update(full, lr, step, all_sent=False)
        self.step_count = step
        self._ghat = self._sent_local = None

    @torch.no_grad()
    def after_step(self) -> None:
        following = self.step_count + 1
        self._overlap = None
        if self.cfg.lag and not self.is_dense(following):
            if self.cfg.score_timing == "post_step":
                self._score_residual()
            self._exchange_mask(following, self.k_at(following), async_op=True)

    # --- the pieces --------------------------------------------------------------------------
    def _write_score(self, lo: int, hi: int, contribution: torch.Tensor) -> None:
        """score[j] = |b1 m_j + a_j| (or |a_j|) for owned j in [lo, hi); ``contribution`` = a[lo:hi]."""
        own_lo = self.layout.owned_start
        start, stop = max(lo, own_lo), min(hi, own_lo + self.layout.owned_numel)
        if start >= stop:
            return
        a = contribution[start - lo:stop - lo]
        out = self.score[start - own_lo:stop - own_lo]
        if self.cfg.score == "moment":
            torch.add(a, self.optimizer.momentum[start:stop], alpha=self.beta1, out=out)
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
        longer hold."""
        own_lo, own_hi = self.layout.owned_start, self.layout.owned_start + self.layout.owned_numel
        for lo, hi, residual in self.residual.chunks():
            if lo < own_hi and hi > own_lo:
                self._write_score(lo, hi, residual)

    def _return_clipped(self, fraction: float) -> None:
        """Lossless clipping: ``fraction`` of what this rank sent goes back into its residual, so
        the part of ghat that clipping removed is delayed, not dropped (sent + residual is still
        the whole contribution)."""
        self._add_at_mask(self._sent_local.float().mul_(fraction))

    def _add_at_mask(self, values: torch.Tensor) -> None:
        """e[M_t] += values (``values`` in mask order)."""
        for lo, _, residual, first, last in self._mask_chunks():
            residual.index_add_(0, self.mask[first:last] - lo, values[first:last])

    def _mask_chunks(self):
        """Each residual chunk (lo, hi, view) with the slice [first, last) of M_t that falls in it."""
        bounds = self.residual.bounds()
        edges = torch.tensor([lo for lo, _ in bounds] + [bounds[-1][1]], device=self.mask.device)
        positions = torch.searchsorted(self.mask, edges).tolist()
        for chunk, (lo, hi, residual) in enumerate(self.residual.chunks()):
            yield lo, hi, residual, positions[chunk], positions[chunk + 1]

    def _contribute(self, grad: torch.Tensor, accumulate: bool, score: bool,
                    mask: Optional[torch.Tensor], values: Optional[torch.Tensor]) -> None:
        """One pass over the residual: e += (1 - b1) g, score, values = e[mask], e[mask] = 0."""
        bounds = self.residual.bounds()
        positions: List[int] = []
        if mask is not None and len(bounds) > 1:
            edges = torch.tensor([lo for lo, _ in bounds] + [bounds[-1][1]], device=mask.device)
            positions = torch.searchsorted(mask, edges).tolist()
        for chunk, (lo, hi, residual) in enumerate(self.residual.chunks()):
            if accumulate:
                residual.add_(grad[lo:hi], alpha=1.0 - self.beta1)
            if score:
                self._write_score(lo, hi, residual)
            if mask is not None:
                first, last = (positions[chunk], positions[chunk + 1]) if positions \
                    else (0, mask.numel())
                local = mask[first:last] - lo if lo else mask[first:last]
                kernels.gather_and_clear(residual, local, values[first:last])

    def _rollback(self) -> None:
        """Undo this step's residual change (a skipped, non-finite step); non-finite entries -> 0."""
        grad, mask, sent = self.flat.grad, self.mask, self._sent_local.float()
        for lo, hi, residual, first, last in self._mask_chunks():
            residual.index_add_(0, mask[first:last] - lo, sent[first:last])
            residual.sub_(grad[lo:hi], alpha=1.0 - self.beta1)
            torch.nan_to_num_(residual, nan=0.0, posinf=0.0, neginf=0.0)

    def _select(self, k: int) -> torch.Tensor:
        """This rank's part of the next mask: a bool mask over its region, k per partition."""
        size = self.layout.partition_size
        chosen = torch.empty(self.layout.owned_numel, dtype=torch.bool, device=self.device)
        with self.timers.time("topk"):
            for p in range(self.layout.partitions_per_rank):
                topk_mask(self.score[p * size:(p + 1) * size], k, chosen[p * size:(p + 1) * size])
        return chosen

    def _exchange_mask(self, step: int, k: int, async_op: bool) -> None:
        chosen = self._select(k)
        self._overlap = self._own_overlap(chosen, k)
        name = self.transport_at(step)
        with self.timers.time("pack"):
            send = transport.encode(name, chosen, self.layout.partitions_per_rank,
                                    self.layout.partition_size, k)
        received = transport.receive_buffer(name, self.layout.num_partitions,
                                            self.layout.partition_size, k, self.device)
        work = comm.all_gather_into_tensor(received, send, kind="scape_mask", async_op=async_op)
        self._pending = _PendingMask(step, work, received, send, k)

    def _own_overlap(self, chosen: torch.Tensor, k: int) -> Optional[torch.Tensor]:
        """|M_t & M_{t+1}| / k over this rank's partitions (the owner knows both)."""
        if self.mask is None:
            return None
        per_rank = self.layout.partitions_per_rank
        own = self.mask[self.rank * per_rank * self.mask_k:(self.rank + 1) * per_rank * self.mask_k]
        kept = chosen.index_select(0, own - self.layout.owned_start).sum()
        return kept / float(per_rank * max(k, self.mask_k))

    def _wait_pending(self) -> None:
        pending, self._pending = self._pending, None
        if pending is None:
            return
        with self.timers.time("wait"):
            if pending.work is not None:
                try:
                    pending.work.wait()
                except (RuntimeError, dist.DistError) as exc:
                    error = getattr(comm, "CollectiveError", RuntimeError)
                    raise error(f"rank {self.rank}: waiting for the SCAPE mask all-gather of step "
                                f"{pending.step} ('scape_mask') failed: {exc}. A peer process "
                                f"probably died or hangs; resume with resume=auto.") from exc
        with self.timers.time("pack"):
            self.mask = transport.decode(self.transport_at(pending.step), pending.received,
                                         self.layout.num_partitions, self.layout.partition_size,
                                         pending.k)
        self.mask_step, self.mask_k = pending.step, pending.k

    def _mask_for(self, step: int) -> torch.Tensor:
        self._wait_pending()
        if self.mask is None or self.mask_step != step:
            raise RuntimeError(f"SCAPE has no mask for step {step} (it holds one for step "
                               f"{self.mask_step}); after_step() must run after every step")
        return self.mask

    # --- metrics -----------------------------------------------------------------------------
    def metrics(self) -> Dict[str, float]:
        dense = self._dense
        sent = self.layout.padded_numel if dense else self.layout.num_partitions * self.mask_k
        out = {"scape/density": sent / self.layout.padded_numel,
               "scape/dense_step": float(dense),
               "scape/residual_norm": self.residual.norm()}
        if self._overlap is not None:
            out["scape/mask_overlap"] = float(self._overlap)
        times = self.timers.collect(_TIMERS)
        out.update({f"scape/time_{name}_s": seconds for name, seconds in times.items()})
        return out

    # --- checkpoints -------------------------------------------------------------------------
    def _layout_record(self) -> Dict[str, int]:
        return {"numel": self.layout.numel, "padded_numel": self.layout.padded_numel,
                "num_partitions": self.layout.num_partitions, "world": self.world}

    def state_dict(self) -> Dict[str, Any]:
        """Replicated state at a step boundary; waits for the in-flight mask all-gather."""
        self._wait_pending()
        state: Dict[str, Any] = {"step": self.step_count, "layout": self._layout_record(),
                                 "optimizer": self.optimizer.state_dict()}
        if self.mask is not None and self.mask_step == self.step_count + 1:
            marks = torch.zeros(self.layout.padded_numel, dtype=torch.bool, device=self.device)
            marks[self.mask] = True
            packed = torch.empty(self.layout.padded_numel // 8, dtype=torch.uint8,
                                 device=self.device)
            state["mask"] = {"bitmap": kernels.pack_bits(marks, packed).cpu(), "k": self.mask_k,
                             "step": self.mask_step}
        return state

    def _check_layout(self, record: Dict[str, int]) -> None:
        mine = self._layout_record()
        for key in ("numel", "padded_numel", "num_partitions"):
            if record.get(key) != mine[key]:
                raise ValueError(f"SCAPE checkpoint layout {key}={record.get(key)} does not match this "
                                 f"run's {mine[key]}: resume with the same model and world size")

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self._check_layout(state["layout"])
        self._wait_pending()
        self.optimizer.load_state_dict(state["optimizer"])
        self.step_count = int(state["step"])
        self.mask, self.mask_step, self.mask_k = None, 0, 0
        if "mask" in state:
            bitmap = state["mask"]["bitmap"].to(self.device)
            marks = kernels.unpack_bits(bitmap, torch.empty(bitmap.numel() * 8, dtype=torch.bool,
                                                            device=self.device))
            self.mask = torch.nonzero(marks).squeeze(1)
            self.mask_step, self.mask_k = int(state["mask"]["step"]), int(state["mask"]["k"])

    def local_state_dict(self) -> Dict[str, Any]:
        return {"residual": self.residual.cpu_copy(), "rank": self.rank,
                "layout": self._layout_record()}

    def load_local_state_dict(self, state: Dict[str, Any]) -> None:
        self._check_layout(state["layout"])
        if int(state["rank"]) != self.rank:
            raise ValueError(f"SCAPE residual of rank {state['rank']} loaded on rank {self.rank}")
        self.residual.load(state["residual"])
