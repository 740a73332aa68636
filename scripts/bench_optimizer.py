"""Local work of one SCAPE step against one dense AdamS step, on a 50M-parameter buffer, one process.

SCAPE's step = score + top-k + pack (after_step), unpack + residual update + gather (reduce),
clip, update + scatter (step); in one process the collectives are no-ops, so this is the
computation a rank adds to a step, without communication. It runs with one partition (top-k over
the whole buffer: the worst case; with N ranks a rank's top-k covers 1/N of it). Each SCAPE arm
runs with both top-k methods (``optimizer.topk_method``: exact, threshold); ``topk`` compares
the two selections alone on the same scores: seconds, the k each chose, whether the sets agree
above the k-th value and how many scores tie at it.

    python scripts/bench_optimizer.py [--numel 50000000] [--repeats 5] [--out file.json]
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from typing import Callable, Dict, List

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from core.optim import AdamS  # noqa: E402
from scape.config import OptimizerConfig  # noqa: E402
from scape.synchronizer import ScapeSynchronizer  # noqa: E402
from scape.topk import TOPK_METHODS, topk_mask  # noqa: E402
from scripts.bench_io import emit_report  # noqa: E402


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


class DenseAdamSArm:
    """One dense AdamS step (the project's optimizer) on the whole buffer."""

    def __init__(self, numel: int, device: torch.device) -> None:
        self.model = FlatMatrix(numel, device)
        self.optimizer = AdamS([{"params": [self.model.weight], "weight_decay": 0.1}], lr=1e-3)
        self.model.weight.grad = 1e-3 * torch.randn_like(self.model.weight)
        self.optimizer.step()  # state allocation outside the timing

    def run(self, device: torch.device) -> Dict[str, float]:
        return {"step": _timed(self.optimizer.step, device)}


class ScapeArm:
    """One SCAPE step (one process: the collectives are no-ops) split by phase."""

    def __init__(self, numel: int, sparsity: float, device: torch.device, topk_method: str = "exact") -> None:
        self.sync = ScapeSynchronizer(FlatMatrix(numel, device),
                                      OptimizerConfig(name="scape", sparsity=sparsity, lr=1e-3,
                                                      topk_method=topk_method))
        self.gen = torch.Generator(device=device).manual_seed(0)
        for _ in range(2):  # step 1 is dense, step 2 the first sparse one: not timed
            self.run(device)

    def run(self, device: torch.device) -> Dict[str, float]:
        sync = self.sync
        sync.flat.grad.normal_(0.0, 1e-3, generator=self.gen)
        timings = {"reduce_gradients": _timed(sync.reduce_gradients, device),
                   "clip_gradients": _timed(lambda: sync.clip_gradients(1.0), device),
                   "step": _timed(lambda: sync.step(1e-3), device),
                   "after_step": _timed(sync.after_step, device)}
        metrics = sync.metrics()
        timings.update({key.split("/")[1]: metrics[key] for key in
                        ("scape/time_topk_s", "scape/time_pack_s")})
        timings["total"] = sum(timings[k] for k in ("reduce_gradients", "clip_gradients", "step",
                                                     "after_step"))
        return timings


class TopkArm:
    """The selection alone: both methods on one score vector of a trained SCAPE arm, same k."""

    def __init__(self, arm: ScapeArm) -> None:
        self.score = arm.sync.score.clone()
        self.k = arm.sync.k_at(arm.sync.step_count + 1)
        self.masks = {m: torch.empty_like(self.score, dtype=torch.bool) for m in TOPK_METHODS}
        self.scratch = torch.empty_like(self.score, dtype=torch.bool)

    def run(self, device: torch.device) -> Dict[str, float]:
        times = {m: _timed(lambda m=m: topk_mask(self.score, self.k, self.masks[m], m, self.scratch), device)
                 for m in TOPK_METHODS}
        times.update({f"k_{m}": float(self.masks[m].sum()) for m in TOPK_METHODS})
        # 50M fp32 scores repeat values, so the k-th value may be tied: the methods then agree on
        # every entry above it, and choose different ones among the ties (threshold: lowest index)
        kth = self.score[self.masks["threshold"]].min()
        above = self.score > kth
        times["same_set_above_kth"] = float(torch.equal(self.masks["exact"] & above,
                                                        self.masks["threshold"] & above))
        times["ties_at_kth"] = float((self.score == kth).sum())
        return times


def _summary(runs: List[Dict[str, float]]) -> Dict[str, Dict[str, float]]:
    keys = runs[0].keys()
    return {"min": {k: min(r[k] for r in runs) for k in keys},
            "median": {k: statistics.median(r[k] for r in runs) for k in keys}}


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
    arms = {"dense_adams": DenseAdamSArm(args.numel, device),
            "scape90": ScapeArm(args.numel, 0.9, device),
            "scape90_threshold": ScapeArm(args.numel, 0.9, device, "threshold"),
            "scape99": ScapeArm(args.numel, 0.99, device),
            "scape99_threshold": ScapeArm(args.numel, 0.99, device, "threshold")}
    arms["topk90"], arms["topk99"] = TopkArm(arms["scape90"]), TopkArm(arms["scape99"])
    runs: Dict[str, List[Dict[str, float]]] = {name: [] for name in arms}
    for _ in range(args.repeats):  # interleaved, so a change in machine load hits every arm
        for name, arm in arms.items():
            runs[name].append(arm.run(device))
    report = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
              "machine": f"{platform.node()} {platform.processor() or platform.machine()}, "
                         f"{os.cpu_count()} CPUs, {torch.get_num_threads()} torch threads, "
                         f"device {device}, torch {torch.__version__}",
              "numel": args.numel, "repeats": args.repeats, "seconds": {}}
    dense = _summary(runs["dense_adams"])
    report["seconds"]["dense_adams"] = dense
    for name in ("scape90", "scape90_threshold", "scape99", "scape99_threshold"):
        summary = _summary(runs[name])
        summary["k"] = arms[name].sync.k_at(arms[name].sync.step_count + 1)
        for stat in ("min", "median"):
            summary[f"ratio_vs_dense_adams_{stat}"] = summary[stat]["total"] / dense[stat]["step"]
        report["seconds"][name] = summary
    for name in ("topk90", "topk99"):
        summary = _summary(runs[name])
        summary["k"] = arms[name].k
        for stat in ("min", "median"):
            summary[f"speedup_threshold_vs_exact_{stat}"] = summary[stat]["exact"] / summary[stat]["threshold"]
        report["seconds"][name] = summary
    emit_report(report, args.out)


if __name__ == "__main__":
    main()
