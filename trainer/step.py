"""One optimizer step, written once: the Trainer, the benchmarks and the tests all call it.

nanoGPT's order with the synchroniser as the one place where gradients cross ranks:

    micro-batches: forward (through sync.train_module), backward (loss / accum)
                   each inside sync.micro_batch_context(last=...) (where overlapped comm starts)
                                                      -> perf/time_data_s, perf/time_fwd_bwd_s
    control all-reduce, started asynchronously: mean loss, non-finite flag, stop request, and the
                   squared gradient norms behind the noise scale (trainer/noise_scale.py)
    sync.reduce_gradients()                           -> perf/time_comm_s (with the control wait)
    norm = sync.clip_gradients(max)                   # a non-finite norm skips the update
    sync.step(lr); sync.after_step()                  -> perf/time_opt_s
    sync.zero_grad()

No device-wide synchronisation: the time split is taken with CUDA events on the GPU, and the
step's numbers (losses, norm, flags) stay on the device in one small tensor that is copied to
pinned host memory behind an event at the end of the step. ``StepResult`` reads it on first use,
which waits for this step's end only; the Trainer reads a step's result one step late (when the
GPU is already busy with the next one), and at once only on log steps.

Every rank decides alike whether to skip a non-finite step, from the all-reduced control flag and
the replicated gradient norm. The dense arms, ZeRO-1, SCAPE and sharded SCAPE take that decision
as a device tensor (``sync.takes_skip_flag``): the loop runs the reduction and the clip and passes
the flag to ``sync.step``, which with torch's fused AdamW skips on the device (no host read at
all) and with AdamS or SCAPE reads it once (their bias correction and schedule need the step count
on the host; SCAPE leaves its residual untouched until then, so a skipped step changes nothing).
SDP keeps bookkeeping that a skipped step must not touch, so for it the loop reads the control
flags after the control all-reduce and skips the reduction and the update itself.
"""
from __future__ import annotations

import contextlib
import math
import time
from typing import Callable, ContextManager, Dict, Iterator, List, Optional, Tuple, Union

import torch

from core.comm import Collectives
from core.sync import GradientSynchronizer
from trainer.noise_scale import squared_grad_norm

Batch = Tuple[torch.Tensor, torch.Tensor]
# Observers of the stages ("before_reduce", "after_reduce", "after_step"), for tests.
StageHook = Callable[[str], None]

_FIELDS = ("loss", "local_loss", "grad_norm", "nonfinite", "stop_requested", "grad_sq_small", "grad_sq_big")


