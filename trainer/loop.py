"""The training loop: one readable function from config to a trained, checkpointed model.

nanoGPT's shape (fetch the next batch, forward, backward, step) with torchtitan's services
(step-N checkpoints with auto-resume, throughput / MFU / memory in every log line). The loop
does not know which gradient synchroniser runs: dense all-reduce, SCAPE and SDP all sit behind
trainer.grad_sync.GradientSynchronizer.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Dict, Optional

import torch
from omegaconf import DictConfig, OmegaConf

from trainer import comm
from trainer.checkpoint import CheckpointError, latest_checkpoint, load_checkpoint, read_meta, save_checkpoint
from trainer.distributed import DistEnv, barrier, broadcast_object, init_distributed, shutdown
from trainer.metrics import MetricsLogger, peak_flops, peak_memory_gib
from trainer.parts import build_model_and_sync
from trainer.schedule import lr_at


class ConfigError(ValueError):
    """A config value that cannot work; the message names the key and the fix."""


class RankZeroError(RuntimeError):
    """An error rank 0 met in work done for all ranks (e.g. data preparation), re-raised everywhere."""


def accumulation_steps(global_batch_tokens: int, micro_batch_size: int, seq_len: int, world_size: int) -> int:
    """Micro-batches per rank per optimizer step, from a token-denominated global batch (OLMo)."""
    if global_batch_tokens <= 0 or micro_batch_size <= 0:
        raise ConfigError("train.global_batch_tokens and train.micro_batch_size must be positive")
    per_micro = micro_batch_size * seq_len * world_size
    if global_batch_tokens % per_micro:
        lower = max(per_micro, global_batch_tokens // per_micro * per_micro)
        raise ConfigError(
            f"train.global_batch_tokens={global_batch_tokens} is not a multiple of "
            f"micro_batch_size x seq_len x world_size = {micro_batch_size} x {seq_len} x {world_size} "
            f"= {per_micro}; use e.g. train.global_batch_tokens={lower} or {lower + per_micro}, "
            f"or change train.micro_batch_size")
    return global_batch_tokens // per_micro


def validate(cfg: DictConfig) -> None:
    t = cfg.train
    for key, value in (("train.steps", t.steps), ("train.log_every", t.log_every),
                       ("train.eval_batches", t.eval_batches), ("model.seq_len", cfg.model.seq_len)):
        if value <= 0:
            raise ConfigError(f"{key} must be positive, got {value}")
    for key, value in (("train.eval_every", t.eval_every), ("train.ckpt_every", t.ckpt_every),
                       ("train.keep_last", t.keep_last), ("optimizer.warmup_steps", cfg.optimizer.warmup_steps)):
        if value < 0:
            raise ConfigError(f"{key} must be >= 0, got {value}")
    if not (cfg.optimizer.lr > 0 and math.isfinite(cfg.optimizer.lr)):
        raise ConfigError(f"optimizer.lr must be a positive number, got {cfg.optimizer.lr}")
    if not 0 <= cfg.optimizer.min_lr_ratio <= 1:
        raise ConfigError(f"optimizer.min_lr_ratio must lie in [0, 1], got {cfg.optimizer.min_lr_ratio}")
    if cfg.optimizer.grad_clip < 0:
        raise ConfigError(f"optimizer.grad_clip must be >= 0 (0 = off), got {cfg.optimizer.grad_clip}")
    if t.precision not in ("auto", "bf16", "fp32"):
        raise ConfigError(f"train.precision must be auto, bf16 or fp32, got {t.precision!r}")
    if t.downstream_every < 0:
        raise ConfigError(f"train.downstream_every must be >= 0 (0 = off), got {t.downstream_every}")
    if t.downstream_every and cfg.sdp.kind != "none" and cfg.sdp.masking == "forward":
        raise ConfigError("train.downstream_every needs the full model on rank 0, which a forward-masked "
                          "SDP worker does not hold; score its checkpoints with scripts/evaluate.py")
    if t.max_nonfinite_steps < 1:
        raise ConfigError(f"train.max_nonfinite_steps must be >= 1, got {t.max_nonfinite_steps}")
    if cfg.resume not in ("none", "auto") and not Path(cfg.resume).is_dir():
        raise ConfigError(f"resume={cfg.resume}: no such checkpoint folder; use resume=auto, "
                          f"resume=none or the path of a step-N folder")


def on_main(env: DistEnv, fn: Callable[[], Any]) -> Any:
    """Run ``fn`` on rank 0 only; every rank gets its result or raises its error (no hang)."""
    result, error = None, None
    if env.is_main:
        try:
            result = fn()
        except Exception as exc:  # noqa: BLE001 - re-raised on every rank below
            if env.world_size == 1:
                raise
            if not isinstance(exc, (ValueError, OSError)):
                traceback.print_exc()  # a bug, not bad input: keep its traceback
            error = f"{type(exc).__name__}: {exc}"
    result, error = broadcast_object((result, error))
    if error is not None:
        raise RankZeroError(error)
    return result


class StopSignal:
    """SIGUSR1 / SIGTERM ask for a checkpoint and a clean exit at the next step boundary.

    Slurm sends SIGUSR1 before the time limit (--signal); the loop agrees on the flag across
    ranks through the per-step control all-reduce, so ranks that did not get the signal stop too.
    """

    def __init__(self) -> None:
        self.requested = False
        for sig in (signal.SIGUSR1, signal.SIGTERM):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:  # noqa: ARG002
        self.requested = True


def _device_sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches, device: torch.device, autocast) -> float:
    """Mean validation loss over every rank's fixed validation batches."""
    was_training = model.training
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=device)
    for x, y in batches:
        with autocast():
            total[0] += model(x.to(device, non_blocking=True), y.to(device, non_blocking=True)).double()
        total[1] += 1
    comm.all_reduce(total, kind="eval")
    model.train(was_training)
    return float(total[0] / total[1])


