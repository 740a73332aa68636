"""The mask that SCAPE and sparse model averaging both send their values on, in one place.

Both optimizers keep a flat fp32 buffer split as ``scape.partition.Partitioning`` says, score
their own partition(s), and on every sparse step send k values per partition at the coordinates
of a mask M_t that every rank knows. ``MaskExchange`` is that mask's whole life:

- the schedule: dense steps 1..W, then the density decaying from 1 to rho (k per partition and
  the transport that is smaller for that k);
- the exchange: top-k of this rank's score per owned partition (``scape.topk``), encoded
  (``scape.transport``) and all-gathered (kind ``scape_mask``), usually asynchronously so that
  the wait lands in the next step's reduce_gradients;
- the mask held (ascending flat indices, k per partition, the step it is for), and how much of
  this rank's part of it the next one keeps (scape/mask_overlap);
- the checkpoint: the pending mask as a bitmap, and the layout it is only valid for;
- what the host must know of the mask (``host_view``): where the owner's fixed flat offsets
  (``set_edges``: bucket and residual chunk bounds) fall in it, and on request a host copy of the
  mask itself (an offloaded residual is gathered on the host). Slicing the mask by bucket needs
  these positions as host integers, so they are read once per mask, never in a backward hook.
  On CUDA the all-gather is decoded on a side stream as soon as it lands and the positions are
  copied to pinned memory behind an event, so the one read per step waits for that small work
  only (it ran during the forward), not for the step's queued compute.

``MaskedSynchronizer`` is the base of both synchronisers: it lays the model's parameters out in
that flat buffer, holds the ``MaskExchange`` as ``self.masks`` and lets the mask's state read as
the synchroniser's own (``sync.mask``, ``sync.k_at``).
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from core.comm import CollectiveError, Collectives
from core.flat import FlatParameters, decays, flat_order
from core.sync import GradientSynchronizer
from scape import kernels, transport
from scape.config import OptimizerConfig
from scape.partition import Partitioning
from scape.timing import StepTimers
from scape.topk import topk_mask

_TIMERS = ("topk", "pack", "wait")


class _PendingMask:
    """An all-gather of mask parts in flight, and what is needed to decode it (on CUDA: the mask
    already decoded on the side stream, ``ready`` recorded after it, and its host view)."""

    def __init__(self, step: int, work, received: torch.Tensor, send: torch.Tensor, k: int) -> None:
        self.step, self.work, self.received, self.send, self.k = step, work, received, send, k
        self.mask: Optional[torch.Tensor] = None
        self.ready = None
        self.view: Optional["_HostView"] = None


class _HostView:
    """The host's copy of what it needs of one mask: the positions of the edges (and the mask).

    On CUDA both are copied into pinned memory behind an event when the mask is decoded; ``read``
    waits for that event only. On the CPU the tensors are the host's already.
    """

    def __init__(self, mask: torch.Tensor, edges: Optional[torch.Tensor], with_mask: bool) -> None:
        positions = torch.searchsorted(mask, edges) if edges is not None else None
        self._positions, self._mask, self._event = positions, mask if with_mask else None, None
        if mask.is_cuda:
            if positions is not None:
                self._positions = torch.empty(positions.shape, dtype=positions.dtype, pin_memory=True)
                self._positions.copy_(positions, non_blocking=True)
            if with_mask:
                self._mask = torch.empty(mask.shape, dtype=mask.dtype, pin_memory=True)
                self._mask.copy_(mask, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        self._read: Optional[Tuple[List[int], Optional[torch.Tensor]]] = None

    def read(self) -> Tuple[List[int], Optional[torch.Tensor]]:
        """(the edges' positions in the mask, the mask on the host or None); the one host read
        of a mask, done on first use."""
        if self._read is None:
            if self._event is not None:
                self._event.synchronize()
            self._read = (self._positions.tolist() if self._positions is not None else [], self._mask)
        return self._read


class MaskExchange:
    """The sparsity schedule, the score, the mask held and the one in flight, and their timers.

    ``owner`` names the optimizer in error messages ("SCAPE", "sparse_avg"); the all-gathers go
    through ``comm``, the synchroniser's collectives.
    """

    def __init__(self, cfg: OptimizerConfig, layout: Partitioning, device: torch.device,
                 owner: str, comm: Collectives) -> None:
        self.cfg, self.layout, self.device, self.owner = cfg, layout, device, owner
        self.comm = comm
        self.timers = StepTimers(device)
        self.density = round(1.0 - float(cfg.sparsity), 12)
        # what the owner ranks its own partition(s) by; written by the synchroniser
        self.score = torch.zeros(layout.owned_numel, dtype=torch.float32, device=device)
        self.mask: Optional[torch.Tensor] = None  # ascending flat indices, k per partition
        self.step = 0  # the step the mask is for
        self.k = 0
        self.overlap: Optional[torch.Tensor] = None
        self._pending: Optional[_PendingMask] = None
        self._topk_scratch: Optional[torch.Tensor] = None  # the threshold method's work buffer
        self._edges: Optional[torch.Tensor] = None  # flat offsets whose mask positions the host needs
        self._edge_index: Dict[int, int] = {}
        self.host_mask = False  # also keep a host copy of each mask (an offloaded residual)
        self._view: Optional[_HostView] = None  # for the mask held
        self._side = torch.cuda.Stream(device) if device.type == "cuda" else None

    # --- schedule ----------------------------------------------------------------------------
    def is_dense(self, step: int) -> bool:
        return step <= self.cfg.dense_warmup_steps

    def density_at(self, step: int) -> float:
        """rho = 1 - sparsity; over the first sparsity_warmup_steps steps the warm-up's geometric
        decay from 1 to rho (DGC). (Sparse averaging plans its own: scape/budget.py.)"""
        warmup = self.cfg.sparsity_warmup_steps
        if warmup > 0 and step < warmup:
            return max(self.density ** (step / warmup), self.density)
        return self.density

    def k_at(self, step: int) -> int:
        return self.layout.k(self.density_at(step))

    def transport_at(self, step: int) -> str:
        return transport.resolve(self.cfg.mask_transport, self.layout.partition_size,
                                 self.k_at(step))

    # --- the exchange ------------------------------------------------------------------------
    def exchange(self, step: int, k: int, async_op: bool, overlap: bool = True) -> None:
        """Select this rank's part of M_step from ``score`` and start its all-gather.

        ``overlap=False`` leaves ``self.overlap`` unset: the caller knows the mask held is not
        the one M_step follows.
        """
        chosen = self._select(k)
        self.overlap = self._own_overlap(chosen, k) if overlap else None
        name = self.transport_at(step)
        with self.timers.time("pack"):
            send = transport.encode(name, chosen, self.layout.partitions_per_rank,
                                    self.layout.partition_size, k)
        received = transport.receive_buffer(name, self.layout.num_partitions,
                                            self.layout.partition_size, k, self.device)
        work = self.comm.all_gather_into_tensor(received, send, kind="scape_mask", async_op=async_op)
        self._pending = _PendingMask(step, work, received, send, k)
        if self._side is not None:
            self._decode_ahead(self._pending)

    def _decode_ahead(self, pending: _PendingMask) -> None:
        """CUDA: the side stream waits for the all-gather, decodes it and queues the host view;
        the compute stream waits for it only where the mask is used (``wait``)."""
        self._side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._side):
            self._wait_work(pending)
            with self.timers.time("pack"):
                pending.mask = self._decode(pending)
            pending.view = _HostView(pending.mask, self._edges, self.host_mask)
            pending.ready = torch.cuda.Event()
            pending.ready.record(self._side)

    def _decode(self, pending: _PendingMask) -> torch.Tensor:
        return transport.decode(self.transport_at(pending.step), pending.received, self.layout.num_partitions,
                                self.layout.partition_size, pending.k)

    def _wait_work(self, pending: _PendingMask) -> None:
        if pending.work is None:
            return
        try:
            pending.work.wait()  # NCCL: the current stream waits, not the host
        except (RuntimeError, dist.DistError) as exc:
            raise CollectiveError(
                f"rank {self.layout.rank}: waiting for the {self.owner} mask all-gather of "
                f"step {pending.step} ('scape_mask') failed: {exc}. A peer process "
                f"probably died or hangs; resume with resume=auto.") from exc
        pending.work = None

    def _select(self, k: int) -> torch.Tensor:
        """This rank's part of the next mask: a bool mask over its region, k per partition
        (``optimizer.topk_method``: both methods choose the same k, see scape/topk.py)."""
        size = self.layout.partition_size
        chosen = torch.empty(self.layout.owned_numel, dtype=torch.bool, device=self.device)
        method = self.cfg.topk_method
        if method == "threshold" and self._topk_scratch is None:
            self._topk_scratch = torch.empty(size, dtype=torch.bool, device=self.device)
        with self.timers.time("topk"):
            for p in range(self.layout.partitions_per_rank):
                topk_mask(self.score[p * size:(p + 1) * size], k, chosen[p * size:(p + 1) * size],
                          method, self._topk_scratch)
        return chosen

    def _own_overlap(self, chosen: torch.Tensor, k: int) -> Optional[torch.Tensor]:
        """|M_t & M_{t+1}| / k over this rank's partitions (the owner knows both)."""
        if self.mask is None:
            return None
        per_rank, rank = self.layout.partitions_per_rank, self.layout.rank
        own = self.mask[rank * per_rank * self.k:(rank + 1) * per_rank * self.k]
        kept = chosen.index_select(0, own - self.layout.owned_start).sum()
        return kept / float(per_rank * max(k, self.k))

    def wait(self) -> None:
        """Finish the all-gather in flight, if any, and hold the mask it carried."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        if pending.ready is not None:  # decoded on the side stream (CUDA)
            stream = torch.cuda.current_stream(self.device)
            stream.wait_event(pending.ready)
            pending.mask.record_stream(stream)
            self.mask, self._view = pending.mask, pending.view
        else:
            with self.timers.time("wait"):
                self._wait_work(pending)
            with self.timers.time("pack"):
                self.mask = self._decode(pending)
            self._view = None
        self.step, self.k = pending.step, pending.k

    def set_edges(self, edges: Sequence[int]) -> None:
        """Flat offsets (e.g. bucket bounds) whose positions in every mask ``host_view`` gives."""
        ordered = sorted(set(int(e) for e in edges))
        self._edge_index = {e: i for i, e in enumerate(ordered)}
        self._edges = torch.tensor(ordered, dtype=torch.int64, device=self.device)
        self._view = None

    def host_view(self) -> Tuple[Dict[int, int], Optional[torch.Tensor]]:
        """For the mask held: {edge: number of mask entries below it} over the ``set_edges``
        offsets, and the mask on the host when ``host_mask`` (else None). The step's one host
        read of the mask (see the module doc); later calls for the same mask are free."""
        if self._view is None:
            self._view = _HostView(self.mask, self._edges, self.host_mask)
        positions, mask = self._view.read()
        return {edge: positions[i] for edge, i in self._edge_index.items()}, mask

    def hold(self, step: int, mask: torch.Tensor, k: int) -> None:
        """Hold a mask every rank computed alike (nothing to exchange): ascending, k per partition."""
        self.wait()
        self.mask, self.step, self.k = mask, step, k
        self._view = None

    def mask_for(self, step: int) -> torch.Tensor:
        self.wait()
        if self.mask is None or self.step != step:
            raise RuntimeError(f"{self.owner} has no mask for step {step} (it holds one for step "
                               f"{self.step}); after_step() must run after every step")
        return self.mask

    # --- metrics -----------------------------------------------------------------------------
    def start_step(self) -> None:
        """Forget the times of earlier steps (the metrics are per step)."""
        self.timers.start_step()

    def metrics(self) -> Dict[str, float]:
        """scape/mask_overlap (when there is one) and this step's scape/time_{topk,pack,wait}_s."""
        out = {} if self.overlap is None else {"scape/mask_overlap": float(self.overlap)}
        times = self.timers.collect(_TIMERS)
        out.update({f"scape/time_{name}_s": seconds for name, seconds in times.items()})
        return out

    # --- checkpoints -------------------------------------------------------------------------
    def layout_record(self) -> Dict[str, int]:
        layout = self.layout
        return {"numel": layout.numel, "padded_numel": layout.padded_numel,
                "num_partitions": layout.num_partitions, "world": layout.world}

    def check_layout(self, record: Optional[Dict[str, int]]) -> None:
        """A checkpoint's mask and flat buffers are only valid for the layout that wrote them."""
        mine = self.layout_record()
        for key in ("numel", "padded_numel", "num_partitions"):
            if (record or {}).get(key) != mine[key]:
                raise ValueError(f"{self.owner} checkpoint layout {key}={(record or {}).get(key)} "
                                 f"does not match this run's {mine[key]}: resume with the same "
                                 f"model and world size")

    def state_dict(self, next_step: int) -> Dict[str, Any]:
        """``{"mask": ...}`` when the mask held is for ``next_step`` (else empty): a bitmap of the
        padded buffer, 1 bit a coordinate. Call ``wait`` first."""
        if self.mask is None or self.step != next_step:
            return {}
        marks = torch.zeros(self.layout.padded_numel, dtype=torch.bool, device=self.device)
        marks[self.mask] = True
        packed = torch.empty(self.layout.padded_numel // 8, dtype=torch.uint8, device=self.device)
        return {"mask": {"bitmap": kernels.pack_bits(marks, packed).cpu(), "k": self.k,
                         "step": self.step}}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """The mask of a synchroniser's ``state`` (none without a "mask" entry); ``wait`` first."""
        self.mask, self.step, self.k, self._view = None, 0, 0, None
        if "mask" in state:
            bitmap = state["mask"]["bitmap"].to(self.device)
            marks = kernels.unpack_bits(bitmap, torch.empty(bitmap.numel() * 8, dtype=torch.bool,
                                                            device=self.device))
            self.mask = torch.nonzero(marks).squeeze(1)
            self.step, self.k = int(state["mask"]["step"]), int(state["mask"]["k"])


class MaskedSynchronizer(GradientSynchronizer):
    """A synchroniser over one flat fp32 buffer whose values travel on the mask ``self.masks``."""

    masks: MaskExchange

    # the loop passes the skip decision to step() and always calls after_step()
    takes_skip_flag = True

    def _skips(self, skip: Optional[torch.Tensor]) -> bool:
        """The step's one host read: whether to skip, after the reduction and the clip are queued;
        False without a flag (SDP's loop skips step() itself)."""
        return skip is not None and bool(skip)

    def _retrying(self) -> bool:
        """In after_step: whether the step was skipped (then the retry uses the mask held)."""
        skipped, self._skipped = self._skipped, False
        return skipped

    def _flatten(self, model: torch.nn.Module, owner: str, num_partitions: Optional[int] = None,
                 comm: Optional[Collectives] = None) -> int:
        """Set comm (the collectives, a fresh counter when none is given: pass ``self.comm`` on to
        the base), world and rank (of comm's group), layout, flat (the parameters become views
        into it), device and masks from ``self.cfg``. Matrices come first, so weight decay covers
        one prefix of the flat buffer; returns that prefix's length."""
        self.comm = comm if comm is not None else Collectives()
        # the ranks of the collectives' group: the world, or an SDP holder group (sdp/groups.py)
        self.world, self.rank = self.comm.world_size(), self.comm.rank()
        params = [p for p in model.parameters() if p.requires_grad]
        if not params:
            raise ValueError(f"{owner} needs at least one trainable parameter")
        ordered = flat_order(params)
        decay = [p for p in ordered if decays(p)]
        self.layout = Partitioning(sum(p.numel() for p in params),
                                   num_partitions or self.world, self.world, self.rank)
        self.flat = FlatParameters(ordered, pad_to=self.layout.pad_multiple)
        assert self.flat.padded_numel == self.layout.padded_numel
        self.device = self.flat.data.device
        self.masks = MaskExchange(self.cfg, self.layout, self.device, owner, self.comm)
        return sum(p.numel() for p in decay)

    @property
    def mask(self) -> Optional[torch.Tensor]:
        return self.masks.mask

    @property
    def mask_step(self) -> int:
        return self.masks.step

    @property
    def mask_k(self) -> int:
        return self.masks.k

    @property
    def score(self) -> torch.Tensor:
        return self.masks.score

    @property
    def _overlap(self) -> Optional[torch.Tensor]:
        return self.masks.overlap

    def is_dense(self, step: int) -> bool:
        return self.masks.is_dense(step)

    def density_at(self, step: int) -> float:
        return self.masks.density_at(step)

    def k_at(self, step: int) -> int:
        return self.masks.k_at(step)

    def transport_at(self, step: int) -> str:
        return self.masks.transport_at(step)

    def _wait_pending(self) -> None:
        self.masks.wait()
