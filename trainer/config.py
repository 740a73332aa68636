"""The run's config schema: one structured config composed from the parts' own schemas.

Registered in Hydra's ConfigStore as ``schema`` (conf/config.yaml lists it first in its defaults),
so a misspelt key or a wrong type fails at start-up with a message naming the key.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

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


def _times(factor, steps) -> int:
    """``${times:3,${.warmup_steps}}``: a step count as a multiple of another (rounded)."""
    return int(round(float(factor) * float(steps)))


def register_configs() -> None:
    ConfigStore.instance().store(name="schema", node=Config)
    # conf/optimizer/scape.yaml ties the sparsity warm-up to the lr warm-up with it
    OmegaConf.register_new_resolver("times", _times, replace=True)