def _downstream_evaluator(cfg: DictConfig, env: DistEnv, prepared: Path, model: torch.nn.Module):
    """Rank 0's in-loop lm-eval scorer, or None. It needs no collective: other ranks wait at the
    next step's all-reduce. A task that cannot run (e.g. hub data offline) disables it once."""
    t_cfg = cfg.train
    if not t_cfg.downstream_every or not env.is_main:
        return None
    from data import load_tokenizer
    from evaluation.harness import DownstreamEvalError
    from evaluation.in_loop import downstream_eval_metrics

    tokenizer, state = load_tokenizer(prepared), {"enabled": True}

    def evaluate_downstream() -> Dict[str, float]:
        if not state["enabled"]:
            return {}
        try:
            return downstream_eval_metrics(model, tokenizer, t_cfg.downstream_tasks, limit=t_cfg.downstream_limit,
                                           include_path=t_cfg.downstream_include_path)
        except DownstreamEvalError as exc:
            state["enabled"] = False
            print(f"downstream evaluation disabled for this run: {exc}", flush=True)
            return {}

    return evaluate_downstream


def _trim_metrics(path: Path, last_step: int) -> None:
    """Drop log lines after the resumed checkpoint so the log holds every step exactly once."""
    if not path.is_file():
        return
    kept = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line)["step"] <= last_step]
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    os.replace(tmp, path)


def _write_json(path: Path, obj: Dict[str, Any]) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2))
    os.replace(tmp, path)


def run(cfg: DictConfig) -> Dict[str, Any]:
    """Train as the config says; returns the run's summary (also written to summary.json)."""
    stop = StopSignal()  # first, so a signal during a long start-up still ends cleanly
    validate(cfg)
    env = init_distributed(cfg.train.device, cfg.train.dist_timeout_s)
    try:
        return _train(cfg, env, stop)
    finally:
        shutdown()


