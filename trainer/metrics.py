"""Metric names, sinks (console, JSONL, wandb) and the throughput arithmetic behind perf/*.

Metric names are grouped by prefix (train/, val/, perf/, comm/, scape/, sdp/, mem/, eval/) so a
wandb workspace lays itself out. ``METRICS`` and ``METRIC_FAMILIES`` are the one list of what a run
logs: the dashboard (scripts/dashboard.py) draws its panels from it, and tests check it against
what real runs write. Only rank 0 creates a MetricsLogger.
"""
from __future__ import annotations

import fnmatch
import json
import math
import resource
import sys
import time
from pathlib import Path
from typing import Any, Dict, Optional

import torch

from core.wandb_run import ensure_run_id, grouping, provenance, rewind_point, wandb_mode
from trainer.noise_scale import NoiseScaleMeter

# Every metric a run can log, with what it is. The synchronisers' own metrics (scape/, sdp/) are
# listed here too, so the dashboard and the tests know them; tests/scripts/test_dashboard.py
# checks both directions against real runs.
METRICS: Dict[str, str] = {
    "train/loss": "training loss of the step (mean over ranks and micro-batches)",
    "train/lr": "learning rate of the step",
    "train/grad_norm": "global gradient norm before clipping",
    "train/noise_scale": "simple gradient noise scale tr(Sigma) / |G|^2 in tokens, over the steps since the last log "
                         "(trainer/noise_scale.py; needs 2+ micro-batches a step)",
    "train/tokens": "tokens trained on so far (all ranks)",
    "train/skipped_steps": "non-finite steps skipped so far",
    "val/loss": "validation loss",
    "val/perplexity": "exp(validation loss)",
    "perf/tokens_per_s": "tokens per second, all ranks",
    "perf/tflops_per_device": "model TFLOP/s per device",
    "perf/mfu": "model FLOP utilisation against the dense bf16 peak (train.peak_tflops or the GPU table)",
    "perf/step_time_s": "wall time of the step",
    "perf/time_data_s": "step time waiting for data",
    "perf/time_fwd_bwd_s": "step time in forward and backward",
    "perf/time_comm_s": "step time in gradient synchronisation",
    "perf/time_opt_s": "step time in the optimizer",
    "mem/peak_gib": "peak GPU memory (CPU: peak RSS) per worker",
    "comm/bytes_total": "bytes this rank sent in the step",
    "comm/bytes_cumulative": "bytes this rank sent so far in the optimizer steps",
    "comm/bytes_outside_steps": "bytes this rank sent so far outside the steps (the copies' average for "
                                "validation and checkpoints; sparse averaging only)",
    "comm/compression": "a dense fp32 all-reduce's bytes over the bytes sent",
    "scape/density": "fraction of the moment sent",
    "scape/dense_step": "1 on dense (warm-up) steps",
    "scape/residual_norm": "norm of the error-feedback residual",
    "scape/mask_overlap": "fraction of this rank's mask the next mask keeps",
    "sdp/coverage": "SDP coverage C",
    "sdp/params_held": "parameters one worker holds",
    "sdp/params_held_fraction": "parameters one worker holds, as a fraction of the model",
    "sdp/buckets": "holder-group buckets",
    "eval/step": "checkpoint step of a downstream evaluation",
}
# Families whose members depend on the run (communication kinds, tasks, SCAPE's timers).
METRIC_FAMILIES: Dict[str, str] = {
    "comm/bytes_*": "bytes this rank sent in the step, by kind (grad_allreduce, scape_values, ...)",
    "scape/time_*_s": "SCAPE's own timers (topk, pack, wait)",
    "eval/*": "downstream task scores, eval/<task>/<metric>",
}
# Logged with every record (steps, validation, downstream scores), so any metric can be plotted
# against tokens or against bytes sent.
AXES = ("train/tokens", "comm/bytes_cumulative")


def is_known_metric(name: str) -> bool:
    return name in METRICS or any(fnmatch.fnmatchcase(name, pattern) for pattern in METRIC_FAMILIES)


# Dense bf16 tensor-core peaks (no sparsity), FLOP/s per device.
_PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "GH200": 989e12, "A100": 312e12, "L40S": 362e12,
              "A10G": 125e12, "L4": 121e12}


def peak_flops(device: torch.device, peak_tflops: Optional[float] = None) -> Optional[float]:
    """The device's dense bf16 peak (``peak_tflops`` when given), or None where MFU is not
    meaningful (CPU, unknown GPU)."""
    if peak_tflops is not None:
        return peak_tflops * 1e12
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


