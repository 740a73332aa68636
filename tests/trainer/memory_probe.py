"""Measure a tiny run's peak memory against the pre-flight's estimate, in a fresh process.

    python -m tests.trainer.memory_probe OUT.json OVERRIDE...

What is measured: every CPU tensor allocation and free of the run, from the Trainer's build to
the end of training (data loaders, model, synchroniser, steps, validation, the final checkpoint),
as the CPU allocator reports them to torch.profiler (profile_memory=True); the peak is the
largest running sum of live bytes. Python objects and the interpreter's own pages are not
tensors and are not counted (the estimate does not model them either). The peak RSS growth
over the same span (VmHWM after /proc/self/clear_refs reset it) is reported beside it.
"""
from __future__ import annotations

import json
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from tests.train_helpers import compose_config


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def _name(event) -> str:
    try:
        return event.name()
    except UnicodeDecodeError:  # a Python frame's name (MEMORY_PROBE_STACK) the profiler mangled
        return "?"


def tracked_peak(events) -> tuple:
    """The largest running sum of the CPU allocator's allocations (+) and frees (-), and the ops
    running when it was reached (outermost first)."""
    memory = sorted((e.start_ns(), e.nbytes()) for e in events
                    if _name(e) == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU)
    live = peak = at = 0
    for when, nbytes in memory:
        live += nbytes
        if live > peak:
            peak, at = live, when
    ops = sorted((e.start_ns(), _name(e)) for e in events
                 if _name(e) != "[memory]" and e.start_ns() <= at <= e.start_ns() + e.duration_ns())
    return peak, [name for _, name in ops]


def main(out: str, overrides: list) -> None:
    from core.distributed import init_distributed
    from trainer.config import to_config
    from trainer.memory import estimate_memory
    from trainer.trainer import Trainer

    config = to_config(compose_config(overrides))
    env = init_distributed(config.train.device, config.train.dist_timeout_s)
    estimate = estimate_memory(config, env.world_size, env.device.type)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak RSS (VmHWM) to the current RSS
    rss_before = _rss_kib("VmRSS")
    # MEMORY_PROBE_STACK=1: name the Python frames running at the peak (slower)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True,
                 with_stack=os.environ.get("MEMORY_PROBE_STACK") == "1") as prof:
        Trainer(config, env).build().train()
    rss_peak = _rss_kib("VmHWM")
    peak, ops = tracked_peak(prof.profiler.kineto_results.events())
    result = {"command": "python -m tests.trainer.memory_probe " + " ".join([out, *overrides]),
              "estimate_bytes": estimate.device_peak, "tracked_peak_bytes": peak, "peak_during": ops,
              "rss_growth_bytes": (rss_peak - rss_before) * 1024,
              "parts": [[p.name, p.bytes, p.phase] for p in estimate.parts]}
    with open(out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
