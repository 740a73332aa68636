"""``train.profile=true``: a torch.profiler trace of a range of steps on rank 0, and its top kernels.

Writes ``<run_dir>/profile/trace_steps<A>-<B>.json`` (Chrome trace format: open it at
https://ui.perfetto.dev or chrome://tracing) and ``top_kernels_steps<A>-<B>.txt`` (the operators and
kernels with the most self time, on CUDA the GPU kernels). The step before the range runs under the
profiler as its warm-up (when there is one in this job), so the first profiled step does not carry
the profiler's own start-up. Other ranks run unprofiled: they do the same work.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

TOP_ROWS = 25


class StepProfiler:
    """Profiles steps ``first``..``last`` (inclusive); ``step(n)`` is called after each step."""

    def __init__(self, run_dir: Path, first: int, last: int, start_step: int, device: torch.device,
                 enabled: bool) -> None:
        self.out = Path(run_dir) / "profile"
        self.first, self.last, self.device = max(first, start_step + 1), last, device
        self.prof: Optional[torch.profiler.profile] = None
        self.written: Optional[Path] = None
        self.enabled = enabled and last > start_step  # nothing to do when the range is already trained
        self.warmup = 1 if self.first - 1 > start_step else 0
        self.begin = self.first - self.warmup  # the profiler starts before this step
        if self.enabled and self.begin <= start_step + 1:
            self._start()

    def _start(self) -> None:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.prof = torch.profiler.profile(
            activities=activities,
            schedule=torch.profiler.schedule(wait=0, warmup=self.warmup, active=self.last - self.first + 1,
                                             repeat=1),
            on_trace_ready=self._write, record_shapes=False, with_stack=False)
        self.prof.start()

    def step(self, step: int) -> None:
        """After optimizer step ``step``: advance the profiler, start it before ``begin``."""
        if not self.enabled:
            return
        if self.prof is not None:
            self.prof.step()
            if step >= self.last:
                self.prof.stop()
                self.prof = None
                self.enabled = False
        elif step + 1 == self.begin:
            self._start()

    def close(self) -> None:
        """The run ended inside the range: write what was profiled."""
        if self.prof is not None:
            self.prof.stop()
            self.prof = None

    def _write(self, prof) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        tag = f"steps{self.first}-{self.last}"
        trace = self.out / f"trace_{tag}.json"
        prof.export_chrome_trace(str(trace))
        sort = "self_cuda_time_total" if self.device.type == "cuda" else "self_cpu_time_total"
        table = prof.key_averages().table(sort_by=sort, row_limit=TOP_ROWS)
        (self.out / f"top_kernels_{tag}.txt").write_text(
            f"torch.profiler, steps {self.first}..{self.last} on rank 0, sorted by {sort}\n{table}\n")
        self.written = trace
        print(f"profile: trace of steps {self.first}..{self.last} in {trace} (open at https://ui.perfetto.dev); "
              f"top kernels in {self.out / f'top_kernels_{tag}.txt'}", flush=True)
