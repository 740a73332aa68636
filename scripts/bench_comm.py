"""Bytes sent per rank per step: dense AdamW / AdamS against SCAPE-90 / SCAPE-99 and each transport.

Two sources, printed as one JSON document:
- ``counted``: a real 2-process gloo run of a tiny Llama through the synchronisers, bytes read
  from the counted collectives' byte counter (core.comm) (steady-state sparse steps; the dense first step separately);
- ``formula``: scape.accounting's analytic formula for the gpt345m, llama500m and llama1_8b
  layouts at 2, 32 and 64 ranks (the tests check that the counters equal the formula).

    python scripts/bench_comm.py [--steps 4] [--out file.json]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from dataclasses import replace
from typing import Dict, List

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from models import build_model, count_parameters, load_model_config  # noqa: E402
from scape.accounting import dense_step_bytes, scape_step_bytes  # noqa: E402
from scape.config import OptimizerConfig  # noqa: E402
from trainer.step import train_step  # noqa: E402
from scripts.bench_io import emit_report, free_port  # noqa: E402

TRANSPORTS = ("bitmap", "indices", "auto")
ARMS: List[Dict] = (
    [dict(name="dense_adamw", optimizer="adamw"), dict(name="dense_adams", optimizer="adams")]
    + [dict(name=f"scape{int(s * 100)}_{t}", optimizer="scape", sparsity=s, mask_transport=t)
       for s in (0.9, 0.99) for t in TRANSPORTS]
    + [dict(name="scape99_auto_bf16", optimizer="scape", sparsity=0.99, mask_transport="auto",
            value_dtype="bf16")])
LAYOUTS = ("gpt345m", "llama500m", "llama1_8b")
WORLDS = (2, 32, 64)


def tiny_model_config():
    """The tiny_scape* experiments' model (tiny_llama at d_model 128), short sequences."""
    return replace(load_model_config("tiny_llama"), d_model=128, n_head=4, n_kv_head=2,
                   ffn_hidden=384, seq_len=64)


def _build_sync(model, arm: Dict):
    from scape import build_synchronizer
    from core.optim import build_optimizer
    from core.sync import DenseAllReduce

    cfg = OptimizerConfig(name=arm["optimizer"], **{k: v for k, v in arm.items()
                                                    if k not in ("name", "optimizer")})
    if arm["optimizer"] == "scape":
        return build_synchronizer(model, cfg)
    return DenseAllReduce(model, lambda params: build_optimizer(params, cfg))


def _counted_worker(rank: int, world: int, port: int, steps: int, out_path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    model_cfg = tiny_model_config()
    results = {}
    for arm in ARMS:
        torch.manual_seed(0)
        model = build_model(model_cfg)
        sync = _build_sync(model, arm)
        per_step = []
        for step in range(1, steps + 1):
            gen = torch.Generator().manual_seed(100 * step + rank)
            x = torch.randint(0, model_cfg.vocab_size, (2, model_cfg.seq_len), generator=gen)
            sync.comm.counter.reset()
            train_step(model, sync, iter([(x, torch.roll(x, -1, dims=1))]), 1, 1e-3, 1.0, sync.comm, world)
            # the gradient synchroniser's bytes; the trainer's 24-byte control all-reduce aside
            per_step.append({k: v for k, v in sync.comm.counter.bytes.items() if k != "control"})
        steady = per_step[1:]
        kinds = sorted({k for s in steady for k in s})
        mean = {k: sum(s.get(k, 0.0) for s in steady) / len(steady) for k in kinds}
        results[arm["name"]] = {"first_step": per_step[0], "steady_step": mean,
                                "steady_total": sum(mean.values())}
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({"parameters": count_parameters(model), "arms": results}, f)
    dist.destroy_process_group()


def counted_run(steps: int) -> Dict:
    import tempfile

    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        out_path = os.path.join(tmp, "counted.json")
        mp.start_processes(_counted_worker, args=(2, port, steps, out_path), nprocs=2,
                           join=True, start_method="spawn")
        with open(out_path) as f:
            counted = json.load(f)
    dense = dense_step_bytes(counted["parameters"], 2)
    for arm in counted["arms"].values():
        arm["compression_vs_dense_fp32"] = dense / arm["steady_total"]
    counted.update(world=2, model="tiny_llama d128 (tiny_scape* experiments)",
                   dense_fp32_allreduce_bytes=dense)
    return counted


def formula() -> Dict:
    out = {}
    for name in LAYOUTS:
        numel = count_parameters(build_model(load_model_config(name), device="meta"))
        per_world = {}
        for world in WORLDS:
            dense = dense_step_bytes(numel, world)
            arms = {"dense_adamw": {"total": dense, "compression": 1.0},
                    "dense_adams": {"total": dense, "compression": 1.0}}
            for arm in ARMS[2:]:
                b = scape_step_bytes(numel, world, arm["sparsity"], arm["mask_transport"],
                                     arm.get("value_dtype", "fp32"))
                arms[arm["name"]] = {"values": b["values"], "mask": b["mask"], "total": b["total"],
                                     "transport": b["transport"], "k": b["k"],
                                     "compression": dense / b["total"]}
            per_world[f"world_{world}"] = arms
        out[name] = {"parameters": numel, **per_world}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=4, help="steps per arm in the counted run")
    parser.add_argument("--out", help="also write the JSON here")
    args = parser.parse_args()
    t0 = time.time()
    report = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
              "machine": f"{platform.node()} {platform.processor() or platform.machine()}, "
                         f"{os.cpu_count()} CPUs, torch {torch.__version__}",
              "unit": "bytes sent per rank per step (ring all-reduce 2(N-1)/N S, all-gather (N-1) S)",
              "counted": counted_run(args.steps), "formula": formula()}
    report["wall_s"] = time.time() - t0
    emit_report(report, args.out)


if __name__ == "__main__":
    main()
