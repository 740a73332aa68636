"""Optimizer state per rank, replicated against sharded (optimizer.shard=true), at 1, 2 and 4 ranks.

Each arm builds its synchroniser over a real model on N gloo processes (CUDA/NCCL with
``--device cuda``), runs two steps of the trainer's own step (a dense one, then a sparse one for
SCAPE, so every state buffer exists) and reports, per rank:

- ``optimizer_state_bytes``: the bytes of the tensors the optimizer holds (momentum, AdamW's v,
  SCAPE's staleness counters; not the parameters, which the model needs whole on every rank);
- ``residual_bytes``: SCAPE's residual, per rank and full-length sharded or not;
- ``allocated_bytes`` (CUDA only): torch.cuda.memory_allocated after the steps.

    python scripts/bench_optimizer_memory.py [--model tiny_llama] [--worlds 1 2 4] [--out file.json]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from typing import Dict, List

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from core.optim import build_optimizer  # noqa: E402
from core.sync import DenseAllReduce  # noqa: E402
from core.zero import ZeroDenseSynchronizer  # noqa: E402
from models import build_model, count_parameters, load_model_config  # noqa: E402
from scape.config import OptimizerConfig  # noqa: E402
from scape.sharded import ShardedScapeSynchronizer  # noqa: E402
from scape.synchronizer import ScapeSynchronizer  # noqa: E402
from trainer.step import train_step  # noqa: E402
from scripts.bench_io import emit_report, free_port  # noqa: E402

ARMS = ("adamw", "adamw_sharded", "adams", "adams_sharded", "scape99", "scape99_sharded")


def _build(arm: str, model: torch.nn.Module):
    name = arm.split("_")[0]
    cfg = OptimizerConfig(name="scape" if name.startswith("scape") else name, sparsity=0.99)
    if name.startswith("scape"):
        return (ShardedScapeSynchronizer if arm.endswith("_sharded") else ScapeSynchronizer)(model, cfg)
    if arm.endswith("_sharded"):
        return ZeroDenseSynchronizer(model, cfg)
    return DenseAllReduce(model, lambda params: build_optimizer(params, cfg))


def optimizer_state_bytes(optimizer) -> int:
    """The tensors an optimizer holds besides the parameters it updates."""
    if isinstance(optimizer, torch.optim.Optimizer):
        tensors = [t for state in optimizer.state.values() for t in state.values()
                   if isinstance(t, torch.Tensor)]
    else:  # scape.update.ScapeOptimizer: momentum, second_moment, last_sent, lr_sums
        tensors = [t for key, t in vars(optimizer).items() if isinstance(t, torch.Tensor) and key != "param"]
    return sum(t.numel() * t.element_size() for t in tensors)


def _worker(rank: int, world: int, port: int, model_name: str, device_kind: str, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    cuda = device_kind == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    cfg = load_model_config(model_name)
    rows = []
    for arm in ARMS:
        torch.manual_seed(0)
        model = build_model(cfg, device=device)
        sync = _build(arm, model)
        gen = torch.Generator().manual_seed(rank)
        for _ in range(2):
            tokens = torch.randint(0, cfg.vocab_size, (1, cfg.seq_len + 1), generator=gen)
            train_step(model, sync, iter([(tokens[:, :-1], tokens[:, 1:])]), 1, 1e-3, 1.0, sync.comm,
                       world, device=device)
        residual = getattr(sync, "residual", None)
        row = {"arm": arm, "world": world, "rank": rank,
               "optimizer_state_bytes": optimizer_state_bytes(sync.optimizer),
               "residual_bytes": 0 if residual is None else residual.numel * 4}
        if cuda:
            torch.cuda.synchronize(device)
            row["allocated_bytes"] = torch.cuda.memory_allocated(device)
        rows.append(row)
        del sync, model
        if cuda:
            torch.cuda.empty_cache()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(rows, f)
    dist.destroy_process_group()


def run(model_name: str, worlds: List[int], device_kind: str) -> List[Dict]:
    rows: List[Dict] = []
    for world in worlds:
        with tempfile.TemporaryDirectory() as out_dir:
            mp.start_processes(_worker, args=(world, free_port(), model_name, device_kind, out_dir),
                               nprocs=world, join=True, start_method="spawn")
            for rank in range(world):
                with open(os.path.join(out_dir, f"rank{rank}.json")) as f:
                    rows.extend(json.load(f))
    single = {r["arm"]: r["optimizer_state_bytes"] for r in rows if r["world"] == min(worlds)}
    for r in rows:  # the fraction of the smallest world's state this rank holds
        r["state_fraction"] = r["optimizer_state_bytes"] / single[r["arm"]] * min(worlds)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny_llama", help="a conf/model name")
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--out", default=None, help="also write the JSON here")
    args = parser.parse_args()
    numel = count_parameters(build_model(load_model_config(args.model), device="meta"))
    started = time.time()
    rows = run(args.model, args.worlds, args.device)
    result = {"model": args.model, "parameters": numel, "device": args.device,
              "host": platform.node(), "load_average": os.getloadavg(),
              "seconds": round(time.time() - started, 1),
              "per_rank_max": {f"{arm}@{world}": max(r["optimizer_state_bytes"] for r in rows
                                                    if r["arm"] == arm and r["world"] == world)
                               for arm in ARMS for world in args.worlds},
              "rows": rows}
    emit_report(result, args.out)


if __name__ == "__main__":
    main()
