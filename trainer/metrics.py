"""Metric sinks (console, JSONL, wandb) and the throughput arithmetic behind perf/*.

Metric names are grouped by prefix (train/, val/, perf/, comm/, scape/, sdp/, mem/) so a wandb
workspace lays itself out. Only rank 0 creates a MetricsLogger.
"""
from __future__ import annotations

import json
import math
import resource
import sys
from pathlib import Path
from typing import Any, Dict, Optional

import torch

from core.wandb_run import wandb_id, wandb_mode

# Dense bf16 tensor-core peaks (no sparsity), FLOP/s per device.
_PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "GH200": 989e12, "A100": 312e12, "L40S": 362e12,
              "A10G": 125e12, "L4": 121e12}


def peak_flops(device: torch.device) -> Optional[float]:
    """The device's dense bf16 peak, or None where MFU is not meaningful (CPU, unknown GPU)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key in sorted(_PEAK_BF16, key=len, reverse=True):  # GH200 before H200 before ...
        if key in name:
            return _PEAK_BF16[key]
    return None


def peak_memory_gib(device: torch.device) -> float:
    """Peak allocated bytes on the GPU, or this process's peak RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 2**30


class MetricsLogger:
    """Writes every logged step to ``metrics.jsonl`` (always), the console and wandb (if chosen)."""

    def __init__(self, run_dir: Path, logger_cfg, run_name: str, config: Dict[str, Any],
                 resumed: bool) -> None:
        self.console = logger_cfg.console
        self.jsonl = open(run_dir / "metrics.jsonl", "a", buffering=1)
        self.wandb = None
        mode = wandb_mode(logger_cfg.wandb)
        if mode != "disabled":
            import wandb

            # The run id is the run name so a resumed or requeued job continues the same curves.
            self.wandb = wandb.init(project=logger_cfg.project, entity=logger_cfg.entity,
                                    group=logger_cfg.group, name=run_name, id=wandb_id(run_name),
                                    resume="allow", dir=str(run_dir), mode=mode, config=config)
            print(f"wandb: mode {mode}, files in {run_dir / 'wandb'}", flush=True)

    def log(self, step: int, metrics: Dict[str, float]) -> None:
        record = {"step": step, **{k: _plain(v) for k, v in metrics.items()}}
        self.jsonl.write(json.dumps(record) + "\n")
        if self.wandb is not None:
            self.wandb.log(metrics, step=step)
        if self.console:
            print(format_line(step, metrics), flush=True)

    def summary(self, values: Dict[str, Any]) -> None:
        if self.wandb is not None:
            for k, v in values.items():
                self.wandb.summary[k] = v

    def close(self) -> None:
        self.jsonl.close()
        if self.wandb is not None:
            self.wandb.finish()


def _plain(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)  # JSON has no NaN; keep it readable
    return v


_CONSOLE_KEYS = [("train/loss", "loss {:.4f}"), ("val/loss", "val {:.4f}"), ("train/lr", "lr {:.2e}"),
                 ("train/grad_norm", "gnorm {:.3f}"), ("perf/tokens_per_s", "tok/s {:,.0f}"),
                 ("perf/tflops_per_device", "TFLOP/s {:.2f}"), ("perf/mfu", "MFU {:.1%}"),
                 ("mem/peak_gib", "mem {:.2f}GiB"), ("comm/compression", "comm x{:.1f}")]


def format_line(step: int, metrics: Dict[str, float]) -> str:
    parts = [f"step {step:>6}"]
    for key, fmt in _CONSOLE_KEYS:
        if key in metrics and metrics[key] is not None:
            try:
                parts.append(fmt.format(float(metrics[key])))
            except (TypeError, ValueError):
                parts.append(f"{key} {metrics[key]}")
    if "perf/step_time_s" in metrics:
        parts.append("time " + "/".join(f"{metrics.get(f'perf/time_{k}_s', 0.0) * 1e3:.0f}"
                                        for k in ("data", "fwd_bwd", "comm", "opt")) + " ms (data/fb/comm/opt)")
    return " | ".join(parts)


def print_main(env_is_main: bool, *args: Any) -> None:
    if env_is_main:
        print(*args, flush=True, file=sys.stdout)


class MetricsProcessor:
    """Turns each step's result into the train/, perf/, mem/, comm/ and synchroniser metrics and
    logs them every ``log_every`` steps (and at the first and last step). It also keeps the run's
    byte total, which every rank counts (checkpoints and the summary record it)."""

    def __init__(self, logger: Optional[MetricsLogger], sync, comm, log_every: int, start_step: int,
                 total_steps: int, tokens_per_step: int, flops_per_token: float, world_size: int,
                 device: torch.device, dense_bytes: float, bytes_cumulative: float = 0.0) -> None:
        self.logger, self.sync, self.counter = logger, sync, comm.counter
        self.log_every, self.start_step, self.total_steps = log_every, start_step, total_steps
        self.tokens_per_step, self.flops_per_token, self.world_size = tokens_per_step, flops_per_token, world_size
        self.device, self.peak, self.dense_bytes = device, peak_flops(device), dense_bytes
        self.bytes_cumulative = bytes_cumulative

    def due(self, step: int) -> bool:
        return step % self.log_every == 0 or step == self.start_step + 1 or step == self.total_steps

    def record(self, step: int, lr: float, result, skipped: int) -> None:
        bytes_step = self.counter.total()
        self.bytes_cumulative += bytes_step
        if self.logger is not None and self.due(step):
            self.logger.log(step, self.step_metrics(step, lr, result, skipped, bytes_step))

    def step_metrics(self, step: int, lr: float, result, skipped: int, bytes_step: float) -> Dict[str, Any]:
        tflops = self.flops_per_token * self.tokens_per_step / result.time_step / self.world_size / 1e12
        metrics: Dict[str, Any] = {
            "train/loss": result.loss, "train/lr": lr, "train/grad_norm": result.grad_norm,
            "train/tokens": step * self.tokens_per_step, "train/skipped_steps": skipped,
            "perf/tokens_per_s": self.tokens_per_step / result.time_step, "perf/tflops_per_device": tflops,
            "perf/step_time_s": result.time_step, "perf/time_data_s": result.time_data,
            "perf/time_fwd_bwd_s": result.time_fwd_bwd, "perf/time_comm_s": result.time_comm,
            "perf/time_opt_s": result.time_opt,
            "mem/peak_gib": peak_memory_gib(self.device),
            "comm/bytes_total": bytes_step, "comm/bytes_cumulative": self.bytes_cumulative,
            "comm/compression": self.dense_bytes / bytes_step if bytes_step else float("inf"),
        }
        if self.peak:
            metrics["perf/mfu"] = tflops * 1e12 / self.peak
        metrics.update({f"comm/bytes_{k}": v for k, v in self.counter.bytes.items()})
        metrics.update(self.sync.metrics())
        return metrics

    def log(self, step: int, metrics: Dict[str, Any]) -> None:
        if self.logger is not None:
            self.logger.log(step, metrics)
