"""Measured per-worker peak memory and bytes all-reduced per step: DDP against B-SDP and N-SDP.

    python scripts/bench_sdp.py [--workers 4] [--coverage 0.5] [--device cpu|cuda] [--out FILE]

Every case runs ``--workers`` real ranks (gloo; on CUDA all ranks share the one GPU, each with its
own allocator) for ``--steps`` optimizer steps of a small Llama, through the same code the trainer
runs (``sdp.build_synchronizer`` / ``DenseAllReduce``). Cases: DDP, B-SDP and N-SDP at coverage C,
forward and backward masking, each with and without activation checkpointing.

Memory method, printed with the results:
  - CPU, ``peak_bytes``: peak live tensor bytes per rank, from the model's build to the last step:
    a dispatch mode counts every tensor storage the CPU allocator hands out until it is freed
    (parameters, gradients, buckets, optimizer state, activations, temporaries).
  - CPU, ``peak_rss_delta_bytes``: peak RSS delta per rank. Each case's ranks are fresh processes
    forked from this idle parent; after a warm-up step a rank resets its RSS high-water mark
    (``/proc/self/clear_refs`` = 5), so the figure excludes the interpreter, torch and kernels but
    includes allocator slack (glibc keeps freed heap) and non-tensor memory.
  - CUDA: ``torch.cuda.max_memory_allocated`` per rank (ranks share the GPU, each its own allocator).
Bytes are the trainer's counted collectives (core/comm.py: ring all-reduce bytes sent per rank).
"""
from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import platform
import sys
import time
import traceback
import weakref
from pathlib import Path
from typing import Any, Dict, List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_flatten  # noqa: E402

import sdp  # noqa: E402,F401  (imported before ranks fork, so no import lands in a measurement)
from models import build_model, count_parameters  # noqa: E402
from models.config import ModelConfig  # noqa: E402
from scape.config import OptimizerConfig  # noqa: E402
from scape.synchronizer import ScapeSynchronizer  # noqa: E402
from sdp.config import SDPConfig  # noqa: E402
from sdp.layout import meta_full_model  # noqa: E402
from core.sync import DenseAllReduce  # noqa: E402
from core.optim import build_optimizer  # noqa: E402
from trainer.step import train_step  # noqa: E402
from scripts.bench_io import emit_report, free_port  # noqa: E402

SMALL_LLAMA = dict(name="bench_llama", family="llama", n_layer=8, n_head=4, n_kv_head=4, d_model=128,
                   ffn_hidden=384, vocab_size=1024, seq_len=128)


class LiveTensorBytes(TorchDispatchMode):
    """Peak bytes of live tensor storages created while active: what the CPU allocator hands out.

    Every op's output storage is counted once when first seen and uncounted when its storage
    is freed (a finaliser on the storage object, which torch keeps alive as long as the storage).
    """

    def __init__(self) -> None:
        super().__init__()
        self.live: Dict[Any, int] = {}
        self.current = 0
        self.peak = 0

    def _free(self, key: Any) -> None:
        self.current -= self.live.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and not t.is_meta:
                storage = t.untyped_storage()
                key = (storage.data_ptr(), id(storage))
                if storage.nbytes() and key not in self.live:
                    self.live[key] = storage.nbytes()
                    self.current += storage.nbytes()
                    self.peak = max(self.peak, self.current)
                    weakref.finalize(storage, self._free, key)
        return out


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def _rank(rank: int, world: int, port: int, case: Dict[str, Any], model_fields: Dict[str, Any],
          args: Dict[str, Any], results) -> None:
    try:
        import torch.distributed as dist

        torch.set_num_threads(args["threads"])
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world)
        device = torch.device("cuda" if args["device"] == "cuda" else "cpu")
        results.put((rank, _measure(rank, world, case, ModelConfig(**model_fields), args, device)))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - the parent prints it
        results.put((rank, {"error": traceback.format_exc()}))


def _warm_up(device: torch.device) -> None:
    """One tiny forward/backward/collective, so kernels, thread pools and gloo buffers are loaded
    before the measurement starts (they are the same for every case)."""
    import torch.distributed as dist

    warm_cfg = ModelConfig(name="warm", n_layer=1, n_head=2, d_model=16, ffn_hidden=32, vocab_size=32, seq_len=8)
    model = build_model(warm_cfg, device=device)
    x = torch.randint(0, 32, (2, 9), device=device)
    model(x[:, :-1], x[:, 1:]).backward()
    dist.all_reduce(torch.ones(4, device=device))
    del model


