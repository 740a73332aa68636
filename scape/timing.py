"""Per-step timers for the scape/time_* metrics.

On CUDA the work is asynchronous, so wall-clock brackets would measure launch overhead; CUDA
events measure the stream time instead and are only read when metrics are asked for, so timing
adds no synchronisation to the step itself.
"""
from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager
from typing import Dict, Iterator, List, Tuple

import torch


class StepTimers:
    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.seconds: Dict[str, float] = defaultdict(float)
        self.pending: List[Tuple[str, torch.cuda.Event, torch.cuda.Event]] = []

    @contextmanager
    def time(self, name: str) -> Iterator[None]:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self.pending.append((name, start, end))
        else:
            t0 = time.perf_counter()
            yield
            self.seconds[name] += time.perf_counter() - t0

    def start_step(self) -> None:
        """Forget earlier steps: metrics are per step even when only every n-th step is logged."""
        self.seconds.clear()
        self.pending.clear()

    def collect(self, names) -> Dict[str, float]:
        """Seconds per name since the last collect (0 for names that did not run)."""
        for name, start, end in self.pending:
            end.synchronize()
            self.seconds[name] += start.elapsed_time(end) / 1000.0
        self.pending.clear()
        out = {name: float(self.seconds.get(name, 0.0)) for name in names}
        self.seconds.clear()
        return out
