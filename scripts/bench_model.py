"""Forward+backward throughput of our models against transformers' of identical configuration.

    python scripts/bench_model.py [--models tiny_llama tiny_gpt] [--batch 8] [--rounds 6]

Both models hold the same weights (models.hf.to_hf_model) and run the same training step (loss on
the same tokens, backward, grads cleared), in fp32 on this machine's CPU (or --device). Rounds
alternate ours / HF so that load from other processes hits both alike; the figure is the median
step time over all rounds, by wall clock and by the process's CPU time (the steadier figure
when other jobs share the CPU; run with --threads 1 to keep OpenMP spin-waits out of it).
Prints one JSON object.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from typing import Callable, Dict, List, Tuple

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from models import build_model, count_parameters, load_model_config  # noqa: E402
from models.hf import to_hf_model  # noqa: E402


def _step_times(step: Callable[[], None], iterations: int) -> List[Tuple[float, float]]:
    """(wall seconds, process CPU seconds) per step. On a machine shared with other jobs the CPU
    time is the steadier figure: being descheduled costs wall time but no CPU time."""
    times = []
    for _ in range(iterations):
        wall, cpu = time.perf_counter(), time.process_time()
        step()
        times.append((time.perf_counter() - wall, time.process_time() - cpu))
    return times


def bench(name: str, batch: int, rounds: int, iterations: int, warmup: int, device: str) -> Dict:
    cfg = load_model_config(name)
    torch.manual_seed(0)
    ours = build_model(cfg, device=device).train()
    theirs = to_hf_model(ours, cfg).to(device).train()
    idx = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len), device=device)
    targets = torch.cat([idx[:, 1:], torch.full((batch, 1), -1, device=device)], dim=1)

    def our_step() -> None:
        ours(idx, targets).backward()
        ours.zero_grad(set_to_none=True)

    def their_step() -> None:
        theirs(input_ids=idx, labels=idx).loss.backward()
        theirs.zero_grad(set_to_none=True)

    # Same function, same loss: a benchmark of two different computations would be meaningless.
    with torch.no_grad():
        our_loss = ours(idx, targets).item()
        their_loss = theirs(input_ids=idx, labels=idx).loss.item()
    assert abs(our_loss - their_loss) < 1e-4, (our_loss, their_loss)

    _step_times(our_step, warmup)
    _step_times(their_step, warmup)
    our_times: List[Tuple[float, float]] = []
    their_times: List[Tuple[float, float]] = []
    for _ in range(rounds):
        our_times += _step_times(our_step, iterations)
        their_times += _step_times(their_step, iterations)
    tokens = batch * cfg.seq_len

    def rate(times: List[Tuple[float, float]], which: int) -> float:
        return tokens / statistics.median(t[which] for t in times)

    ours_wall, hf_wall = rate(our_times, 0), rate(their_times, 0)
    ours_cpu, hf_cpu = rate(our_times, 1), rate(their_times, 1)
    return {
        "parameters": count_parameters(ours),
        "tokens_per_step": tokens,
        "ours_tokens_per_s": round(ours_wall, 1),
        "hf_tokens_per_s": round(hf_wall, 1),
        "speedup": round(ours_wall / hf_wall, 3),
        "ours_tokens_per_cpu_s": round(ours_cpu, 1),
        "hf_tokens_per_cpu_s": round(hf_cpu, 1),
        "speedup_cpu_time": round(ours_cpu / hf_cpu, 3),
        "hf_class": type(theirs).__name__,
        "hf_attention": getattr(theirs.config, "_attn_implementation", None),
        "steps_timed_each": len(our_times),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["tiny_llama", "tiny_gpt"])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--iterations", type=int, default=3, help="steps per round and model")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads (default: torch's choice)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    import transformers

    report = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
                   f"{torch.get_num_threads()} torch threads",
        "device": args.device,
        "dtype": "fp32",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "batch": args.batch,
        "results": {name: bench(name, args.batch, args.rounds, args.iterations, args.warmup, args.device)
                    for name in args.models},
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