def _measure(rank: int, world: int, case: Dict[str, Any], cfg: ModelConfig, args: Dict[str, Any],
             device: torch.device) -> Dict[str, Any]:
    import gc

    opt_cfg = OptimizerConfig(name=args["optimizer"], lr=1e-3, sparsity=args["sparsity"])
    _warm_up(device)
    gc.collect()
    tracker = LiveTensorBytes() if device.type == "cpu" else None
    if device.type == "cuda":
        torch.cuda.set_device(0)
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        Path("/proc/self/clear_refs").write_text("5")  # reset the RSS high-water mark
        base = _status_kib("VmRSS") * 1024
    if tracker is not None:
        tracker.__enter__()
    torch.manual_seed(0)
    if case["kind"] == "ddp":
        model = build_model(cfg, device=device)
        sync = ScapeSynchronizer(model, opt_cfg) if opt_cfg.name == "scape" else \
            DenseAllReduce(model, lambda params: build_optimizer(params, opt_cfg))
    else:
        sdp_cfg = SDPConfig(kind=case["kind"], coverage=args["coverage"], masking=case["masking"],
                            groups_per_block=args["groups_per_block"])
        model, sync = sdp.build_synchronizer(cfg, sdp_cfg, opt_cfg, world, rank, device)
    model.set_activation_checkpointing(case["checkpointing"])
    gen = torch.Generator().manual_seed(1000 + rank)
    step_bytes: List[Dict[str, float]] = []
    times = []
    sync.zero_grad()
    for _ in range(args["steps"]):
        sync.comm.counter.reset()
        x = torch.randint(0, cfg.vocab_size, (args["micro_batch"], cfg.seq_len + 1), generator=gen).to(device)
        t0 = time.perf_counter()
        # read(): wait for the step's end (the step itself does not wait for the GPU)
        train_step(model, sync, iter([(x[:, :-1], x[:, 1:])]), 1, 1e-3, 1.0, sync.comm, world, device=device).read()
        times.append(time.perf_counter() - t0)
        # the gradient synchroniser's bytes; the trainer's 24-byte control all-reduce aside
        step_bytes.append({k: v for k, v in sync.comm.counter.bytes.items() if k != "control"})
    if tracker is not None:
        tracker.__exit__(None, None, None)
    if device.type == "cuda":
        peak = rss_peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = tracker.peak
        rss_peak = _status_kib("VmHWM") * 1024 - base
    return {"peak_bytes": int(peak), "peak_rss_delta_bytes": int(rss_peak),
            "params_allocated": count_parameters(model),
            "bytes_per_step": step_bytes[-1], "step_time_s": min(times)}


