"""Counted collectives: the one place where bytes crossing ranks are measured.

Every collective the trainer makes (dense all-reduce, SCAPE's sparse all-reduce and mask
all-gather, SDP's holder-group all-reduces) goes through a ``Collectives`` object so the per-step
byte counts by kind are complete by construction.

Bytes are "bytes sent per rank" under the bandwidth-optimal ring algorithms (the convention of
nccl-tests' bus bandwidth): an all-reduce of S bytes over N ranks sends 2 (N - 1) / N * S, an
all-gather whose local part is S bytes sends (N - 1) * S, a reduce-scatter of S bytes sends
(N - 1) / N * S (the first half of the ring all-reduce), an all-to-all of an input of S bytes sends
(N - 1) / N * S (every slice but its own), a broadcast of S bytes sends S (pipelined chain). A group
of one rank sends nothing.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Dict, List, Optional, Sequence

import torch
import torch.distributed as dist


def _group_size(group: Optional[dist.ProcessGroup]) -> int:
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


def new_groups(rank_sets: Sequence[Sequence[int]]) -> List[Optional[dist.ProcessGroup]]:
    """One process group per set of ranks, created by every rank in the same order (as torch
    requires, also for the groups a rank is not in); all None outside a process group."""
    if not (dist.is_available() and dist.is_initialized()):
        return [None] * len(rank_sets)
    return [dist.new_group(list(ranks)) for ranks in rank_sets]


def all_reduce_bytes(nbytes: int, world: int) -> float:
    """Bytes one rank sends in a ring all-reduce of ``nbytes``."""
    return 0.0 if world <= 1 else 2.0 * (world - 1) / world * nbytes


def all_gather_bytes(local_nbytes: int, world: int) -> float:
    """Bytes one rank sends in a ring all-gather whose local part is ``local_nbytes``."""
    return 0.0 if world <= 1 else float((world - 1) * local_nbytes)


def reduce_scatter_bytes(nbytes: int, world: int) -> float:
    """Bytes one rank sends in a ring reduce-scatter of an input of ``nbytes``."""
    return 0.0 if world <= 1 else (world - 1) / world * nbytes


def all_to_all_bytes(nbytes: int, world: int) -> float:
    """Bytes one rank sends in an all-to-all of an input of ``nbytes`` (equal slices)."""
    return 0.0 if world <= 1 else (world - 1) / world * nbytes


class CommCounter:
    """Bytes sent by this rank, by kind, since the last ``reset``."""

    def __init__(self) -> None:
        self.bytes: Dict[str, float] = defaultdict(float)
        self.calls: Dict[str, int] = defaultdict(int)

    def add(self, kind: str, nbytes: float) -> None:
        self.bytes[kind] += nbytes
        self.calls[kind] += 1

    def reset(self) -> None:
        self.bytes.clear()
        self.calls.clear()

    def total(self) -> float:
        return float(sum(self.bytes.values()))


class CollectiveError(RuntimeError):
    """A collective failed or timed out; the message names this rank, the operation and the kind."""


def _guarded(op_name: str, kind: str, group, fn):
    """Run a collective and re-raise a failure (a peer gone, a timeout) with rank and operation."""
    try:
        return fn()
    except (RuntimeError, dist.DistError) as exc:  # DistBackendError, gloo/NCCL timeouts
        rank = dist.get_rank() if dist.is_initialized() else 0
        raise CollectiveError(
            f"rank {rank}: {op_name} of '{kind}' over {_group_size(group)} ranks failed: "
            f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}. A peer process probably "
            f"died or hangs; the wait is bounded by train.dist_timeout_s. Resume with resume=auto.") from exc


class Collectives:
    """The collectives one owner makes, each counted on ``counter`` under its kind.

    The Trainer creates one and hands it to the synchroniser it builds, so the per-step counts it
    reads are complete; a synchroniser built on its own (tests, benchmarks) gets a fresh one.
    """

    def __init__(self, counter: Optional[CommCounter] = None,
                 group: Optional[dist.ProcessGroup] = None) -> None:
        self.counter = counter if counter is not None else CommCounter()
        self.group = group  # the default of every call: None = the whole world

    def in_group(self, group: Optional[dist.ProcessGroup]) -> "Collectives":
        """The same counter, with ``group`` as the default group (SDP runs SCAPE inside each
        holder group this way: SCAPE's collectives then stay among that group's ranks)."""
        return Collectives(self.counter, group)

    def world_size(self) -> int:
        """Ranks in the default group (1 outside a process group)."""
        return _group_size(self.group)

    def rank(self) -> int:
        """This process's rank within the default group (0 outside a process group)."""
        if not (dist.is_available() and dist.is_initialized()):
            return 0
        return dist.get_rank(self.group)

    def all_reduce(self, tensor: torch.Tensor, kind: str, op=None, group=None, async_op: bool = False):
        """``dist.all_reduce`` counted under ``kind``; a no-op outside a process group."""
        group = self.group if group is None else group
        world = _group_size(group)
        self.counter.add(kind, all_reduce_bytes(tensor.numel() * tensor.element_size(), world))
        if world <= 1:
            return None
        return _guarded("all_reduce", kind, group, lambda: dist.all_reduce(
            tensor, op=op or dist.ReduceOp.SUM, group=group, async_op=async_op))

    def all_gather_into_tensor(self, output: torch.Tensor, local: torch.Tensor, kind: str, group=None,
                               async_op: bool = False):
        """``dist.all_gather_into_tensor`` counted under ``kind``; a copy outside a process group."""
        group = self.group if group is None else group
        world = _group_size(group)
        self.counter.add(kind, all_gather_bytes(local.numel() * local.element_size(), world))
        if world <= 1:
            output.copy_(local.reshape(output.shape))
            return None
        # all_gather_single is the name from torch 2.12 on; older releases only have the other one.
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return _guarded("all_gather", kind, group, lambda: gather(output, local, group=group, async_op=async_op))

    def reduce_scatter_tensor(self, output: torch.Tensor, tensor: torch.Tensor, kind: str, group=None,
                              async_op: bool = False):
        """``dist.reduce_scatter_tensor`` (sum) counted under ``kind``: rank r receives the sum of
        every rank's r-th slice of ``tensor``; a copy outside a process group."""
        group = self.group if group is None else group
        world = _group_size(group)
        self.counter.add(kind, reduce_scatter_bytes(tensor.numel() * tensor.element_size(), world))
        if world <= 1:
            output.copy_(tensor.reshape(output.shape))
            return None
        # reduce_scatter_single is the name from torch 2.12 on; older releases only have the other one.
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        return _guarded("reduce_scatter", kind, group, lambda: scatter(
            output, tensor, op=dist.ReduceOp.SUM, group=group, async_op=async_op))

    def broadcast(self, tensor: torch.Tensor, src: int, kind: str, group=None, async_op: bool = False):
        """``dist.broadcast`` counted under ``kind`` (only the source sends)."""
        group = self.group if group is None else group
        world = _group_size(group)
        if world <= 1:
            return None
        if dist.get_rank() == src:
            self.counter.add(kind, float(tensor.numel() * tensor.element_size()))
        return _guarded("broadcast", kind, group, lambda: dist.broadcast(tensor, src=src, group=group,
                                                                           async_op=async_op))

    def all_to_all_single(self, output: torch.Tensor, tensor: torch.Tensor, kind: str, group=None):
        """``dist.all_to_all_single`` (equal slices) counted under ``kind``: rank r receives every
        rank's r-th slice of ``tensor``, in rank order; a copy outside a process group."""
        group = self.group if group is None else group
        world = _group_size(group)
        self.counter.add(kind, all_to_all_bytes(tensor.numel() * tensor.element_size(), world))
        if world <= 1:
            output.copy_(tensor.reshape(output.shape))
            return None
        return _guarded("all_to_all", kind, group, lambda: dist.all_to_all_single(output, tensor, group=group))
