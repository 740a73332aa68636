"""Transient memory of each top-k method on the CPU, measured as the process's peak resident set.

Run in a fresh process: ``python -m tests.scape.topk_memory [--n N] [--chunk C] [--out FILE]``
prints (and writes) JSON with the bytes a scored element each method needs beyond the score, the
mask and the caller's scratch. With ``MALLOC_MMAP_THRESHOLD_`` fixed (set here before torch
allocates anything, by re-executing), every large buffer is its own mapping, returned to the
system when freed, so the peak resident set above the baseline is the peak of the live
temporaries, whatever the allocator inside each op does.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import re
import sys
from typing import Callable, Dict, Sequence

MMAP_THRESHOLD = "65536"
# exact_torch_topk and threshold_radix are the CUDA paths, run here on the CPU (torch.topk's CPU
# kernel is not CUDA's: its number says nothing about the GPU)
METHODS = ("exact_cpu", "exact_torch_topk", "threshold_sampled", "threshold_radix")


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as status:
        return int(re.search(field + r":\s+(\d+) kB", status.read()).group(1)) * 1024


def peak_transient_bytes(run: Callable[[], object]) -> int:
    """Peak resident bytes above the current ones while ``run`` runs (Linux: VmHWM reset by
    writing 5 to /proc/self/clear_refs)."""
    gc.collect()
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")
    base = _status_bytes("VmRSS")
    run()
    return _status_bytes("VmHWM") - base


def measure(n: int, chunk: int, sparsity: float, methods: Sequence[str] = METHODS) -> Dict[str, float]:
    import torch

    from scape import topk

    topk.RADIX_CHUNK = chunk
    k = int(n * (1 - sparsity))
    score = torch.randn(n, generator=torch.Generator().manual_seed(0)).abs_()
    out = torch.zeros(n, dtype=torch.bool)
    scratch = torch.zeros(n, dtype=torch.bool)
    runs = {
        "exact_cpu": lambda: topk.topk_mask(score, k, out, "exact"),
        "exact_torch_topk": lambda: topk._torch_topk_mask(score, k, out),  # the CUDA path
        "threshold_sampled": lambda: topk.topk_mask(score, k, out, "threshold", scratch),
        "threshold_radix": lambda: topk._radix_mask(score, k, out),  # the CUDA path, and the CPU's fallback
    }
    result: Dict[str, float] = {"n": n, "k": k, "radix_chunk": chunk}
    for name in methods:
        run = runs[name]
        run()  # once to warm up (lazily built tables, thread pools)
        result[name + "_bytes_per_element"] = peak_transient_bytes(run) / n
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=1 << 23)
    parser.add_argument("--chunk", type=int, default=None, help="RADIX_CHUNK (default: the module's)")
    parser.add_argument("--sparsity", type=float, default=0.9)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") != MMAP_THRESHOLD:  # glibc reads it at start-up
        os.environ["MALLOC_MMAP_THRESHOLD_"] = MMAP_THRESHOLD
        os.execv(sys.executable, [sys.executable, "-m", "tests.scape.topk_memory", *sys.argv[1:]])
    from scape import topk
    result = measure(args.n, args.chunk or topk.RADIX_CHUNK, args.sparsity)
    result["command"] = "python -m tests.scape.topk_memory " + " ".join(sys.argv[1:])
    text = json.dumps(result, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
