"""Sparse model averaging (``optimizer.name=sparse_avg``): local AdamS, sparse averaging of drifts.

SCAPE keeps one model on every rank and sends a sparse slice of the gradient statistics; this
optimizer keeps one model *per* rank and sends a sparse slice of how far each model has moved
away from the others. Same bytes per step (k values per partition plus the mask all-gather), the
same number of state buffers, one all-reduce per step on the critical path.

State
    replicated (identical on every rank by construction): the consensus x (flat fp32, padded as
    ``scape.partition.Partitioning`` says), the mask M, the step t.
    per rank: the local copy y_i -- the model's parameters ARE y_i (views into one flat buffer,
    ``trainer.grad_sync.FlatParameters``) -- and the local AdamS momentum m_i. The drift is
    d_i = y_i - x; it is never stored, so a checkpoint holds y_i bit for bit.

One step t, in the loop's order
    reduce_gradients  wait for M_t's all-gather (started in the previous after_step); payload =
                      d_i[M_t] (k values per partition, in flat order) plus one float, this rank's
                      squared local gradient norm; ONE all-reduce (kind scape_values);
                      x[M_t] += mean_i d_i[M_t];  y_i[M_t] = x[M_t]  (d_i = 0 there).
    clip_gradients    every worker is its own optimizer: this rank's gradient is clipped by its
                      own norm. The returned norm is sqrt(mean_i ||g_i||^2), the root mean square
                      of the local norms, from the all-reduced squared norms: every rank gets the
                      same number, so a non-finite step is skipped by all ranks together.
    step              dense AdamS on y_i with the local gradient and the local momentum
                      (``scape.kernels.adams_dense_update``: decoupled weight decay on the
                      ndim >= 2 prefix of the flat layout, exactly dense AdamS's arithmetic).
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

Checkpoints: ``state_dict`` (rank 0) holds x, the step and the pending mask as a bitmap;
``local_state_dict`` (every rank) holds y_i and m_i. The trainer loads the model weights (the
average) first, then these two, so y_i is restored exactly and a resumed run is bit-identical.
"""
from __future__ import annotations

import contextlib
import math
from typing import Any, Dict, Iterator, Optional

import torch
import torch.distributed as dist

from scape import kernels, transport
from scape.accounting import VALUE_BYTES, scape_step_bytes
from scape.config import OptimizerConfig
from scape.options import as_dataclass, validate_config
from scape.partition import Partitioning
from scape.timing import StepTimers
from scape.topk import topk_mask
from trainer import comm
from trainer.comm import all_reduce_bytes
from trainer.grad_sync import FlatParameters, GradientSynchronizer

NAME = "sparse_avg"
# SCAPE keys that have no meaning here: a non-default value is an error, not silently ignored.
SCAPE_ONLY_KEYS = ("offload_residual", "lag", "update", "stale_scale_cap", "stale_scale", "base",
                   "score", "score_timing", "lossless_clip")
_TIMERS = ("topk", "pack", "wait")


def validate_sparse_avg(cfg: OptimizerConfig) -> None:
    """SCAPE's checks of the shared keys, and no SCAPE-only key away from its default."""
    validate_config(cfg)
    fields = OptimizerConfig.__dataclass_fields__
    for key in SCAPE_ONLY_KEYS:
        if key in fields and getattr(cfg, key) != fields[key].default:
            raise ValueError(f"optimizer.{key}={getattr(cfg, key)!r} is a SCAPE option; "
                             f"optimizer=sparse_avg does not use it (leave it at "
                             f"{fields[key].default!r})")


def sparse_avg_step_bytes(numel: int, world: int, sparsity: float, mask_transport: str = "auto",
                          value_dtype: str = "fp32") -> Dict[str, float]:
    """Bytes per rank of a sparse step: SCAPE's formula plus the one norm value in the payload."""
    out = dict(scape_step_bytes(numel, world, sparsity, mask_transport, value_dtype))
    out["values"] += all_reduce_bytes(VALUE_BYTES[value_dtype], world)
    out["total"] = out["values"] + out["mask"]
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


class _PendingMask:
    def __init__(self, step: int, work, received: torch.Tensor, send: torch.Tensor, k: int) -> None:
        self.step, self.work, self.received, self.send, self.k = step, work, received, send, k


