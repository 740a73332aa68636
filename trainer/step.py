"""One optimizer step, written once: the Trainer, the benchmarks and the tests all call it.

nanoGPT's order with the synchroniser as the one place where gradients cross ranks:

    micro-batches: forward, backward (loss / accum)   -> perf/time_data_s, perf/time_fwd_bwd_s
                   each inside sync.micro_batch_context(last=...) (where overlapped comm starts)
    control all-reduce: mean loss, non-finite flag, stop request (every rank decides alike)
    sync.reduce_gradients()                           -> perf/time_comm_s (with the control)
    norm = sync.clip_gradients(max)                   # a non-finite norm skips the update
    sync.step(lr); sync.after_step()                  -> perf/time_opt_s
    sync.zero_grad()
"""
from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass
from typing import Callable, ContextManager, Iterator, Optional, Tuple

import torch

from core.comm import Collectives
from core.sync import GradientSynchronizer

Batch = Tuple[torch.Tensor, torch.Tensor]
# Observers of the stages ("before_reduce", "after_reduce", "after_step"), for tests.
StageHook = Callable[[str], None]


@dataclass
class StepResult:
    loss: float  # mean over ranks and micro-batches
    local_loss: float  # this rank's mean over its micro-batches
    grad_norm: float  # before clipping; NaN when the step was skipped before the reduction
    nonfinite: bool  # the update was skipped (non-finite loss or gradient on some rank)
    stop_requested: bool  # some rank asked to stop (a signal)
    time_data: float
    time_fwd_bwd: float
    time_comm: float
    time_opt: float
    time_step: float


def device_sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _forward_backward(model: torch.nn.Module, sync: GradientSynchronizer, batches: Iterator[Batch], accum: int,
                      device: torch.device, autocast: Callable[[], ContextManager]) -> Tuple[torch.Tensor, float]:
    """Accumulate the gradients of ``accum`` micro-batches; their mean loss and the data time."""
    t_data, loss_sum = 0.0, torch.zeros((), device=device)
    for micro in range(accum):
        td = time.perf_counter()
        x, y = next(batches)
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        t_data += time.perf_counter() - td
        with sync.micro_batch_context(last=micro == accum - 1):
            with autocast():
                loss = model(x, y)
            (loss / accum).backward()
        loss_sum += loss.detach() / accum
    return loss_sum, t_data


def train_step(model: torch.nn.Module, sync: GradientSynchronizer, batches: Iterator[Batch], accum: int,
               lr: float, grad_clip: float, comm: Collectives, world_size: int = 1,
               autocast: Callable[[], ContextManager] = contextlib.nullcontext, stop_requested: bool = False,
               device: Optional[torch.device] = None, hook: Optional[StageHook] = None) -> StepResult:
    """Run one optimizer step of ``sync`` on ``accum`` micro-batches from ``batches``.

    ``world_size`` turns the summed control values into means; ``device`` defaults to the model's.
    """
    hook = hook or (lambda stage: None)
    device = device if device is not None else next(model.parameters()).device
    device_sync(device)
    t0 = time.perf_counter()
    loss_sum, t_data = _forward_backward(model, sync, batches, accum, device, autocast)
    device_sync(device)
    t1 = time.perf_counter()
    control = torch.stack([loss_sum.float(), (~torch.isfinite(loss_sum)).float(),
                           torch.tensor(float(stop_requested), device=device)]).double()
    comm.all_reduce(control, kind="control")
    mean_loss, nonfinite, stop = control[0].item() / world_size, control[1].item() > 0, control[2].item() > 0
    sync_time = time.perf_counter() - t1
    grad_norm = float("nan")
    if not nonfinite:
        hook("before_reduce")
        tc = time.perf_counter()
        sync.reduce_gradients()
        device_sync(device)
        sync_time += time.perf_counter() - tc
        hook("after_reduce")
        grad_norm = sync.clip_gradients(grad_clip)
        nonfinite = not math.isfinite(grad_norm)
        if not nonfinite:
            sync.step(lr)
            sync.after_step()
            hook("after_step")
        device_sync(device)
    t3 = time.perf_counter()
    sync.zero_grad()
    return StepResult(loss=mean_loss, local_loss=float(loss_sum), grad_norm=grad_norm, nonfinite=nonfinite,
                      stop_requested=stop, time_data=t_data, time_fwd_bwd=t1 - t0 - t_data, time_comm=sync_time,
                      time_opt=t3 - t1 - sync_time, time_step=t3 - t0)