class StepClock:
    """Marks of one step's stages: CUDA events on the GPU (recorded on the stream, so nothing
    waits until a time is read), the host clock on the CPU (where every op is synchronous)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.marks: Dict[str, Union[float, "torch.cuda.Event"]] = {}

    def mark(self, name: str) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks[name] = event
        else:
            self.marks[name] = time.perf_counter()

    def seconds(self, start: str, stop: str) -> float:
        """Time from mark ``start`` to mark ``stop`` (waits for ``stop``'s event on CUDA)."""
        if self.cuda:
            self.marks[stop].synchronize()
            return self.marks[start].elapsed_time(self.marks[stop]) / 1e3
        return self.marks[stop] - self.marks[start]


class StepResult:
    """One step's outcome; its numbers are read from the device on first use, then kept.

    loss: mean over ranks and micro-batches; local_loss: this rank's mean; grad_norm: before
    clipping, NaN when the step was skipped before the reduction; nonfinite: the update was
    skipped (non-finite loss or gradient on some rank); stop_requested: some rank asked to stop;
    grad_sq_small / grad_sq_big: the squared gradient norms at the two batch sizes
    ``noise_batch_sizes`` (tokens), means over ranks, for the noise scale (``device_values[5:7]``).
    time_*: seconds (data is the host's time to fetch batches, inside the forward/backward span).
    """

    def __init__(self, values: torch.Tensor, clock: StepClock, time_data: float,
                 batch_sizes: Tuple[float, float] = (0.0, 0.0)) -> None:
        self._clock, self.time_data = clock, time_data
        self.device_values, self.noise_batch_sizes = values, batch_sizes
        self._event = None
        if values.is_cuda:  # behind an event: reading it later waits for this step's end only
            self._host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
            self._host.copy_(values, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = values
        self._values: Optional[List[float]] = None

    def read(self) -> "StepResult":
        """Bring the numbers to the host (waits for this step's end, not for later work)."""
        if self._values is None:
            if self._event is not None:
                self._event.synchronize()
            self._values = self._host.tolist()
        return self

    def _value(self, name: str) -> float:
        return self.read()._values[_FIELDS.index(name)]

    loss = property(lambda self: self._value("loss"))
    local_loss = property(lambda self: self._value("local_loss"))
    grad_norm = property(lambda self: self._value("grad_norm"))
    nonfinite = property(lambda self: self._value("nonfinite") > 0)
    stop_requested = property(lambda self: self._value("stop_requested") > 0)
    time_fwd_bwd = property(lambda self: max(0.0, self._clock.seconds("start", "fwd_bwd") - self.time_data))
    time_comm = property(lambda self: self._clock.seconds("fwd_bwd", "comm"))
    time_opt = property(lambda self: self._clock.seconds("comm", "end"))
    time_step = property(lambda self: self._clock.seconds("start", "end"))


def _scalar(value: Union[float, torch.Tensor], device: torch.device) -> torch.Tensor:
    """A 0-dim float64 tensor on ``device`` without a blocking host-to-device copy."""
    if isinstance(value, torch.Tensor):
        return value.detach().to(torch.float64).reshape(())
    return torch.full((), float(value), dtype=torch.float64, device=device)


class _GradientSizes:
    """The squared gradient norm at two batch sizes, for the noise scale (trainer/noise_scale.py):
    after the first micro-batch (this rank's own) and after the whole backward."""

    def __init__(self, device: torch.device) -> None:
        nan = torch.full((), math.nan, dtype=torch.float64, device=device)
        self.sq_small, self.sq_big, self.b_small, self.b_big = nan, nan, 0.0, 0.0


def _forward_backward(model: torch.nn.Module, sync: GradientSynchronizer, batches: Iterator[Batch], accum: int,
                      device: torch.device, autocast: Callable[[], ContextManager],
                      sizes: _GradientSizes) -> Tuple[torch.Tensor, float]:
    """Accumulate the gradients of ``accum`` micro-batches; their mean loss and the data time."""
    t_data, loss_sum = 0.0, torch.zeros((), device=device)
    for micro in range(accum):
        td = time.perf_counter()
        x, y = next(batches)
        if device.type == "cuda" and not x.is_cuda:  # from pageable memory the copy would wait for the GPU
            x, y = x.pin_memory(), y.pin_memory()
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        t_data += time.perf_counter() - td
        with sync.micro_batch_context(last=micro == accum - 1):
            with autocast():
                loss = model(x, y)
            (loss / accum).backward()
        loss_sum += loss.detach() / accum
        if micro == 0 and accum > 1:  # the gradient holds g_1 / accum here
            sizes.sq_small, sizes.b_small = squared_grad_norm(sync.params, device) * accum ** 2, float(y.numel())
    if accum > 1:  # one micro-batch a step has one batch size: nothing to compare
        sizes.sq_big = squared_grad_norm(sync.params, device)
        sizes.b_big = float(y.numel() * accum * sync.ranks_reduced_in_backward)
    return loss_sum, t_data


def train_step(model: torch.nn.Module, sync: GradientSynchronizer, batches: Iterator[Batch], accum: int,
               lr: float, grad_clip: float, comm: Collectives, world_size: int = 1,
               autocast: Callable[[], ContextManager] = contextlib.nullcontext, stop_requested: bool = False,
               device: Optional[torch.device] = None, hook: Optional[StageHook] = None) -> StepResult:
    """Run one optimizer step of ``sync`` on ``accum`` micro-batches from ``batches``.

    ``model`` is the module the forward calls: ``sync.train_module`` or a compiled version of it
    (for DDP the wrapper, whose backward hooks all-reduce). ``world_size`` turns the summed
    control values into means; ``device`` defaults to the model's.
    """
    hook = hook or (lambda stage: None)
    device = device if device is not None else next(model.parameters()).device
    clock = StepClock(device)
    clock.mark("start")
    sizes = _GradientSizes(device)
    loss_sum, t_data = _forward_backward(model, sync, batches, accum, device, autocast, sizes)
    clock.mark("fwd_bwd")
    control = torch.stack([loss_sum.double(), (~torch.isfinite(loss_sum)).double(),
                           torch.full((), float(stop_requested), dtype=torch.float64, device=device),
                           sizes.sq_small, sizes.sq_big])
    work = comm.all_reduce(control, kind="control", async_op=True)
    if sync.takes_skip_flag:
        hook("before_reduce")
        try:
            sync.reduce_gradients()
        finally:  # never leave the control all-reduce pending (an error here ends the process group)
            if work is not None:
                work.wait()  # on NCCL the stream waits, not the host
        clock.mark("comm")
        hook("after_reduce")
        norm = _scalar(sync.clip_gradients(grad_clip), device)
        skip = (control[1] > 0) | ~torch.isfinite(norm)
        sync.step(lr, skip=skip)
        sync.after_step()
        hook("after_step")
        grad_norm = torch.where(control[1] > 0, torch.full_like(norm, math.nan), norm)
    else:
        if work is not None:
            work.wait()
        loss_nonfinite = bool(control[1] > 0)  # the one host read of this path, see the module doc
        grad_norm, skip = torch.full((), math.nan, dtype=torch.float64, device=device), loss_nonfinite
        if not loss_nonfinite:
            hook("before_reduce")
            sync.reduce_gradients()
        clock.mark("comm")
        if not loss_nonfinite:
            hook("after_reduce")
            norm = sync.clip_gradients(grad_clip)
            grad_norm = _scalar(norm, device)
            skip = not math.isfinite(float(norm))
            if not skip:
                sync.step(lr)
                sync.after_step()
                hook("after_step")
        skip = torch.full((), float(skip), dtype=torch.float64, device=device)
    clock.mark("end")
    sync.zero_grad()
    values = torch.stack([control[0] / world_size, loss_sum.double(), grad_norm, skip.double(),
                          (control[2] > 0).double(), control[3] / world_size, control[4] / world_size])
    return StepResult(values, clock, t_data, (sizes.b_small, sizes.b_big))
