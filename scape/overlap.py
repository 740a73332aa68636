"""SCAPE's value all-reduce started during the last backward (``optimizer.overlap_backward``).

With the lagged mask, M_t is known before step t's backward starts, and b_i = a_i[M_t] with
a_i = e_i + (1 - b1) g_i needs only the residual (untouched since the last step) and the final
gradient at the mask's coordinates. So the flat buffer is cut into buckets of whole parameters;
in the last micro-batch, as soon as every parameter of a bucket has its final gradient (a
post-accumulate-grad hook), that bucket's slice of the payload is packed and its all-reduce
started asynchronously. ``reduce_gradients`` then waits and does the rest exactly as the
unoverlapped step does (residual fold, score, clearing the sent coordinates), so the parameters,
momentum and residual are bit-for-bit those of the unoverlapped SCAPE.

The payload is the same buffer, in the same (flat) order, as the one all-reduce of the
unoverlapped step, only issued in slices: the bytes counted under ``scape_values`` are the same,
the number of calls is the number of buckets (the spec's "one all-reduce per step" is one
reduction of one payload, as DDP's bucketed all-reduce is one gradient reduction). With two
ranks the sums are bitwise those of one all-reduce; with more, a ring may add the ranks in
another order per slice, so the results agree to rounding, not bitwise.

Buckets are started in one fixed order on every rank (collectives must match across ranks): the
order in which backward finishes them, estimated from the parameters' registration order
(backward runs it in reverse), as DDP does for its first iteration. A bucket finished early
waits for the ones before it in that order; buckets whose parameters got no gradient are
started when the last backward ends, before any other collective of the step.

A bucket's slice of the payload is where the mask's ascending indices cross its bounds: host
integers, read once per mask with the mask itself (``MaskExchange.host_view``: on CUDA a pinned
copy behind an event, queued when the mask was decoded), so no hook waits for the device.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from core.comm import CollectiveError, Collectives

BUCKET_NUMEL = 1 << 22  # flat coordinates per bucket (16 MiB of fp32 gradient, DDP's order of size)


class _Bucket:
    def __init__(self, lo: int, hi: int, params: List[torch.nn.Parameter]) -> None:
        self.lo, self.hi, self.params = lo, hi, params
        self.first = self.last = 0  # this bucket's slice of the mask / payload
        self.pending = 0  # parameters still without their final gradient this step


class OverlappedValues:
    """Buckets over a flat buffer, and the packing and all-reduce of their payload slices.

    ``params`` and ``offsets`` are the flat buffer's parameters in flat order and their offsets;
    ``registration`` the model's parameters in registration order; ``pack(first, last, out)``
    writes a_i at the mask's entries [first, last) into ``out`` (the synchroniser's contribution,
    computed without changing any state).
    """

    def __init__(self, params: List[torch.nn.Parameter], offsets: List[int], padded_numel: int,
                 registration: List[torch.nn.Parameter], comm: Collectives,
                 pack: Callable[[int, int, torch.Tensor], None],
                 bucket_numel: int = BUCKET_NUMEL, rank: int = 0) -> None:
        self.comm, self.pack, self.rank = comm, pack, rank
        order = {id(p): i for i, p in enumerate(registration)}
        self.buckets: List[_Bucket] = []
        start, members = 0, []
        for index, (param, offset) in enumerate(zip(params, offsets)):
            members.append(param)
            end = offset + param.numel()
            if end - start >= bucket_numel or index == len(params) - 1:
                self.buckets.append(_Bucket(start, padded_numel if index == len(params) - 1 else end,
                                            members))
                start, members = end, []
        # backward finishes a bucket when it reaches the bucket's earliest-registered parameter
        self.launch_order = sorted(range(len(self.buckets)),
                                   key=lambda b: -min(order[id(p)] for p in self.buckets[b].params))
        self._bucket_of: Dict[int, int] = {id(p): b for b, bucket in enumerate(self.buckets)
                                           for p in bucket.params}
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad) for p in params]
        self._armed = False
        self._resolve_mask: Optional[Callable[[], Tuple[torch.Tensor, Dict[int, int]]]] = None
        self._mask: Optional[torch.Tensor] = None
        self.values: Optional[torch.Tensor] = None
        self._next = 0  # position in launch_order of the next bucket to start
        self._works: List = []
        self.active = False  # a payload was (or is being) started this step and not yet consumed

    def edges(self) -> List[int]:
        """The flat offsets whose positions in the mask the buckets' slices need."""
        return [b.lo for b in self.buckets] + [self.buckets[-1].hi]

    # --- one step ----------------------------------------------------------------------------
    def arm(self, resolve_mask: Callable[[], Tuple[torch.Tensor, Dict[int, int]]],
            value_dtype: torch.dtype, device: torch.device) -> None:
        """The last micro-batch begins: start buckets as their gradients become final.
        ``resolve_mask`` returns M_t and the positions of ``edges()`` in it (it may wait for the
        mask all-gather: called at the first finished bucket, so that wait overlaps the forward
        and the first part of backward)."""
        self._resolve_mask, self._dtype, self._device = resolve_mask, value_dtype, device
        self._mask, self.values, self._next, self._works = None, None, 0, []
        for bucket in self.buckets:
            bucket.pending = len(bucket.params)
        self._armed = self.active = True

    def finish_backward(self) -> None:
        """The last backward returned: start every bucket not started yet, in order."""
        if not self._armed:
            return
        self._armed = False
        self._ensure_mask()
        while self._next < len(self.launch_order):
            self._launch(self.launch_order[self._next])
            self._next += 1

    def disarm(self) -> None:
        """The last backward failed: nothing more is started (``wait`` still drains the rest)."""
        self._armed = False

    def wait(self) -> torch.Tensor:
        """Wait for every bucket's all-reduce; the summed payload (mask order)."""
        works, self._works = self._works, []
        for work in works:
            if work is None:
                continue
            try:
                work.wait()
            except (RuntimeError, dist.DistError) as exc:
                raise CollectiveError(
                    f"rank {self.rank}: waiting for the SCAPE value all-reduce started during "
                    f"backward ('scape_values') failed: {exc}. A peer process probably died or "
                    f"hangs; resume with resume=auto.") from exc
        self.active = False
        return self.values

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()

    # --- the hooks ---------------------------------------------------------------------------
    def _on_grad(self, param: torch.nn.Parameter) -> None:
        if not self._armed:
            return
        bucket = self.buckets[self._bucket_of[id(param)]]
        bucket.pending -= 1
        if bucket.pending:
            return
        self._ensure_mask()
        while self._next < len(self.launch_order) and \
                self.buckets[self.launch_order[self._next]].pending == 0:
            self._launch(self.launch_order[self._next])
            self._next += 1

    def _ensure_mask(self) -> None:
        if self._mask is not None:
            return
        mask, positions = self._resolve_mask()
        self._mask = mask
        self.values = torch.empty(mask.numel(), dtype=self._dtype, device=self._device)
        for bucket in self.buckets:
            bucket.first, bucket.last = positions[bucket.lo], positions[bucket.hi]

    def _launch(self, b: int) -> None:
        bucket = self.buckets[b]
        if bucket.last == bucket.first:  # no mask coordinate here (the same on every rank)
            return
        out = self.values[bucket.first:bucket.last]
        self.pack(bucket.first, bucket.last, out)
        self._works.append(self.comm.all_reduce(out, kind="scape_values", async_op=True))
