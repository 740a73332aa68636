"""Checkpoint write time and bytes per rank against the world size (gloo ranks on this machine).

    python scripts/bench_checkpoint.py [--model tiny_llama] [--worlds 1 2 4] [--optimizer scape]
                                       [--repeats 3] [--dir DIR]

Each world size runs as its own group of gloo processes (torch.multiprocessing, as torchrun would
start them). Every rank builds the same model and synchroniser (``trainer.parts``, so the
checkpoint holds what a training run's does), gives SCAPE's residual non-zero values (a residual
of zeros would compress in no file system but is still not what a run writes), and calls the
trainer's own ``save_checkpoint`` ``--repeats`` times into ``--dir`` (default: a temporary folder
on this machine's disk). The time is the slowest rank's, barrier to barrier, median over repeats;
the bytes are those of the files each rank wrote. Prints one JSON object, with the machine's load
average, since other jobs share the CPUs and the disk.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from core.checkpoint import MODEL_FILE, rank_file  # noqa: E402
from core.distributed import DistEnv  # noqa: E402
from trainer.checkpoint import OPTIMIZER_FILE, replicated_writer, save_checkpoint  # noqa: E402
from scripts.bench_io import emit_report, free_port  # noqa: E402


def _files_of(rank: int, world: int) -> List[str]:
    """The files rank ``rank`` writes (trainer/checkpoint.py's division of the work)."""
    files = [rank_file(rank)]
    if rank == 0:
        files.append(MODEL_FILE)
    if rank == replicated_writer(world):
        files.append(OPTIMIZER_FILE)
    return files


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    if world > 1:
        dist.init_process_group("gloo", rank=rank, world_size=world)
    from hydra import compose, initialize_config_dir

    from core.comm import Collectives
    from trainer.config import register_configs, to_config
    from trainer.parts import build_synchronizer

    register_configs()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = to_config(compose(config_name="config", overrides=[f"model={args.model}",
                                                                 f"optimizer={args.optimizer}"]))
    sync = build_synchronizer(cfg, torch.device("cpu"), Collectives())
    if hasattr(sync, "residual"):
        sync.residual.storage.normal_(generator=torch.Generator().manual_seed(rank))
    env = DistEnv(rank=rank, world_size=world, local_rank=rank, device=torch.device("cpu"))
    run_dir = Path(args.dir) / f"world{world}"
    if rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
    times = []
    for repeat in range(args.repeats):
        if world > 1:
            dist.barrier()
        start = time.perf_counter()
        save_checkpoint(run_dir, repeat + 1, sync, env, {"bench": True}, keep_last=1)
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        if world > 1:
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        times.append(float(elapsed))
    final = run_dir / f"step-{args.repeats}"
    written = sum((final / name).stat().st_size for name in _files_of(rank, world))
    sizes = [None] * world
    if world > 1:
        dist.all_gather_object(sizes, written)
    else:
        sizes = [written]
    if rank == 0:
        Path(out).write_text(json.dumps({"world_size": world, "write_s_median": statistics.median(times),
                                         "write_s": times, "bytes_per_rank": sizes, "rank0_bytes": sizes[0],
                                         "checkpoint_bytes": sum(sizes)}))
    if world > 1:
        dist.destroy_process_group()


def main(argv: List[str] | None = None) -> Dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny_llama")
    parser.add_argument("--optimizer", default="scape", choices=["scape", "adams", "adamw", "sparse_avg"])
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary folder)")
    args = parser.parse_args(argv)
    if args.repeats < 1 or any(w < 1 for w in args.worlds):
        parser.error("--repeats and every --worlds value must be positive")
    with tempfile.TemporaryDirectory(prefix="bench_checkpoint_") as tmp:
        args.dir = args.dir or tmp
        results = []
        for world in args.worlds:
            out = Path(tmp) / f"result{world}.json"
            mp.start_processes(_worker, args=(world, free_port(), args, str(out)), nprocs=world, join=True,
                               start_method="spawn")
            results.append(json.loads(out.read_text()))
    report = {"model": args.model, "optimizer": args.optimizer, "repeats": args.repeats,
              "load_average": os.getloadavg(), "cpus": os.cpu_count(), "results": results}
    emit_report(report, indent=2)
    return report


if __name__ == "__main__":
    main()