def _train(cfg: DictConfig, env: DistEnv, stop: StopSignal) -> Dict[str, Any]:
    import data as data_pipeline
    from models import count_parameters, flops_per_token

    t_cfg, o_cfg = cfg.train, cfg.optimizer
    seq_len = cfg.model.seq_len
    accum = accumulation_steps(t_cfg.global_batch_tokens, t_cfg.micro_batch_size, seq_len, env.world_size)
    total_steps = t_cfg.steps
    if cfg.sdp.kind != "none":
        import sdp

        total_steps = sdp.step_budget(t_cfg.steps, cfg.sdp)

    run_dir = Path(cfg.out_dir) / cfg.run_name
    resume_from: Optional[Path] = None
    if cfg.resume == "auto":
        resume_from = latest_checkpoint(run_dir)
    elif cfg.resume != "none":
        resume_from = Path(cfg.resume)
        read_meta(resume_from)  # fails clearly if it is not a complete checkpoint
    elif run_dir.exists() and any(run_dir.iterdir()):
        raise ConfigError(f"run directory {run_dir} already holds a run; pass resume=auto to continue it, "
                          f"or choose another run_name (or delete the folder)")

    prepared = Path(on_main(env, lambda: str(data_pipeline.prepare(cfg.data, cfg.tokenizer))))
    train_data = data_pipeline.TokenLoader(prepared, "train", seq_len, t_cfg.micro_batch_size, env.rank,
                                           env.world_size, cfg.seed, prefetch=cfg.data.prefetch)
    val_data = data_pipeline.TokenLoader(prepared, "val", seq_len, t_cfg.micro_batch_size, env.rank,
                                         env.world_size, cfg.seed, prefetch=0)
    if train_data.vocab_size > cfg.model.vocab_size:
        raise ConfigError(f"the tokenizer has {train_data.vocab_size} tokens but model.vocab_size is "
                          f"{cfg.model.vocab_size}; pick a model with a vocabulary at least as large "
                          f"or a smaller tokenizer (tokenizer.vocab_size)")

    model, sync = build_model_and_sync(cfg, env.world_size, env.rank, env.device)
    n_params = count_parameters(model)
    full_params = getattr(sync, "full_numel", None) or n_params
    # A forward-masked SDP worker computes only its subnetwork; everyone else the full model.
    worker_spec = getattr(sync, "spec", None) if cfg.sdp.kind != "none" and cfg.sdp.masking == "forward" else None
    flops_tok = flops_per_token(cfg.model, worker_spec)
    if t_cfg.activation_checkpointing:
        model.set_activation_checkpointing(True)
    train_model = torch.compile(model) if t_cfg.compile else model
    eval_model = sync.validation_model() if hasattr(sync, "validation_model") else train_model
    use_bf16 = t_cfg.precision == "bf16" or (t_cfg.precision == "auto" and env.device.type == "cuda")
    autocast = (lambda: torch.autocast(env.device.type, dtype=torch.bfloat16)) if use_bf16 \
        else contextlib.nullcontext

    start_step, bytes_cumulative = 0, 0.0
    if env.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
    barrier()
    if resume_from is not None:
        meta = load_checkpoint(resume_from, sync, env)
        start_step, bytes_cumulative = int(meta["step"]), float(meta.get("bytes_cumulative", 0.0))
    if env.is_main:  # e.g. a restart by torchrun --max-restarts before the first checkpoint
        _trim_metrics(run_dir / "metrics.jsonl", start_step)
    resolved = OmegaConf.to_container(cfg, resolve=True)
    if env.is_main:
        (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
        print(f"run {cfg.run_name}: {n_params:,} parameters on rank 0 ({full_params:,} in the full model), "
              f"{flops_tok / 1e6:.1f} MFLOP/token, {env.world_size} rank(s) x {accum} micro-batch(es) "
              f"of {t_cfg.micro_batch_size} x {seq_len} tokens, {total_steps} steps, "
              f"{'resuming from ' + str(resume_from) if resume_from else 'from scratch'}", flush=True)
    logger = MetricsLogger(run_dir, cfg.logger, cfg.run_name, resolved, resume_from is not None) \
        if env.is_main else None
    status = lambda state, step: env.is_main and _write_json(  # noqa: E731
        run_dir / "status.json", {"state": state, "step": step})
    status("running", start_step)

    def checkpoint(step: int) -> None:
        save_checkpoint(run_dir, step, sync, env, {
            "config": resolved, "tokenizer_path": str(prepared / "tokenizer.json"),
            "data": {"prepared_dir": str(prepared), "next_step": step, "seed": cfg.seed},
            "bytes_cumulative": bytes_cumulative}, t_cfg.keep_last)

    peak = peak_flops(env.device)
    tokens_per_step = t_cfg.global_batch_tokens
    dense_bytes = comm.all_reduce_bytes(full_params * 4, env.world_size)
    downstream = _downstream_evaluator(cfg, env, prepared, sync.model if cfg.sdp.kind != "none" else model)
    batches = train_data.batches(start_step, accum)
    val_batches = val_data.eval_batches(t_cfg.eval_batches)
    last_val, best_val, nonfinite_in_row, skipped = None, math.inf, 0, 0
    saved_at, step, state = None, start_step, "completed"
    t_start = time.time()
    sync.zero_grad()
    model.train()
    for step in range(start_step + 1, total_steps + 1):
        comm.COUNTER.reset()
        _device_sync(env.device)
        t0 = time.perf_counter()
        t_data, loss_sum = 0.0, torch.zeros((), device=env.device)
        for _ in range(accum):
            td = time.perf_counter()
            x, y = next(batches)
            x, y = x.to(env.device, non_blocking=True), y.to(env.device, non_blocking=True)
            t_data += time.perf_counter() - td
            with autocast():
                loss = train_model(x, y)
            (loss / accum).backward()
            loss_sum += loss.detach() / accum
        _device_sync(env.device)
        t1 = time.perf_counter()
        # One small control all-reduce per step: mean loss, non-finite flag, stop request.
        control = torch.stack([loss_sum.float(), (~torch.isfinite(loss_sum)).float(),
                               torch.tensor(float(stop.requested), device=env.device)]).double()
        comm.all_reduce(control, kind="control")
        mean_loss, nonfinite, stop_requested = control[0].item() / env.world_size, control[1].item() > 0, \
            control[2].item() > 0
        sync_time = time.perf_counter() - t1
        lr = lr_at(step, o_cfg.lr, o_cfg.warmup_steps, total_steps, o_cfg.min_lr_ratio)
        grad_norm = float("nan")
        if not nonfinite:
            tc = time.perf_counter()
            sync.reduce_gradients()
            _device_sync(env.device)
            t2 = time.perf_counter()
            sync_time += t2 - tc
            grad_norm = sync.clip_gradients(o_cfg.grad_clip)
            nonfinite = not math.isfinite(grad_norm)
            if not nonfinite:
                sync.step(lr)
                sync.after_step()
            _device_sync(env.device)
        t3 = time.perf_counter()
        sync.zero_grad()
        if nonfinite:
            skipped += 1
            nonfinite_in_row += 1
            if env.is_main:
                print(f"step {step}: non-finite loss or gradient, step skipped "
                      f"({nonfinite_in_row} in a row)", flush=True)
            if nonfinite_in_row >= t_cfg.max_nonfinite_steps:
                status("failed", step - 1)
                raise RuntimeError(f"{nonfinite_in_row} non-finite steps in a row (train.max_nonfinite_steps="
                                   f"{t_cfg.max_nonfinite_steps}); stopping. The last good checkpoint is "
                                   f"{latest_checkpoint(run_dir)}; lower optimizer.lr or check the data")
        else:
            nonfinite_in_row = 0
        step_time = t3 - t0
        bytes_step = comm.COUNTER.total()
        bytes_cumulative += bytes_step
        if env.is_main and (step % t_cfg.log_every == 0 or step == start_step + 1 or step == total_steps):
            tflops = flops_tok * tokens_per_step / step_time / env.world_size / 1e12
            metrics: Dict[str, Any] = {
                "train/loss": mean_loss, "train/lr": lr, "train/grad_norm": grad_norm,
                "train/tokens": step * tokens_per_step, "train/skipped_steps": skipped,
                "perf/tokens_per_s": tokens_per_step / step_time, "perf/tflops_per_device": tflops,
                "perf/step_time_s": step_time, "perf/time_data_s": t_data,
                "perf/time_fwd_bwd_s": t1 - t0 - t_data, "perf/time_comm_s": sync_time,
                "perf/time_opt_s": t3 - t0 - (t1 - t0) - sync_time,
                "mem/peak_gib": peak_memory_gib(env.device),
                "comm/bytes_total": bytes_step, "comm/bytes_cumulative": bytes_cumulative,
                "comm/compression": dense_bytes / bytes_step if bytes_step else float("inf"),
            }
            if peak:
                metrics["perf/mfu"] = tflops * 1e12 / peak
            metrics.update({f"comm/bytes_{k}": v for k, v in comm.COUNTER.bytes.items()})
            metrics.update(sync.metrics())
            logger.log(step, metrics)
        if (t_cfg.eval_every and step % t_cfg.eval_every == 0) or step == total_steps:
            with sync.evaluation_weights():  # every rank: may be a collective (sparse_avg's average)
                last_val = evaluate(eval_model, val_batches, env.device, autocast)
            best_val = min(best_val, last_val)
            if env.is_main:
                logger.log(step, {"val/loss": last_val, "val/perplexity": math.exp(min(last_val, 50))})
        if t_cfg.downstream_every and step % t_cfg.downstream_every == 0:
            with sync.evaluation_weights():  # entered by every rank, scored on rank 0
                scores = downstream() if downstream is not None else None
            if scores:
                logger.log(step, scores)
        ran = step - start_step
        stop_job = stop_requested or (t_cfg.stop_after_steps is not None and ran >= t_cfg.stop_after_steps)
        periodic = t_cfg.ckpt_every and step % t_cfg.ckpt_every == 0 and not nonfinite_in_row
        if periodic or step == total_steps or stop_job:  # no rotation of good checkpoints mid-trouble
            checkpoint(step)
            saved_at = step
        if stop_job and step < total_steps:
            state = "preempted" if stop_requested else "stopped"
            break
    summary = {"run_dir": str(run_dir), "state": state, "step": step, "steps_total": total_steps,
               "final_val_loss": last_val, "best_val_loss": best_val if last_val is not None else None,
               "bytes_sent_per_rank": bytes_cumulative,
               "dense_bytes_per_rank": dense_bytes * step, "parameters": full_params,
               "skipped_steps": skipped, "wall_time_s": time.time() - t_start, "checkpoint": saved_at}
    if env.is_main:
        _write_json(run_dir / "summary.json", summary)
        status(state, step)
        logger.summary({k: v for k, v in summary.items() if isinstance(v, (int, float))})
        logger.close()
        if state == "completed":
            print(f"done: validation loss {last_val:.4f} after {step} steps; run files in {run_dir}", flush=True)
        else:
            print(f"{state} at step {step} with a checkpoint; rerun with resume=auto to continue "
                  f"(run files in {run_dir})", flush=True)
    train_data.close()
    return summary