def run_case(case: Dict[str, Any], model_fields: Dict[str, Any], args: Dict[str, Any]) -> Dict[str, Any]:
    ctx = mp.get_context("fork" if args["device"] == "cpu" else "spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, args["workers"], port, case, model_fields, args, results))
             for r in range(args["workers"])]
    for p in procs:
        p.start()
    per_rank = dict(results.get(timeout=1800) for _ in procs)
    for p in procs:
        p.join()
    errors = [v["error"] for v in per_rank.values() if "error" in v]
    if errors:
        raise RuntimeError(f"case {case} failed:\n{errors[0]}")
    ranks = [per_rank[r] for r in range(args["workers"])]
    sent = [sum(r["bytes_per_step"].values()) for r in ranks]
    return {**case, "peak_bytes_per_worker": [r["peak_bytes"] for r in ranks],
            "peak_bytes_max": max(r["peak_bytes"] for r in ranks),
            "peak_rss_delta_bytes_max": max(r["peak_rss_delta_bytes"] for r in ranks),
            "params_allocated_per_worker": [r["params_allocated"] for r in ranks],
            "allreduce_bytes_per_step_max": max(sent),
            "bytes_per_step_by_kind_rank0": ranks[0]["bytes_per_step"],
            "step_time_s_max": max(r["step_time_s"] for r in ranks)}


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--coverage", type=float, default=0.5)
    parser.add_argument("--groups-per-block", type=int, default=4)
    parser.add_argument("--steps", type=int, default=2, help="optimizer steps (>= 2: the peak comes "
                        "once optimizer state exists)")
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--optimizer", default="adamw", choices=["adamw", "adams", "scape"],
                        help="scape: plain SCAPE for the ddp case, SCAPE inside each holder group for "
                        "B-SDP (neuron SDP refuses it: --only ddp,bsdp_forward,bsdp_backward)")
    parser.add_argument("--sparsity", type=float, default=0.9, help="SCAPE's (with --optimizer scape)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--model", default=None,
                        help="JSON of ModelConfig fields overriding the small Llama, e.g. '{\"d_model\": 256}'")
    parser.add_argument("--only", default=None, help="comma-separated case names to run")
    parser.add_argument("--out", default=None, help="also write the JSON here")
    ns = parser.parse_args(argv)
    args = vars(ns)
    model_fields = dict(SMALL_LLAMA, **(json.loads(ns.model) if ns.model else {}))
    cases = [{"name": "ddp", "kind": "ddp", "masking": "-", "checkpointing": False}]
    for kind, label in (("block", "bsdp"), ("neuron", "nsdp")):
        for masking in ("forward", "backward"):
            cases.append({"name": f"{label}_{masking}", "kind": kind, "masking": masking, "checkpointing": False})
    cases += [dict(c, name=c["name"] + "_ckpt", checkpointing=True) for c in list(cases)]
    if ns.only:
        wanted = set(ns.only.split(","))
        cases = [c for c in cases if c["name"] in wanted]
    results = []
    for case in cases:
        res = run_case(case, model_fields, args)
        results.append(res)
        print(f"{case['name']:<22} peak {res['peak_bytes_max'] / 2**20:8.1f} MiB (RSS delta "
              f"{res['peak_rss_delta_bytes_max'] / 2**20:.1f})  "
              f"all-reduced {res['allreduce_bytes_per_step_max'] / 2**20:7.2f} MiB/step", file=sys.stderr)
    for res in results:  # ratios against DDP with the same activation checkpointing
        base = next((r for r in results if r["kind"] == "ddp" and r["checkpointing"] == res["checkpointing"]), None)
        if base:
            res["peak_vs_ddp"] = res["peak_bytes_max"] / base["peak_bytes_max"]
            res["peak_rss_delta_vs_ddp"] = res["peak_rss_delta_bytes_max"] / base["peak_rss_delta_bytes_max"]
            res["allreduce_vs_ddp"] = res["allreduce_bytes_per_step_max"] / base["allreduce_bytes_per_step_max"]
    bsdp = next((r for r in results if r["name"] == "bsdp_forward"), None)
    report = {
        "benchmark": "bench_sdp",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"host": platform.node(), "platform": platform.platform(), "cpus": os.cpu_count(),
                    "torch": torch.__version__,
                    "gpu": torch.cuda.get_device_name(0) if ns.device == "cuda" else None},
        "command": "python scripts/bench_sdp.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "memory_method": ("torch.cuda.max_memory_allocated per rank (ranks share one GPU, separate allocators)"
                          if ns.device == "cuda" else
                          "peak_bytes: peak live tensor bytes per rank from model build to the last step "
                          "(every tensor storage the CPU allocator hands out, counted by a dispatch mode "
                          "until freed); peak_rss_delta_bytes: VmHWM after the steps minus VmRSS when the "
                          "high-water mark was reset (/proc/self/clear_refs=5) just before the build, after "
                          "a warm-up step (includes allocator slack and non-tensor memory)"),
        "bytes_method": "core.comm counted collectives: ring all-reduce bytes sent per rank per step "
                        "(gradients, the clip norm scalar, backward masking's refresh broadcasts)",
        "model": model_fields, "params_full": count_parameters(meta_full_model(ModelConfig(**model_fields))),
        "workers": ns.workers, "coverage": ns.coverage, "groups_per_block": ns.groups_per_block,
        "micro_batch": ns.micro_batch, "steps": ns.steps, "optimizer": ns.optimizer,
        "sparsity": ns.sparsity if ns.optimizer == "scape" else None,
        "target": {"bsdp_forward_peak_vs_ddp_max": 0.6,
                   "met": bool(bsdp and bsdp.get("peak_vs_ddp", 1.0) <= 0.6)},
        "results": results,
    }
    emit_report(report, ns.out, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
