"""Validation of the SCAPE and sparse averaging keys: a bad setting fails at start-up, naming the key."""
from __future__ import annotations

import math

from core.optim import DenseOptimizerConfig
from scape.config import optimizer_config
from scape.quantize import BITS as QUANTIZED_BITS
from scape.topk import TOPK_METHODS
from scape.transport import TRANSPORTS

VALUE_DTYPES = ("fp32", "bf16")
UPDATES = ("lazy", "all")
BASES = ("adams", "adamw")
SCORES = ("moment", "gradient")
SCORE_TIMINGS = ("pre_send", "post_step")
STALE_SCALES = ("steps", "lr_sum")


def _choice(key: str, value, allowed) -> None:
    if value not in allowed:
        raise ValueError(f"optimizer.{key}={value!r} is not supported; allowed values: "
                         f"{', '.join(map(str, allowed))}")


def as_dataclass(cfg) -> DenseOptimizerConfig:
    """The optimizer's own config from Hydra's DictConfig (or a dict); a config passes through.

    The key ``update`` collides with DictConfig's ``update`` method (``cfg.update`` is the method),
    so SCAPE never reads its settings through attribute access on a DictConfig.
    """
    if isinstance(cfg, DenseOptimizerConfig):
        return cfg
    try:
        from omegaconf import DictConfig, OmegaConf
    except ImportError:  # pragma: no cover - hydra is a dependency of the trainer
        DictConfig = ()
    if DictConfig and isinstance(cfg, DictConfig):
        cfg = OmegaConf.to_container(cfg, resolve=True)
    if isinstance(cfg, dict):
        return optimizer_config(cfg)
    raise TypeError(f"expected an optimizer config, got {type(cfg).__name__}")


# keys that only optimizer=sparse_avg reads, and those only SCAPE reads: each refuses the other's
SPARSE_AVG_ONLY_KEYS = ("step_bound", "byte_budget", "ranks_per_copy", "value_bits", "local_step_scale",
                        "local_step_scale_power")
SCAPE_ONLY_KEYS = ("mask_transport", "topk_method", "offload_residual", "lag", "overlap_backward", "update",
                   "stale_scale_cap", "stale_scale", "base", "score", "score_timing")


def refuse_foreign_keys(cfg: DenseOptimizerConfig, keys, owner: str, here: str) -> None:
    """A key another optimizer reads, set away from its default here, is an error, not ignored
    (each optimizer's own config has no such key, so only a hand-made one can hold it)."""
    fields = type(cfg).__dataclass_fields__
    for key in keys:
        if key in fields and getattr(cfg, key) != fields[key].default:
            raise ValueError(f"optimizer.{key}={getattr(cfg, key)!r} is {owner} option; "
                             f"optimizer={here} does not use it (leave it at {fields[key].default!r})")


def _number(key: str, value, lo: float, note: str, hi: float = math.inf, open_hi: bool = False) -> None:
    """optimizer.{key} must be a finite number in [lo, hi] ([lo, hi) with ``open_hi``)."""
    ok = (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
          and lo <= value and (value < hi if open_hi else value <= hi))
    if not ok:
        bounds = f">= {lo:g}" if hi == math.inf else f"in [{lo:g}, {hi:g}{')' if open_hi else ']'}"
        raise ValueError(f"optimizer.{key}={value!r} must be a number {bounds} ({note})")


def check_mask_schedule(cfg) -> None:
    """The keys SCAPE and sparse averaging share: the density and its warm-ups, the betas."""
    sparsity = cfg.sparsity
    if not (isinstance(sparsity, (int, float)) and 0.0 <= sparsity < 1.0):
        raise ValueError(f"optimizer.sparsity={sparsity!r} must lie in [0, 1) "
                         f"(0 = dense, 0.99 = send 1% of the values)")
    _choice("value_dtype", cfg.value_dtype, VALUE_DTYPES)
    if int(cfg.dense_warmup_steps) != cfg.dense_warmup_steps or cfg.dense_warmup_steps < 1:
        raise ValueError(f"optimizer.dense_warmup_steps={cfg.dense_warmup_steps!r} must be an integer "
                         f">= 1: step 1 is always dense (it produces the first mask)")
    if int(cfg.sparsity_warmup_steps) != cfg.sparsity_warmup_steps or cfg.sparsity_warmup_steps < 0:
        raise ValueError(f"optimizer.sparsity_warmup_steps={cfg.sparsity_warmup_steps!r} must be an "
                         f"integer >= 0 (0 = off)")
    b1, b2 = cfg.betas
    if not (0.0 <= b1 < 1.0 and 0.0 <= b2 < 1.0):
        raise ValueError(f"optimizer.betas={list(cfg.betas)} must lie in [0, 1)")


def validate_config(cfg) -> None:
    """SCAPE's keys (ScapeConfig checks itself with this)."""
    check_mask_schedule(cfg)
    for key, allowed in (("mask_transport", TRANSPORTS), ("topk_method", TOPK_METHODS), ("update", UPDATES),
                         ("base", BASES), ("score", SCORES), ("lag", (True, False)),
                         ("overlap_backward", (True, False)), ("offload_residual", (True, False)),
                         ("score_timing", SCORE_TIMINGS), ("stale_scale", STALE_SCALES)):
        _choice(key, getattr(cfg, key), allowed)
    cap = cfg.stale_scale_cap
    if not (isinstance(cap, (int, float)) and math.isfinite(cap) and (cap == 0 or cap >= 1)):
        raise ValueError(f"optimizer.stale_scale_cap={cap!r} must be 0 (cap = 1 / density), 1 (off) "
                         f"or a number > 1")
    if cap != 1 and cfg.update != "lazy":
        raise ValueError(f"optimizer.stale_scale_cap={cfg.stale_scale_cap} scales lazy updates only; "
                         f"it needs optimizer.update=lazy, got {cfg.update!r}")


def validate_sparse_avg(cfg) -> None:
    """Sparse averaging's keys (SparseAverageConfig checks itself with this)."""
    check_mask_schedule(cfg)
    _number("step_bound", cfg.step_bound, 0, "0 = sqrt(copies / (1 - b2)), AdamS's largest step on a copy's "
            "share of the batch")
    _number("byte_budget", cfg.byte_budget, 0, "bytes per rank per step as a fraction of the dense fp32 "
            "all-reduce; 0 = SCAPE-99's", hi=1)
    if not (isinstance(cfg.ranks_per_copy, int) and not isinstance(cfg.ranks_per_copy, bool)
            and cfg.ranks_per_copy >= 1):
        raise ValueError(f"optimizer.ranks_per_copy={cfg.ranks_per_copy!r} must be an integer >= 1 "
                         f"(1 = a copy per rank; the GPUs per node = a copy per node)")
    _choice("value_bits", cfg.value_bits, (0, *QUANTIZED_BITS))
    _number("local_step_scale", cfg.local_step_scale, 0, "1 = the copies take their whole local step; "
            "0 = min(1, (4 / copies)^local_step_scale_power)", hi=1)
    _number("local_step_scale_power", cfg.local_step_scale_power, 0, "with local_step_scale=0 the copies take "
            "min(1, (4 / copies)^power) of their step", hi=1)