def _clock(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


class Progress:
    """Elapsed time and ETA for the log lines; on a terminal also a live bar between them.

    Not on a terminal (Slurm logs, CI, pipes) there is no bar: the log lines, with elapsed and ETA,
    are the whole output. The ETA is the mean step time of this job since its first step (which
    pays for compilation and warm-up) times the steps left."""

    def __init__(self, start_step: int, total_steps: int, stream=None) -> None:
        self.stream = stream if stream is not None else sys.stdout
        self.start_step, self.total_steps = start_step, total_steps
        self.t0 = time.time()
        self.first: Optional[tuple] = None  # (step, time) at the end of this job's first step
        self.bar = None
        if getattr(self.stream, "isatty", lambda: False)():
            from tqdm import tqdm

            self.bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True,
                            leave=False, file=sys.stderr)

    def advance(self, step: int) -> None:
        now = time.time()
        if self.first is None:
            self.first = (step, now)
        if self.bar is not None:
            self.bar.update(step - self.bar.n)

    def eta_s(self, step: int) -> Optional[float]:
        if self.first is None or step <= self.first[0]:
            return None
        per_step = (time.time() - self.first[1]) / (step - self.first[0])
        return per_step * (self.total_steps - step)

    def timing(self, step: int) -> str:
        eta = self.eta_s(step)
        return f"elapsed {_clock(time.time() - self.t0)} eta {_clock(eta) if eta is not None else '?'}"

    def write(self, line: str) -> None:
        if self.bar is not None:
            self.bar.write(line, file=self.stream)
        else:
            print(line, file=self.stream, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


class MetricsLogger:
    """Writes every logged step to ``metrics.jsonl`` (always), the console and wandb (if chosen).

    The wandb run is the run folder's (core/wandb_run.py): its id is drawn at the first start and
    reused on every resume. A resume that re-logs steps wandb already has (a crash after the last
    checkpoint) rewinds the wandb run to the first of them, so its curve has no gap and no
    duplicate."""

    def __init__(self, run_dir: Path, logger_cfg, run_name: str, config: Dict[str, Any],
                 start_step: int = 0, logged_through: int = 0, total_steps: int = 0) -> None:
        self.console = logger_cfg.console
        self.progress = Progress(start_step, total_steps) if self.console else None
        self.jsonl = open(run_dir / "metrics.jsonl", "a", buffering=1)
        self.run_id = ensure_run_id(run_dir)
        self.wandb = None
        self.wandb_note = "disabled"
        mode = wandb_mode(logger_cfg.wandb)
        if mode != "disabled":
            self.wandb = self._init_wandb(run_dir, logger_cfg, run_name, config, mode,
                                          rewind_point(self.run_id, start_step, logged_through))

    def _init_wandb(self, run_dir: Path, logger_cfg, run_name: str, config: Dict[str, Any], mode: str,
                    rewind: Optional[str]):
        import wandb

        group, tags = grouping(config)
        kwargs = dict(project=logger_cfg.project, entity=logger_cfg.entity, group=group, job_type="train",
                      tags=tags, name=run_name, id=self.run_id, dir=str(run_dir), mode=mode,
                      config={**config, "provenance": provenance()})
        run = None
        if rewind is not None:
            try:
                run = wandb.init(resume_from=rewind, **kwargs)
                print(f"wandb: rewound run {self.run_id} to {rewind.split('?')[1]} (the steps after the "
                      f"checkpoint are logged again)", flush=True)
            except Exception as exc:  # noqa: BLE001 - rewind is a server feature not every entity has
                print(f"wandb: could not rewind run {self.run_id} ({type(exc).__name__}: {exc}); resuming it "
                      f"instead: wandb keeps its points after the checkpoint and drops the re-logged ones "
                      f"(metrics.jsonl has the run's true record)", flush=True)
        if run is None:
            run = wandb.init(resume="allow", **kwargs)
        self.wandb_note = run.url if mode == "online" and run.url else \
            f"{mode}, id {self.run_id}, files in {run_dir / 'wandb'}"
        print(f"wandb: {self.wandb_note}", flush=True)
        return run

    def advance(self, step: int) -> None:
        if self.progress is not None:
            self.progress.advance(step)

    def log(self, step: int, metrics: Dict[str, float]) -> None:
        record = {"step": step, **{k: _plain(v) for k, v in metrics.items()}}
        self.jsonl.write(json.dumps(record) + "\n")
        if self.wandb is not None:
            self.wandb.log(metrics, step=step)
        if self.progress is not None:
            self.progress.write(format_line(step, metrics) + " | " + self.progress.timing(step))

    def summary(self, values: Dict[str, Any]) -> None:
        """The run's final numbers: wandb's run summary and, on the console, a table."""
        if self.wandb is not None:
            for k, v in values.items():
                if isinstance(v, (int, float)):
                    self.wandb.summary[k] = v
        if self.progress is not None:
            self.progress.close()
            print(format_summary({**values, "wandb": self.wandb_note}), flush=True)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.close()
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


def format_summary(summary: Dict[str, Any]) -> str:
    """The run's summary (Trainer.summary) as a two-column table for the end of the console log."""
    def number(key: str, fmt: str) -> Optional[str]:
        value = summary.get(key)
        return None if value is None else fmt.format(value)

    sent, dense = summary.get("bytes_sent_per_rank"), summary.get("dense_bytes_per_rank")
    rows = [
        ("state", summary.get("state")),
        ("steps", f"{summary.get('step')} / {summary.get('steps_total')}"),
        ("final val loss", number("final_val_loss", "{:.4f}")),
        ("best val loss", number("best_val_loss", "{:.4f}")),
        ("wall time", _clock(summary["wall_time_s"]) if summary.get("wall_time_s") is not None else None),
        ("bytes sent / rank", f"{sent / 1e9:.3f} GB ({sent / dense:.1%} of dense)" if sent is not None and dense
         else number("bytes_sent_per_rank", "{:.0f}")),
        ("parameters", number("parameters", "{:,}")),
        ("skipped steps", summary.get("skipped_steps")),
        ("checkpoint", summary.get("checkpoint")),
        ("run files", summary.get("run_dir")),
        ("wandb", summary.get("wandb")),
    ]
    rows = [(k, str(v)) for k, v in rows if v is not None]
    width = max(len(k) for k, _ in rows)
    rule = "-" * (width + 2 + max(len(v) for _, v in rows))
    return "\n".join([rule, *(f"{k:<{width}}  {v}" for k, v in rows), rule])


def print_main(env_is_main: bool, *args: Any) -> None:
    if env_is_main:
        print(*args, flush=True, file=sys.stdout)


class MetricsProcessor:
    """Turns each step's result into the train/, perf/, mem/, comm/ and synchroniser metrics and
    logs them every ``log_every`` steps (and at the first and last step). It also keeps the run's
    byte total, which every rank counts (checkpoints and the summary record it)."""

    def __init__(self, logger: Optional[MetricsLogger], sync, comm, log_every: int, start_step: int,
                 total_steps: int, tokens_per_step: int, flops_per_token: float, world_size: int,
                 device: torch.device, dense_bytes: float, bytes_cumulative: float = 0.0,
                 peak_tflops: Optional[float] = None, bytes_outside_steps: float = 0.0) -> None:
        self.logger, self.sync, self.counter = logger, sync, comm.counter
        self.log_every, self.start_step, self.total_steps = log_every, start_step, total_steps
        self.tokens_per_step, self.flops_per_token, self.world_size = tokens_per_step, flops_per_token, world_size
        self.device, self.peak, self.dense_bytes = device, peak_flops(device, peak_tflops), dense_bytes
        self.bytes_cumulative = bytes_cumulative
        self.bytes_outside_steps = bytes_outside_steps
        self.noise_scale = NoiseScaleMeter()

    def due(self, step: int) -> bool:
        return step % self.log_every == 0 or step == self.start_step + 1 or step == self.total_steps

    def record(self, step: int, lr: float, result, skipped: int) -> None:
        """Right after ``step``: what the counter holds is the step's. It is cleared here, so what
        it holds at the next step's start was sent outside the steps (``count_outside_steps``)."""
        bytes_step = self.counter.total()
        self.bytes_cumulative += bytes_step
        self.noise_scale.add(result.device_values[5], result.device_values[6], *result.noise_batch_sizes)
        if self.logger is not None:
            self.logger.advance(step)
            if self.due(step):
                self.logger.log(step, self.step_metrics(step, lr, result, skipped, bytes_step))
        self.counter.reset()

    def count_outside_steps(self) -> None:
        """Add what was sent since the last step (validation, checkpoints) to its own total: the
        per-step bytes stay comparable across optimizers, and the run's total is still all of it."""
        self.bytes_outside_steps += self.counter.total()
        self.counter.reset()

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
            "comm/bytes_outside_steps": self.bytes_outside_steps,
            "comm/compression": self.dense_bytes / bytes_step if bytes_step else float("inf"),
        }
        if self.peak:
            metrics["perf/mfu"] = tflops * 1e12 / self.peak
        noise_scale = self.noise_scale.take()
        if noise_scale is not None:
            metrics["train/noise_scale"] = noise_scale
        metrics.update({f"comm/bytes_{k}": v for k, v in self.counter.bytes.items()})
        metrics.update(self.sync.metrics())
        return metrics

    def log(self, step: int, metrics: Dict[str, Any]) -> None:
        """Other metrics of ``step`` (validation, downstream scores), with the x-axes (AXES)."""
        if self.logger is not None:
            axes = dict(zip(AXES, (step * self.tokens_per_step, self.bytes_cumulative)))
            self.logger.log(step, {**axes, **metrics})
