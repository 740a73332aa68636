"""The run's config schema: one structured config composed from the parts' own schemas.

Registered in Hydra's ConfigStore as ``schema`` (conf/config.yaml lists it first in its defaults),
so a misspelt key or a wrong type fails at start-up with a message naming the key.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from hydra.core.config_store import ConfigStore

from data.config import DataConfig, TokenizerConfig
from models.config import ModelConfig
from scape.config import OptimizerConfig
from sdp.config import SDPConfig


@dataclass
class TrainConfig:
    steps: int = 300
    global_batch_tokens: int = 8192  # tokens per optimizer step over all ranks
    micro_batch_size: int = 8  # sequences per forward pass per rank
    eval_every: int = 100  # validation every N steps (and at the end); 0 = only at the end
    eval_batches: int = 8  # micro-batches per rank per validation
    log_every: int = 10
    ckpt_every: int = 100  # 0 = only at the end
    keep_last: int = 2  # checkpoints kept (older step-N folders are deleted)
    compile: bool = False  # torch.compile the model
    activation_checkpointing: bool = False
    precision: str = "auto"  # auto (bf16 autocast on CUDA, fp32 on CPU) | bf16 | fp32
    device: str = "auto"  # auto | cpu | cuda
    dist_timeout_s: int = 600  # process-group timeout: a hung collective fails after this
    max_nonfinite_steps: int = 5  # consecutive skipped (NaN/inf) steps before the run stops
    stop_after_steps: Optional[int] = None  # end this job (with a checkpoint) after N steps
    downstream_every: int = 0  # lm-eval tasks on rank 0 every N steps (0 = off; needs the eval extra)
    downstream_tasks: str = "small"  # a conf/eval/ preset or a comma-separated task list
    downstream_limit: Optional[float] = 200  # documents per task
    downstream_include_path: Optional[str] = None  # folder of custom task YAMLs (offline tasks)


@dataclass
class LoggerConfig:
    console: bool = True
    wandb: str = "auto"  # auto (online with an API key, offline otherwise) | online | offline | disabled
    project: str = "scape-sdp"
    entity: Optional[str] = None
    group: Optional[str] = None


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    sdp: SDPConfig = field(default_factory=SDPConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    seed: int = 1337
    run_name: str = "${model.name}-${optimizer.name}"
    out_dir: str = "runs"  # the run's files go to out_dir/run_name
    resume: str = "none"  # none | auto (newest complete checkpoint of the run) | path to a step-N folder


class ConfigError(ValueError):
    """A config value that cannot work; the message names the key and the fix."""


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


def validate(cfg) -> None:
    """Refuse values that cannot work, before anything is built or written."""
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


def register_configs() -> None:
    ConfigStore.instance().store(name="schema", node=Config)
