"""Local work of one SCAPE step against one dense AdamS step, on a 50M-parameter buffer, one process.

SCAPE's step = score + top-k + pack (after_step), unpack + residual update + gather (reduce),
clip, update + scatter (step); in one process the collectives are no-ops, so this is the
computation a rank adds to a step, without communication. It runs with one partition (top-k over
the whole buffer: the worst case; with N ranks a rank's top-k covers 1/N of it).

    python scripts/bench_optimizer.py [--numel 50000000] [--repeats 5] [--out file.json]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from typing import Callable, Dict, List

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from scape.adams import AdamS  # noqa: E402
from scape.config import OptimizerConfig  # noqa: E402
from scape.kernels import reference  # noqa: E402
from scape.synchronizer import ScapeSynchronizer  # noqa: E402


class FlatMatrix(torch.nn.Module):
    """One weight matrix of ``numel`` parameters (weight decay applies, as to most of an LLM)."""

    def __init__(self, numel: int, device: torch.device) -> None:
        super().__init__()
        cols = 1000
        self.weight = torch.nn.Parameter(0.02 * torch.randn(numel // cols, cols, device=device))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn: Callable[[], None], device: torch.device) -> float:
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t0


def dense_adams(numel: int, repeats: int, device: torch.device) -> Dict[str, float]:
    model = FlatMatrix(numel, device)
    optimizer = AdamS([{"params": [model.weight], "weight_decay": 0.1}], lr=1e-3)
    model.weight.grad = 1e-3 * torch.randn_like(model.weight)
    optimizer.step()  # state allocation outside the timing
    times = [_timed(optimizer.step, device) for _ in range(repeats)]
    param, momentum, grad = (model.weight.detach().view(-1), torch.zeros(numel, device=device),
                             model.weight.grad.view(-1))
    fused = [_timed(lambda: reference.adams_dense_update(param, momentum, grad, 1e-3, 0.9, 0.95,
                                                         1e-8, 0.5, 0.1, numel), device)
             for _ in range(repeats)]
    return {"adams_optimizer_step_s": statistics.median(times),
            "adams_reference_kernel_s": statistics.median(fused)}


def scape_step(numel: int, sparsity: float, repeats: int, device: torch.device) -> Dict:
    model = FlatMatrix(numel, device)
    sync = ScapeSynchronizer(model, OptimizerConfig(name="scape", sparsity=sparsity, lr=1e-3))
    gen = torch.Generator(device=device).manual_seed(0)
    phases: Dict[str, List[float]] = {"reduce_gradients": [], "clip_gradients": [], "step": [],
                                      "after_step": []}
    internal: Dict[str, List[float]] = {}
    for step in range(repeats + 2):  # step 1 is dense, step 2 the first sparse: not timed
        sync.flat.grad.normal_(0.0, 1e-3, generator=gen)
        timings = {"reduce_gradients": _timed(sync.reduce_gradients, device),
                   "clip_gradients": _timed(lambda: sync.clip_gradients(1.0), device),
                   "step": _timed(lambda: sync.step(1e-3), device),
                   "after_step": _timed(sync.after_step, device)}
        metrics = sync.metrics()
        if step >= 2:
            for name, seconds in timings.items():
                phases[name].append(seconds)
            for key in ("scape/time_topk_s", "scape/time_pack_s", "scape/time_wait_s"):
                internal.setdefault(key.split("/")[1], []).append(metrics[key])
    out = {name: statistics.median(v) for name, v in phases.items()}
    out["total_s"] = sum(out.values())
    out["of_which"] = {name: statistics.median(v) for name, v in internal.items()}
    out["k"] = sync.k_at(sync.step_count + 1)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--numel", type=int, default=50_000_000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch CPU threads (0 = torch's default); 1 gives steadier numbers on a shared machine")
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    torch.manual_seed(0)
    dense = dense_adams(args.numel, args.repeats, device)
    report = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
              "machine": f"{platform.node()} {platform.processor() or platform.machine()}, "
                         f"{os.cpu_count()} CPUs, {torch.get_num_threads()} torch threads, "
                         f"device {device}, torch {torch.__version__}",
              "numel": args.numel, "repeats": args.repeats, "dense": dense}
    for sparsity in (0.9, 0.99):
        scape = scape_step(args.numel, sparsity, args.repeats, device)
        scape["ratio_vs_dense_adams"] = scape["total_s"] / dense["adams_optimizer_step_s"]
        report[f"scape{int(round(sparsity * 100))}"] = scape
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
