"""The run's config schema: one structured config composed from the parts' own schemas.

Registered in Hydra's ConfigStore as ``schema`` (conf/config.yaml lists it first in its defaults),
so a misspelt key or a wrong type fails at start-up with a message naming the key. The entry point
converts Hydra's DictConfig once (``to_config``) into these dataclasses; each checks its own values
when it is built (``__post_init__``), so a value that cannot work fails before anything is built or
written. Choice-valued keys are ``Literal`` types (OmegaConf stores them as ``str``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, List, Literal, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from core.choices import check_choice
from core.sync import GradSync
from data.config import DataConfig, TokenizerConfig
from models.config import ModelConfig
from core.optim import DenseOptimizerConfig, embedding_lr_scale
from scape.config import optimizer_config
from sdp.config import SDPConfig
from core.schedule import LrSchedule


Precision = Literal["auto", "bf16", "fp32"]  # auto: bf16 autocast on CUDA, fp32 on CPU
Device = Literal["auto", "cpu", "cuda"]
WandbMode = Literal["auto", "online", "offline", "disabled"]  # auto: online with an API key
OptimizerName = Literal["adamw", "adams", "scape", "sparse_avg"]


class ConfigError(ValueError):
    """A config value that cannot work; the message names the key and the fix."""


def _positive(key: str, value) -> None:
    if value <= 0:
        raise ConfigError(f"{key} must be positive, got {value}")


def _non_negative(key: str, value, note: str = "") -> None:
    if value < 0:
        raise ConfigError(f"{key} must be >= 0{note}, got {value}")


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
    compile: Any = "auto"  # true | false | auto (auto: on CUDA, eager on CPU): torch.compile each block (models/common.py)
    activation_checkpointing: bool = False
    precision: str = "auto"  # Precision
    device: str = "auto"  # Device
    dist_timeout_s: int = 600  # process-group timeout: a hung collective fails after this
    max_nonfinite_steps: int = 5  # consecutive skipped (NaN/inf) steps before the run stops
    stop_after_steps: Optional[int] = None  # end this job (with a checkpoint) after N steps
    downstream_every: int = 0  # lm-eval tasks on rank 0 every N steps (0 = off; needs the eval extra)
    downstream_tasks: str = "small"  # a conf/eval/ preset or a comma-separated task list
    downstream_limit: Optional[float] = 200  # documents per task
    downstream_include_path: Optional[str] = None  # folder of custom task YAMLs (offline tasks)
    init_from: Optional[str] = None  # start from these weights (a checkpoint folder): fresh optimizer, step 0
    peak_tflops: Optional[float] = None  # the device's dense bf16 peak for perf/mfu; None: the GPU table (CPU: no MFU)
    profile: bool = False  # torch.profiler trace + top kernels of steps profile_start..profile_end (trainer/profile.py)
    profile_start: int = 5
    profile_end: int = 7
    memory_check: bool = True  # refuse a run whose per-rank memory estimate cannot fit (trainer/memory.py)
    memory_limit_gib: Optional[float] = None  # the pre-flight's limit; None: the GPU's free memory / host's MemAvailable

    def __post_init__(self) -> None:
        for key in ("steps", "log_every", "eval_batches"):
            _positive(f"train.{key}", getattr(self, key))
        for key in ("eval_every", "ckpt_every", "keep_last"):
            _non_negative(f"train.{key}", getattr(self, key))
        check_choice("train.precision", self.precision, Precision)
        check_choice("train.device", self.device, Device)
        _non_negative("train.downstream_every", self.downstream_every, " (0 = off)")
        if self.peak_tflops is not None:
            _positive("train.peak_tflops", self.peak_tflops)
        if not 1 <= self.profile_start <= self.profile_end:
            raise ConfigError(f"train.profile_start..profile_end must be a step range with 1 <= start <= end, "
                              f"got {self.profile_start}..{self.profile_end}")
        if self.max_nonfinite_steps < 1:
            raise ConfigError(f"train.max_nonfinite_steps must be >= 1, got {self.max_nonfinite_steps}")
        self.compile = _compile_choice(self.compile)

    def compiles(self, device_type: str) -> bool:
        """Whether the blocks are compiled on this device (``auto``: on CUDA only)."""
        return self.compile is True or (self.compile == "auto" and device_type == "cuda")


def _compile_choice(value: Any) -> Any:
    if isinstance(value, bool) or value == "auto":
        return value
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    raise ConfigError(f"train.compile={value!r}: expected true, false or auto (auto compiles on CUDA and "
                      f"runs eager on CPU), e.g. train.compile=auto")


@dataclass
class LoggerConfig:
    console: bool = True
    wandb: str = "auto"  # WandbMode
    project: str = "scape-sdp"
    entity: Optional[str] = None
    group: Optional[str] = None  # wandb group; None: from the values, e.g. llama500m_scape99 (core/wandb_run.py)
    tags: List[str] = field(default_factory=list)  # extra wandb tags (optimizer, sparsity, SDP come by themselves)

    def __post_init__(self) -> None:
        check_choice("logger.wandb", self.wandb, WandbMode)


def check_schedule(o: Any) -> None:
    """The optimizer keys the Trainer itself reads: the learning-rate schedule and clipping."""
    check_choice("optimizer.name", o.name, OptimizerName, "{key} must be one of {joined}, got {value!r}")
    check_choice("optimizer.grad_sync", o.grad_sync, GradSync)
    _non_negative("optimizer.warmup_steps", o.warmup_steps)
    if not (o.lr > 0 and math.isfinite(o.lr)):
        raise ConfigError(f"optimizer.lr must be a positive number, got {o.lr}")
    if not 0 <= o.min_lr_ratio <= 1:
        raise ConfigError(f"optimizer.min_lr_ratio must lie in [0, 1], got {o.min_lr_ratio}")
    _non_negative("optimizer.grad_clip", o.grad_clip, " (0 = off)")
    check_choice("optimizer.lr_schedule", o.lr_schedule, LrSchedule)
    if not 0 < o.decay_fraction <= 1:
        raise ConfigError(f"optimizer.decay_fraction must lie in (0, 1] (the final fraction of the steps "
                          f"that decays, e.g. 0.2), got {o.decay_fraction}")


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    # one dataclass per optimizer (core/optim.py, scape/config.py), chosen by optimizer.name: here
    # the keys they all share, which each conf/optimizer/*.yaml extends with its own
    optimizer: Any = field(default_factory=lambda: _shared_optimizer_keys())
    sdp: SDPConfig = field(default_factory=SDPConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    seed: int = 1337
    run_name: str = "${model.name}-${optimizer.name}"
    out_dir: str = "runs"  # the run's files go to out_dir/run_name
    resume: str = "none"  # none | auto (newest complete checkpoint of the run) | path to a step-N folder

    def __post_init__(self) -> None:
        if not isinstance(self.optimizer, DenseOptimizerConfig):  # the keys refused or checked by its dataclass
            self.optimizer = optimizer_config(self.optimizer)
        check_schedule(self.optimizer)
        if self.optimizer.shard and self.sdp.kind != "none":
            raise ConfigError("optimizer.shard=true is not supported with SDP (each worker keeps the optimizer "
                              "state of its own subnetwork only); set optimizer.shard=false")
        scale = embedding_lr_scale(self.optimizer)
        if scale != 1 and self.sdp.kind != "none":
            raise ConfigError(f"optimizer.param_groups[0].lr_scale={scale:g} is not supported with SDP (a worker's "
                              f"optimizer holds its subnetwork's pieces, not the model's tables): leave it 1")
        t = self.train
        if t.downstream_every and self.sdp.kind != "none" and self.sdp.masking == "forward":
            raise ConfigError("train.downstream_every needs the full model on rank 0, which a forward-masked "
                              "SDP worker does not hold; score its checkpoints with scripts/evaluate.py")
        if t.init_from is not None and not Path(t.init_from).is_dir():
            raise ConfigError(f"train.init_from={t.init_from}: no such folder; give a step-N checkpoint or "
                              f"the folder `python -m models.hf import --out DIR` wrote")
        if self.resume not in ("none", "auto") and not Path(self.resume).is_dir():
            raise ConfigError(f"resume={self.resume}: no such checkpoint folder; use resume=auto, "
                              f"resume=none or the path of a step-N folder")


def _shared_optimizer_keys() -> dict:
    shared = DenseOptimizerConfig()
    return {f.name: getattr(shared, f.name) for f in fields(DenseOptimizerConfig)}


def to_config(cfg: Any) -> Config:
    """The run's typed config from Hydra's DictConfig (interpolations resolved, every value checked)."""
    if isinstance(cfg, Config):
        return cfg
    return OmegaConf.to_object(cfg)


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


def _times(factor, steps) -> int:
    """``${times:3,${.warmup_steps}}``: a step count as a multiple of another (rounded)."""
    return int(round(float(factor) * float(steps)))


def _longest(*steps) -> int:
    """``${longest:${.warmup_steps},${times:0.3333,${train.steps}}}``: the largest step count."""
    return max(int(step) for step in steps)


def register_configs() -> None:
    ConfigStore.instance().store(name="schema", node=Config)
    # conf/optimizer/scape.yaml and sparse_avg.yaml tie the sparsity warm-up to the lr warm-up with
    # it; every compose site (train.py, tests, scripts) calls this function first
    OmegaConf.register_new_resolver("times", _times, replace=True)
    OmegaConf.register_new_resolver("longest", _longest, replace=True)
