"""Forward+backward throughput of our models against transformers' of identical configuration.

    python scripts/bench_model.py [--models tiny_llama tiny_gpt] [--batch 8] [--rounds 6]

Both models hold the same weights (models.hf.to_hf_model) and run the same training step (loss on
the same tokens, backward, grads cleared), in fp32 on this machine's CPU (or --device). Each model
lives in its own worker process, as it would in a training job: in one shared process, the
memory one model frees (transformers' 64 MB fp32 logits, log-softmax and gradient per step)
changes how the C allocator serves the other's next steps (pages handed back to the OS and
faulted in again), so whichever model runs second after a switch pays for the first one
(`--shared-process` measures that way, for comparison). Rounds alternate ours / HF, one worker
running while the other waits idle, so load from other processes hits both alike; the figure is
the median step time over all rounds, by wall clock and by the worker's CPU time (the steadier
figure when other jobs share the CPU; run with --threads 1 to keep OpenMP spin-waits out of it).
Prints one JSON object.
"""
from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing
import os
import platform
import statistics
import sys
import time
from typing import Callable, Dict, List, Optional, Tuple

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from models import build_model, count_parameters, load_model_config  # noqa: E402
from models.hf import to_hf_model  # noqa: E402

StepTimes = List[Tuple[float, float]]


def _step_times(step: Callable[[], None], iterations: int) -> StepTimes:
    """(wall seconds, CPU seconds of this process) per step. On a machine shared with other jobs
    the CPU time is the steadier figure: being descheduled costs wall time but no CPU time."""
    times = []
    for _ in range(iterations):
        wall, cpu = time.perf_counter(), time.process_time()
        step()
        times.append((time.perf_counter() - wall, time.process_time() - cpu))
    return times


class _Bench:
    """One model's training step on fixed random tokens (the same in every process)."""

    def __init__(self, name: str, which: str, batch: int, device: str) -> None:
        cfg = load_model_config(name)
        torch.manual_seed(0)
        ours = build_model(cfg, device=device).train()
        idx = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len), device=device)
        targets = torch.cat([idx[:, 1:], torch.full((batch, 1), -1, device=device)], dim=1)
        self.parameters = count_parameters(ours)
        self.tokens = batch * cfg.seq_len
        if which == "ours":
            self.model, self.loss = ours, (lambda: ours(idx, targets))
        else:
            theirs = to_hf_model(ours, cfg).to(device).train()
            del ours
            self.model, self.loss = theirs, (lambda: theirs(input_ids=idx, labels=idx).loss)
            self.hf_class = type(theirs).__name__
            self.hf_attention = getattr(theirs.config, "_attn_implementation", None)

    def step(self) -> None:
        self.loss().backward()
        self.model.zero_grad(set_to_none=True)

    def first_loss(self) -> float:
        with torch.no_grad():
            return self.loss().item()


def _worker(name: str, which: str, batch: int, device: str, threads: Optional[int], conn) -> None:
    """Builds one model, answers its loss, then runs `n` steps per request until sent None."""
    if threads:
        torch.set_num_threads(threads)
    bench = _Bench(name, which, batch, device)
    conn.send((bench.first_loss(), {k: v for k, v in vars(bench).items()
                                    if k in ("parameters", "tokens", "hf_class", "hf_attention")}))
    while (iterations := conn.recv()) is not None:
        conn.send(_step_times(bench.step, iterations))


class _InProcess:
    """The --shared-process variant: both models in this process."""

    def __init__(self, bench: _Bench) -> None:
        self.bench = bench
        self.loss = bench.first_loss()
        self.info = {k: v for k, v in vars(bench).items()
                     if k in ("parameters", "tokens", "hf_class", "hf_attention")}

    def run(self, iterations: int) -> StepTimes:
        return _step_times(self.bench.step, iterations)

    def close(self) -> None:
        pass


class _InWorker:
    def __init__(self, name: str, which: str, batch: int, device: str, threads: Optional[int]) -> None:
        self.conn, child = multiprocessing.get_context("spawn").Pipe()
        self.process = multiprocessing.get_context("spawn").Process(
            target=_worker, args=(name, which, batch, device, threads, child), daemon=True)
        self.process.start()
        self.loss, self.info = self.conn.recv()

    def run(self, iterations: int) -> StepTimes:
        self.conn.send(iterations)
        return self.conn.recv()

    def close(self) -> None:
        self.conn.send(None)
        self.process.join(timeout=60)


def bench(name: str, batch: int, rounds: int, iterations: int, warmup: int, device: str,
          threads: Optional[int], shared_process: bool) -> Dict:
    if shared_process:
        ours, theirs = (_InProcess(_Bench(name, which, batch, device)) for which in ("ours", "hf"))
    else:
        ours, theirs = (_InWorker(name, which, batch, device, threads) for which in ("ours", "hf"))
    try:
        # Same function, same loss: a benchmark of two different computations would be meaningless.
        assert abs(ours.loss - theirs.loss) < 1e-4, (ours.loss, theirs.loss)
        ours.run(warmup)
        theirs.run(warmup)
        our_times: StepTimes = []
        their_times: StepTimes = []
        for _ in range(rounds):
            our_times += ours.run(iterations)
            their_times += theirs.run(iterations)
    finally:
        ours.close()
        theirs.close()
    tokens = ours.info["tokens"]

    def rate(times: StepTimes, which: int) -> float:
        return tokens / statistics.median(t[which] for t in times)

    ours_wall, hf_wall = rate(our_times, 0), rate(their_times, 0)
    ours_cpu, hf_cpu = rate(our_times, 1), rate(their_times, 1)
    return {
        "parameters": ours.info["parameters"],
        "tokens_per_step": tokens,
        "ours_tokens_per_s": round(ours_wall, 1),
        "hf_tokens_per_s": round(hf_wall, 1),
        "speedup": round(ours_wall / hf_wall, 3),
        "ours_tokens_per_cpu_s": round(ours_cpu, 1),
        "hf_tokens_per_cpu_s": round(hf_cpu, 1),
        "speedup_cpu_time": round(ours_cpu / hf_cpu, 3),
        "hf_class": theirs.info["hf_class"],
        "hf_attention": theirs.info["hf_attention"],
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
    parser.add_argument("--shared-process", action="store_true",
                        help="run both models in this process instead of one worker each")
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
        "isolation": "shared process" if args.shared_process else "one worker process per model",
        "results": {name: bench(name, args.batch, args.rounds, args.iterations, args.warmup, args.device,
                                args.threads, args.shared_process)
                    for name in args.models},
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
