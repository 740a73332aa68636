"""The Trainer: ``build`` the run's parts from its config, ``train`` them, one ``train_step`` at a time.

nanoGPT's shape (fetch the next batch, forward, backward, step) with torchtitan's services, each a
component that decides when it acts: the Checkpointer (step-N folders with auto-resume), the
MetricsProcessor (throughput, MFU, memory and bytes in every log line), the Validator and the
DownstreamEvaluator. The Trainer does not know which gradient synchroniser runs; what it needs to
know it asks the synchroniser (core/sync.py).
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import time
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

import torch

from core.comm import Collectives, all_reduce_bytes
from core.distributed import DistEnv, barrier, init_distributed, on_main, runtime_summary, shutdown
from trainer.checkpoint import Checkpointer, latest_checkpoint, load_checkpoint, read_meta, tokens_consumed
from trainer.config import Config, ConfigError, accumulation_steps, to_config
from trainer.metrics import MetricsLogger, MetricsProcessor
from trainer.parts import build_model_and_sync
from trainer.profile import StepProfiler
from trainer.run_folder import RunFolder, holds_a_run
from core.schedule import lr_at
from trainer.step import StepResult, train_step
from trainer.validate import DownstreamEvaluator, Validator


class StopSignal:
    """SIGUSR1 / SIGTERM ask for a checkpoint and a clean exit at the next step boundary.

    Slurm sends SIGUSR1 before the time limit (--signal); the ranks agree on the flag through the
    per-step control all-reduce, so ranks that did not get the signal stop too.
    """

    def __init__(self) -> None:
        self.requested = False
        for sig in (signal.SIGUSR1, signal.SIGTERM):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:  # noqa: ARG002
        self.requested = True


class NonFiniteGuard:
    """Counts skipped (non-finite) steps; too many in a row stop the run with the last good checkpoint."""

    def __init__(self, max_in_row: int) -> None:
        self.max_in_row, self.in_row, self.skipped = max_in_row, 0, 0

    def update(self, step: int, nonfinite: bool, is_main: bool) -> bool:
        """Record ``step``; True when the run must stop."""
        if not nonfinite:
            self.in_row = 0
            return False
        self.skipped += 1
        self.in_row += 1
        if is_main:
            print(f"step {step}: non-finite loss or gradient, step skipped ({self.in_row} in a row)", flush=True)
        return self.in_row >= self.max_in_row


def _trim_metrics(path: Path, last_step: int) -> int:
    """Drop log lines after the resumed checkpoint so the log holds every step exactly once;
    returns the last step the log had (what wandb has seen too)."""
    if not path.is_file():
        return 0
    records = [(line, json.loads(line)["step"]) for line in path.read_text().splitlines() if line.strip()]
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(line + "\n" for line, step in records if step <= last_step))
    os.replace(tmp, path)
    return max((step for _, step in records), default=0)


def _write_json(path: Path, obj: Dict[str, Any]) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2))
    os.replace(tmp, path)


class Trainer:
    def __init__(self, cfg: Config, env: DistEnv, stop: Optional[StopSignal] = None) -> None:
        self.cfg, self.env = cfg, env
        self.stop = stop if stop is not None else StopSignal()
        self.comm = Collectives()
        self.run_dir = Path(cfg.out_dir) / cfg.run_name
        self.start_step, self.step = 0, 0
        self.batches = None  # the training micro-batches, once built
        self.folder = RunFolder(self.run_dir, env.is_main)

    # ------------------------------------------------------------------------------ build
    def build(self) -> "Trainer":
        t = self.cfg.train  # first of all, before anything is written: a batch the ranks cannot split,
        self.accum = accumulation_steps(t.global_batch_tokens, t.micro_batch_size, self.cfg.model.seq_len,
                                        self.env.world_size)
        if t.memory_check:  # and a run that cannot fit, are refused
            from trainer.memory import check_memory

            check_memory(self.cfg, self.env.world_size, self.env.device)
        # before anything is written: the folder's lock, a killed start noted, a resume of another run refused
        on_main(self.env, lambda: self.folder.claim(dataclasses.asdict(self.cfg), self.cfg.resume))
        self._find_resume()
        self._build_data()
        self._build_model()
        self._open_run()
        self._build_components()
        return self

    def _find_resume(self) -> None:
        cfg, self.resume_from = self.cfg, None
        if cfg.resume == "auto":
            self.resume_from = latest_checkpoint(self.run_dir)
        elif cfg.resume != "none":
            self.resume_from = Path(cfg.resume)
            read_meta(self.resume_from)  # fails clearly if it is not a complete checkpoint
        elif holds_a_run(self.run_dir):
            raise ConfigError(f"run directory {self.run_dir} already holds a run; pass resume=auto to continue "
                              f"it, or choose another run_name (or delete the folder)")

    def _build_data(self) -> None:
        import data as data_pipeline

        cfg, env, t = self.cfg, self.env, self.cfg.train
        self.prepared = Path(on_main(env, lambda: str(data_pipeline.prepare(cfg.data, cfg.tokenizer))))
        self.train_data = data_pipeline.TokenLoader(self.prepared, "train", cfg.model.seq_len, t.micro_batch_size,
                                                    env.rank, env.world_size, cfg.seed, prefetch=cfg.data.prefetch)
        self.val_data = data_pipeline.TokenLoader(self.prepared, "val", cfg.model.seq_len, t.micro_batch_size,
                                                  env.rank, env.world_size, cfg.seed, prefetch=0)
        if self.train_data.vocab_size > cfg.model.vocab_size:
            raise ConfigError(f"the tokenizer has {self.train_data.vocab_size} tokens but model.vocab_size is "
                              f"{cfg.model.vocab_size}; pick a model with a vocabulary at least as large "
                              f"or a smaller tokenizer (tokenizer.vocab_size)")

    def _build_model(self) -> None:
        from models import flops_per_token

        cfg, t = self.cfg, self.cfg.train
        self.model, self.sync = build_model_and_sync(cfg, self.env.device, self.comm)
        self.total_steps = self.sync.step_budget(t.steps)
        self.n_params, self.full_params = self.sync.parameter_counts()
        self.flops_per_token = flops_per_token(cfg.model, self.sync.compute_spec())
        if t.activation_checkpointing:
            self.model.set_activation_checkpointing(True)
        device = self.env.device
        if t.compiles(device.type):  # per block, so backward-overlapped communication keeps its overlap
            self.model.compile_blocks()
        # the forward goes through the synchroniser's module (DDP's wrapper for the dense arms)
        self.train_model = self.sync.train_module
        use_bf16 = t.precision == "bf16" or (t.precision == "auto" and device.type == "cuda")
        self.autocast = (lambda: torch.autocast(device.type, dtype=torch.bfloat16)) if use_bf16 \
            else contextlib.nullcontext

    def _open_run(self) -> None:
        env, bytes_cumulative = self.env, 0.0
        self._bytes_outside_at_start = 0.0
        self._tokens_at_start = 0
        if env.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        barrier()
        if self.resume_from is not None:
            meta = load_checkpoint(self.resume_from, self.sync, env)
            self.start_step, bytes_cumulative = int(meta["step"]), float(meta.get("bytes_cumulative", 0.0))
            self._bytes_outside_at_start = float(meta.get("bytes_outside_steps", 0.0))
            self._tokens_at_start = tokens_consumed(meta, self.cfg.model.seq_len)
        elif self.cfg.train.init_from is not None:
            self._init_weights(Path(self.cfg.train.init_from))
        self.step = self.start_step
        self._bytes_at_start = bytes_cumulative
        self.resolved = dataclasses.asdict(self.cfg)
        self.logger = None
        if env.is_main:  # e.g. a restart by torchrun --max-restarts before the first checkpoint
            logged_through = _trim_metrics(self.run_dir / "metrics.jsonl", self.start_step)
            self.folder.record_start(self.resolved, self.resume_from)
            self._announce()
            self.logger = MetricsLogger(self.run_dir, self.cfg.logger, self.cfg.run_name, self.resolved,
                                        self.start_step, logged_through, self.total_steps)
        self._status("running", self.start_step)

    def _init_weights(self, folder: Path) -> None:
        """Weights only, from a checkpoint folder: the optimizer starts fresh and the run at step 0."""
        from models.hf import read_checkpoint

        _, state_dict, _ = read_checkpoint(str(folder))  # checksums verified
        self.sync.load_model_state_dict(state_dict)
        if self.env.is_main:
            print(f"initialised the model's weights from {folder}", flush=True)

    def _announce(self) -> None:
        t, env = self.cfg.train, self.env
        print(runtime_summary(env, t.device), flush=True)
        print(f"run {self.cfg.run_name}: {self.n_params:,} parameters on rank 0 ({self.full_params:,} in the full "
              f"model), {self.flops_per_token / 1e6:.1f} MFLOP/token, {env.world_size} rank(s) x {self.accum} "
              f"micro-batch(es) of {t.micro_batch_size} x {self.cfg.model.seq_len} tokens, {self.total_steps} "
              f"steps, {'resuming from ' + str(self.resume_from) if self.resume_from else 'from scratch'}", flush=True)

    def _build_components(self) -> None:
        t, env = self.cfg.train, self.env
        self.checkpointer = Checkpointer(self.run_dir, self.sync, env, t.ckpt_every, t.keep_last, self._meta,
                                         on_failure=self.folder.failed)
        self.dense_bytes = all_reduce_bytes(self.full_params * 4, env.world_size)
        self.metrics = MetricsProcessor(self.logger, self.sync, self.comm, t.log_every, self.start_step,
                                        self.total_steps, t.global_batch_tokens, self.flops_per_token,
                                        env.world_size, env.device, self.dense_bytes, self._bytes_at_start,
                                        t.peak_tflops, self._bytes_outside_at_start)
        self.profiler = StepProfiler(self.run_dir, t.profile_start, t.profile_end, self.start_step, env.device,
                                     t.profile and env.is_main)
        self.downstream = None
        if t.downstream_every:  # on every rank (evaluation_weights may be a collective); rank 0 scores
            from data import load_tokenizer

            tokenizer = load_tokenizer(self.prepared) if env.is_main else None
            self.downstream = DownstreamEvaluator(self.sync, tokenizer, t.downstream_every, t.downstream_tasks,
                                                  t.downstream_limit, t.downstream_include_path)
        self.batches = self.train_data.batches(self.start_step, self.accum,
                                               first_sample=self._tokens_at_start // self.cfg.model.seq_len)
        self.validator = Validator(self.sync, self.sync.validation_model(self.train_model),
                                   self.val_data.eval_batches(t.eval_batches), env.device, self.autocast,
                                   self.comm, t.eval_every)
        self.guard = NonFiniteGuard(t.max_nonfinite_steps)

    def _meta(self, step: int) -> Dict[str, Any]:
        return {"config": self.resolved, "tokenizer_path": str(self.prepared / "tokenizer.json"),
                "data": {"prepared_dir": str(self.prepared), "next_step": step, "seed": self.cfg.seed,
                         "tokens_consumed": self._tokens_at_start
                         + (step - self.start_step) * self.cfg.train.global_batch_tokens},
                "bytes_cumulative": self.metrics.bytes_cumulative, "bytes_outside_steps": self.metrics.bytes_outside_steps}

    def _status(self, state: str, step: int) -> None:
        self.folder.status(state, step)

    # ------------------------------------------------------------------------------ train
    def train_step(self, step: int) -> StepResult:
        """One optimizer step at ``step`` (1-based) with the schedule's learning rate."""
        o = self.cfg.optimizer
        self.metrics.count_outside_steps()
        self.lr = lr_at(step, o.lr, o.warmup_steps, self.total_steps, o.min_lr_ratio, o.lr_schedule, o.decay_fraction)
        return train_step(self.train_model, self.sync, self.batches, self.accum, self.lr, o.grad_clip, self.comm,
                          self.env.world_size, self.autocast, self.stop.requested, self.env.device)

    def train(self) -> Dict[str, Any]:
        """Run the steps from the start (or the resumed checkpoint) to the budget or a stop.

        A step's result (loss, flags) is read one step late, once the next step is queued, so the
        GPU never waits for the host between log steps (trainer/step.py); it is read at once on
        the steps that need it: log steps, checkpoint steps, the last one and a stop. Every rank
        reads at the same steps, so they agree on skips and stops.
        """
        t, state = self.cfg.train, "completed"
        self.t_start = time.time()
        self.sync.zero_grad()
        self.model.train()
        unread: Optional[Tuple[int, StepResult]] = None  # the previous step, not yet read
        stop_seen = False
        for step in range(self.start_step + 1, self.total_steps + 1):
            self.step = step
            result = self.train_step(step)
            if unread is not None:
                stop_seen |= self._account(*unread)
            last = step == self.total_steps
            stop_after = t.stop_after_steps is not None and step - self.start_step >= t.stop_after_steps
            unread = (step, result)
            if stop_seen or last or stop_after or self.metrics.due(step) or self.checkpointer.due(step, last, False,
                                                                                                  False):
                stop_seen |= self._account(step, result)
                unread = None
            self.metrics.record(step, self.lr, result, self.guard.skipped)
            self.profiler.step(step)
            self._evaluate(step)
            stop_job = stop_seen or stop_after
            self.checkpointer.maybe_save(step, last=last, stopping=stop_job, in_trouble=self.guard.in_row > 0)
            if stop_job and step < self.total_steps:
                state = "preempted" if stop_seen else "stopped"
                break
        return self._finish(state)

    def _account(self, step: int, result: StepResult) -> bool:
        """Read ``step``'s result: count a skipped step (fail after too many); True if a stop was asked."""
        if self.guard.update(step, result.nonfinite, self.env.is_main):
            self._fail(step)
        return result.stop_requested

    def _evaluate(self, step: int) -> None:
        scores = self.validator.maybe_validate(step, last=step == self.total_steps)
        if scores:
            self.metrics.log(step, scores)
        if self.downstream is not None:
            scores = self.downstream.maybe_evaluate(step)
            if scores:
                self.metrics.log(step, scores)

    def _fail(self, step: int) -> None:
        self._status("failed", step - 1)
        raise RuntimeError(f"{self.guard.in_row} non-finite steps in a row (train.max_nonfinite_steps="
                           f"{self.guard.max_in_row}); stopping. The last good checkpoint is "
                           f"{latest_checkpoint(self.run_dir)}; lower optimizer.lr or check the data")

    def summary(self, state: str) -> Dict[str, Any]:
        self.metrics.count_outside_steps()  # the last validation's and checkpoint's
        last = self.validator.last
        return {"run_dir": str(self.run_dir), "state": state, "step": self.step, "steps_total": self.total_steps,
                "final_val_loss": last, "best_val_loss": self.validator.best if last is not None else None,
                "bytes_sent_per_rank": self.metrics.bytes_cumulative,
                "bytes_outside_steps_per_rank": self.metrics.bytes_outside_steps,
                "dense_bytes_per_rank": self.dense_bytes * self.step, "parameters": self.full_params,
                "skipped_steps": self.guard.skipped, "wall_time_s": time.time() - self.t_start,
                "checkpoint": self.checkpointer.saved_at}

    def _finish(self, state: str) -> Dict[str, Any]:
        summary = self.summary(state)
        if self.env.is_main:
            _write_json(self.run_dir / "summary.json", summary)
            self._status(state, self.step)
            self.logger.summary(summary)
            self.logger.close()
            if state == "completed":
                print(f"done: validation loss {self.validator.last:.4f} after {self.step} steps; run files in "
                      f"{self.run_dir}", flush=True)
            else:
                print(f"{state} at step {self.step} with a checkpoint; rerun with resume=auto to continue "
                      f"(run files in {self.run_dir})", flush=True)
        self.close()
        return summary

    def close(self) -> None:
        """Stop the loader's prefetch thread and wait for it (before the interpreter exits)."""
        if getattr(self, "profiler", None) is not None:
            self.profiler.close()
        if self.batches is not None:
            self.batches.close()  # the generator's finally joins its thread
        self.train_data.close()
        self.folder.release()


def run(cfg) -> Dict[str, Any]:
    """Train as the config says; returns the run's summary (also written to summary.json)."""
    stop = StopSignal()  # first, so a signal during a long start-up still ends cleanly
    config = to_config(cfg)  # the one conversion; every value is checked here
    env = init_distributed(config.train.device, config.train.dist_timeout_s)
    trainer = Trainer(config, env, stop)
    try:
        return trainer.build().train()
    finally:
        trainer.folder.release()
        shutdown()