class SparseAverageSynchronizer(GradientSynchronizer):
    """Sparse model averaging over one flat fp32 view of the model's trainable parameters."""

    def __init__(self, model: torch.nn.Module, cfg: OptimizerConfig) -> None:
        cfg = as_dataclass(cfg)
        validate_sparse_avg(cfg)
        self.cfg = cfg
        initialized = dist.is_available() and dist.is_initialized()
        self.world = dist.get_world_size() if initialized else 1
        self.rank = dist.get_rank() if initialized else 0
        self.density = round(1.0 - float(cfg.sparsity), 12)

        params = [p for p in model.parameters() if p.requires_grad]
        if not params:
            raise ValueError("sparse_avg needs at least one trainable parameter")
        decay = [p for p in params if p.ndim >= 2]
        ordered = decay + [p for p in params if p.ndim < 2]  # decay range = one prefix
        self.layout = Partitioning(sum(p.numel() for p in params), self.world, self.world, self.rank)
        self.flat = FlatParameters(ordered, pad_to=self.layout.pad_multiple)  # flat.data is y_i
        assert self.flat.padded_numel == self.layout.padded_numel
        self.device = self.flat.data.device
        super().__init__(model, _LocalAdamS(self.flat.data, sum(p.numel() for p in decay), cfg))
        self.consensus = self.flat.data.clone()  # x: every rank seeds identically, so y_i = x
        self.score = torch.zeros(self.layout.owned_numel, dtype=torch.float32, device=self.device)
        self.value_dtype = torch.bfloat16 if cfg.value_dtype == "bf16" else torch.float32
        self.timers = StepTimers(self.device)

        self.step_count = 0  # steps completed
        self.mask: Optional[torch.Tensor] = None  # ascending flat indices, k per partition
        self.mask_step = 0
        self.mask_k = 0
        self._pending: Optional[_PendingMask] = None
        self._local_norm: Optional[torch.Tensor] = None
        self._global_sq: Optional[torch.Tensor] = None  # sum over ranks of ||g_i||^2
        self._sent = 0  # coordinates averaged this step
        self._overlap: Optional[torch.Tensor] = None

    # --- schedule (the same as SCAPE's) --------------------------------------------------------
    def is_dense(self, step: int) -> bool:
        return step <= self.cfg.dense_warmup_steps

    def density_at(self, step: int) -> float:
        warmup = self.cfg.sparsity_warmup_steps
        if warmup > 0 and step < warmup:
            return self.density ** (step / warmup)
        return self.density

    def k_at(self, step: int) -> int:
        return self.layout.k(self.density_at(step))

    def transport_at(self, step: int) -> str:
        return transport.resolve(self.cfg.mask_transport, self.layout.partition_size, self.k_at(step))

    # --- the loop's calls ----------------------------------------------------------------------
    def zero_grad(self) -> None:
        self.flat.zero_grad()

    @torch.no_grad()
    def reduce_gradients(self) -> None:
        step = self.step_count + 1
        self.timers.start_step()
        y, x = self.flat.data, self.consensus
        self._local_norm = torch.linalg.vector_norm(self.flat.grad)
        if step == 1:  # no drift yet (every copy starts at x), no mask: only the norm crosses
            mask, count = None, 0
        elif self.is_dense(step):
            mask, count = None, self.layout.padded_numel
        else:
            mask = self._mask_for(step)
            count = mask.numel()
        payload = torch.empty(count + 1, dtype=self.value_dtype, device=self.device)
        kept = None  # bf16 payload: the rounding error of what was sent, kept in y_i
        if count:
            drift = y - x if mask is None else y.index_select(0, mask) - x.index_select(0, mask)
            payload[:count].copy_(drift)
            if self.value_dtype != torch.float32:
                kept = drift.sub_(payload[:count].float())
        payload[count] = self._local_norm.square()
        comm.all_reduce(payload, kind="scape_values")
        self._global_sq = payload[count].float()
        self._sent = count
        if not count:
            return
        mean = payload[:count].float().div_(self.world)
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

    @torch.no_grad()
    def clip_gradients(self, max_norm: float) -> float:
        """Clip this rank's gradient by its own norm; return the ranks' RMS norm (the same everywhere)."""
        if max_norm > 0:
            self.flat.grad.mul_(torch.clamp(max_norm / (self._local_norm + 1e-6), max=1.0))
        total = float(self._global_sq)
        return math.sqrt(total / self.world) if math.isfinite(total) else total

    @torch.no_grad()
    def step(self, lr: float) -> None:
        step = self.step_count + 1
        self.optimizer.step(self.flat.grad, lr, step)
        self.step_count = step

    @torch.no_grad()
    def after_step(self) -> None:
        following = self.step_count + 1
        self._overlap = None
        if self.is_dense(following):
            return
        own = slice(self.layout.owned_start, self.layout.owned_start + self.layout.owned_numel)
        torch.sub(self.flat.data[own], self.consensus[own], out=self.score).abs_()
        self._exchange_mask(following, self.k_at(following))

    # --- the mask ------------------------------------------------------------------------------
    def _exchange_mask(self, step: int, k: int) -> None:
        size = self.layout.partition_size
        chosen = torch.empty(self.layout.owned_numel, dtype=torch.bool, device=self.device)
        with self.timers.time("topk"):
            for p in range(self.layout.partitions_per_rank):
                topk_mask(self.score[p * size:(p + 1) * size], k, chosen[p * size:(p + 1) * size])
        self._overlap = self._own_overlap(chosen, k)
        name = self.transport_at(step)
        with self.timers.time("pack"):
            send = transport.encode(name, chosen, self.layout.partitions_per_rank, size, k)
        received = transport.receive_buffer(name, self.layout.num_partitions, size, k, self.device)
        work = comm.all_gather_into_tensor(received, send, kind="scape_mask", async_op=True)
        self._pending = _PendingMask(step, work, received, send, k)

    def _own_overlap(self, chosen: torch.Tensor, k: int) -> Optional[torch.Tensor]:
        """|M_t & M_{t+1}| / k over this rank's partitions (the owner knows both)."""
        if self.mask is None or self.mask_step != self.step_count:
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
                    raise comm.CollectiveError(
                        f"rank {self.rank}: waiting for the sparse_avg mask all-gather of step "
                        f"{pending.step} ('scape_mask') failed: {exc}. A peer process probably "
                        f"died or hangs; resume with resume=auto.") from exc
        with self.timers.time("pack"):
            self.mask = transport.decode(self.transport_at(pending.step), pending.received,
                                         self.layout.num_partitions, self.layout.partition_size,
                                         pending.k)
        self.mask_step, self.mask_k = pending.step, pending.k

    def _mask_for(self, step: int) -> torch.Tensor:
        self._wait_pending()
        if self.mask is None or self.mask_step != step:
            raise RuntimeError(f"sparse_avg has no mask for step {step} (it holds one for step "
                               f"{self.mask_step}); after_step() must run after every step")
        return self.mask

    # --- the averaged model --------------------------------------------------------------------
    @torch.no_grad()
    def averaged_weights(self) -> torch.Tensor:
        """x + mean_i d_i as a new flat buffer: one dense all-reduce (kind ``average``), collective."""
        drift = self.flat.data - self.consensus
        comm.all_reduce(drift, kind="average")
        return drift.div_(self.world).add_(self.consensus)

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
        if self._overlap is not None:
            out["scape/mask_overlap"] = float(self._overlap)
        times = self.timers.collect(_TIMERS)
        out.update({f"scape/time_{name}_s": seconds for name, seconds in times.items()})
        return out

    # --- checkpoints ---------------------------------------------------------------------------
    def _layout_record(self) -> Dict[str, int]:
        return {"numel": self.layout.numel, "padded_numel": self.layout.padded_numel,
                "num_partitions": self.layout.num_partitions, "world": self.world}

    def _check_layout(self, record: Optional[Dict[str, int]]) -> None:
        mine = self._layout_record()
        for key in ("numel", "padded_numel", "num_partitions"):
            if (record or {}).get(key) != mine[key]:
                raise ValueError(f"sparse_avg checkpoint layout {key}={(record or {}).get(key)} does "
                                 f"not match this run's {mine[key]}: resume with the same model and "
                                 f"world size")

    def state_dict(self) -> Dict[str, Any]:
        """Replicated state at a step boundary; waits for the in-flight mask all-gather."""
        self._wait_pending()
        state: Dict[str, Any] = {"optimizer": NAME, "step": self.step_count,
                                 "layout": self._layout_record(),
                                 "consensus": self.consensus.detach().cpu().clone()}
        if self.mask is not None and self.mask_step == self.step_count + 1:
            marks = torch.zeros(self.layout.padded_numel, dtype=torch.bool, device=self.device)
            marks[self.mask] = True
            packed = torch.empty(self.layout.padded_numel // 8, dtype=torch.uint8, device=self.device)
            state["mask"] = {"bitmap": kernels.pack_bits(marks, packed).cpu(), "k": self.mask_k,
                             "step": self.mask_step}
        return state

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        if state.get("optimizer") != NAME or "consensus" not in state:
            raise ValueError("this checkpoint was not written by optimizer=sparse_avg (no consensus "
                             "weights); resume it with the optimizer that wrote it")
        self._check_layout(state.get("layout"))
        self._wait_pending()
        self.consensus.copy_(state["consensus"])
        self.step_count = int(state["step"])
        self.mask, self.mask_step, self.mask_k = None, 0, 0
        if "mask" in state:
            bitmap = state["mask"]["bitmap"].to(self.device)
            marks = kernels.unpack_bits(bitmap, torch.empty(bitmap.numel() * 8, dtype=torch.bool,
                                                            device=self.device))
            self.mask = torch.nonzero(marks).squeeze(1)
            self.mask_step, self.mask_k = int(state["mask"]["step"]), int(state["mask"]["k"])

    def local_state_dict(self) -> Dict[str, Any]:
        return {"params": self.flat.data.detach().cpu().clone(),
                "momentum": self.optimizer.momentum.detach().cpu().clone(),
                "rank": self.rank, "layout": self._layout_record()}

    def load_local_state_dict(self, state: Dict[str, Any]) -> None:
        self._check_layout(state.get("layout"))
        if "params" not in state or "momentum" not in state:
            raise ValueError("this rank's checkpoint file holds no sparse_avg copy and momentum; "
                             "it was written by another optimizer")
        if int(state["rank"]) != self.rank:
            raise ValueError(f"sparse_avg state of rank {state['rank']} loaded on rank {self.rank}")
        with torch.no_grad():
            self.flat.data.copy_(state["params"])
            self.optimizer.momentum.copy_(state["momentum"])
