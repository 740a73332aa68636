"""Validation of the SCAPE keys of ``OptimizerConfig``: a bad setting fails at start-up, naming the key."""
from __future__ import annotations

import math
from typing import Optional

from core.optim import embedding_lr_scale
from scape.config import OptimizerConfig
from scape.quantize import BITS as QUANTIZED_BITS, MIDTREAD_BITS
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


def as_dataclass(cfg) -> OptimizerConfig:
    """A plain ``OptimizerConfig`` from Hydra's DictConfig (or a dict).

    The key ``update`` collides with DictConfig's ``update`` method (``cfg.update`` is the method),
    so SCAPE never reads its settings through attribute access on a DictConfig.
    """
    if isinstance(cfg, OptimizerConfig):
        return cfg
    try:
        from omegaconf import DictConfig, OmegaConf
    except ImportError:  # pragma: no cover - hydra is a dependency of the trainer
        DictConfig = ()
    if DictConfig and isinstance(cfg, DictConfig):
        cfg = OmegaConf.to_container(cfg, resolve=True)
    if isinstance(cfg, dict):
        known = OptimizerConfig.__dataclass_fields__
        unknown = sorted(set(cfg) - set(known))
        if unknown:
            raise ValueError(f"unknown optimizer keys {unknown}; known: {', '.join(known)}")
        return OptimizerConfig(**cfg)
    raise TypeError(f"expected an OptimizerConfig, got {type(cfg).__name__}")


# keys that only optimizer=sparse_avg reads (scape/averaging.py has the list the other way round)
SPARSE_AVG_ONLY_KEYS = ("outer_lr", "outer_momentum", "mask_rule", "normalizer", "exchange", "step_bound",
                        "fresh_step_bound", "embedding_step_bound", "own_denominator_floor", "clamp_excess", "average_momentum",
                        "local_momentum", "density_lr_power", "min_sparsity",
                        "ranks_per_copy", "value_bits", "value_quantizer", "quantized_collective", "requantization_error",
                        "local_step_scale", "local_step_scale_power", "embedding_local_step_scale",
                        "embedding_score_scale", "denominator_beta", "embedding_denominator_beta",
                        "scaled_embedding_denominator_beta", "scaled_embedding_step_bound", "grad_clip_scope")
LOCAL_MOMENTA = ("own", "consensus")
MASK_RULES = ("drift", "deviation", "random", "cyclic")
NORMALIZERS = ("local", "shared", "revealed", "oracle")
EXCHANGES = ("drift", "momentum")
QUANTIZED_COLLECTIVES = ("all_gather", "compressed_all_reduce")
VALUE_QUANTIZERS = ("midrise", "midtread")
REQUANTIZATION_ERRORS = ("copy", "owner")
GRAD_CLIP_SCOPES = ("rank", "shared")
CLAMP_EXCESSES = ("drop", "send")


def refuse_foreign_keys(cfg: OptimizerConfig, keys, owner: str, here: str) -> None:
    """A key another optimizer reads, set away from its default here, is an error, not ignored."""
    fields = OptimizerConfig.__dataclass_fields__
    for key in keys:
        if key in fields and getattr(cfg, key) != fields[key].default:
            raise ValueError(f"optimizer.{key}={getattr(cfg, key)!r} is {owner} option; "
                             f"optimizer={here} does not use it (leave it at {fields[key].default!r})")


def _needs_shared_steps(cfg: OptimizerConfig, setting: str, does: str) -> None:
    """``setting`` acts on the local steps over a shared denominator: refused where there are none."""
    if cfg.normalizer == "local" or cfg.exchange != "drift":
        raise ValueError(f"optimizer.{setting} {does}; it needs optimizer.normalizer=shared, revealed or oracle "
                         f"and optimizer.exchange=drift")


def embedding_denominator_beta(cfg: OptimizerConfig) -> Optional[float]:
    """D's memory on the embedding tables: ``embedding_denominator_beta``; where that is None and
    the tables train faster than the lr (``embedding_lr_scale`` > 1),
    ``scaled_embedding_denominator_beta``; None = ``denominator_beta`` (the rest's memory)."""
    if cfg.embedding_denominator_beta is not None:
        return float(cfg.embedding_denominator_beta)
    if cfg.scaled_embedding_denominator_beta is not None and embedding_lr_scale(cfg) > 1:
        return float(cfg.scaled_embedding_denominator_beta)
    return None


def embedding_step_bound(cfg: OptimizerConfig) -> float:
    """The bound on the embedding tables' local steps: ``embedding_step_bound``; where that is 0
    and the tables train faster than the lr (``embedding_lr_scale`` > 1),
    ``scaled_embedding_step_bound``; 0 = ``step_bound`` (the rest's bound). The scaled key only
    tightens: a hand-set ``step_bound`` below it holds on the tables too."""
    if cfg.embedding_step_bound:
        return float(cfg.embedding_step_bound)
    scaled = float(cfg.scaled_embedding_step_bound)
    if scaled and embedding_lr_scale(cfg) > 1 and not 0 < cfg.step_bound < scaled:
        return scaled
    return 0.0


def _check_memory(cfg: OptimizerConfig, key: str) -> None:
    memory = getattr(cfg, key)
    if memory is None:
        return
    if not (isinstance(memory, (int, float)) and not isinstance(memory, bool) and 0 <= memory < 1):
        raise ValueError(f"optimizer.{key}={memory!r} must lie in [0, 1) (the shared denominator's average "
                         f"of q^2 per step covered; null = {'betas[1]' if key == 'denominator_beta' else 'denominator_beta'})")
    if key == "scaled_embedding_denominator_beta":
        return  # read only with embedding_lr_scale > 1, which needs a shared denominator itself
    if cfg.normalizer == "local" and cfg.exchange == "drift":
        raise ValueError(f"optimizer.{key}={memory} sets the shared denominator's memory; it needs "
                         f"optimizer.normalizer=shared, revealed or oracle (or exchange=momentum)")


def validate_config(cfg: OptimizerConfig) -> None:
    sparsity = cfg.sparsity
    if not (isinstance(sparsity, (int, float)) and 0.0 <= sparsity < 1.0):
        raise ValueError(f"optimizer.sparsity={sparsity!r} must lie in [0, 1) "
                         f"(0 = dense, 0.99 = send 1% of the values)")
    _choice("mask_transport", cfg.mask_transport, TRANSPORTS)
    _choice("topk_method", cfg.topk_method, TOPK_METHODS)
    _choice("value_dtype", cfg.value_dtype, VALUE_DTYPES)
    _choice("update", cfg.update, UPDATES)
    _choice("base", cfg.base, BASES)
    _choice("score", cfg.score, SCORES)
    _choice("lag", cfg.lag, (True, False))
    _choice("overlap_backward", cfg.overlap_backward, (True, False))
    _choice("offload_residual", cfg.offload_residual, (True, False))
    if int(cfg.dense_warmup_steps) != cfg.dense_warmup_steps or cfg.dense_warmup_steps < 1:
        raise ValueError(f"optimizer.dense_warmup_steps={cfg.dense_warmup_steps!r} must be an integer "
                         f">= 1: step 1 is always dense (it produces the first mask)")
    if int(cfg.sparsity_warmup_steps) != cfg.sparsity_warmup_steps or cfg.sparsity_warmup_steps < 0:
        raise ValueError(f"optimizer.sparsity_warmup_steps={cfg.sparsity_warmup_steps!r} must be an "
                         f"integer >= 0 (0 = off)")
    _choice("score_timing", cfg.score_timing, SCORE_TIMINGS)
    _choice("stale_scale", cfg.stale_scale, STALE_SCALES)
    _choice("lossless_clip", cfg.lossless_clip, (True, False))
    cap = cfg.stale_scale_cap
    if not (isinstance(cap, (int, float)) and math.isfinite(cap) and (cap == 0 or cap >= 1)):
        raise ValueError(f"optimizer.stale_scale_cap={cap!r} must be 0 (cap = 1 / density), 1 (off) "
                         f"or a number > 1")
    if cap != 1 and cfg.update != "lazy":
        raise ValueError(f"optimizer.stale_scale_cap={cfg.stale_scale_cap} scales lazy updates only; "
                         f"it needs optimizer.update=lazy, got {cfg.update!r}")
    if not (isinstance(cfg.outer_lr, (int, float)) and cfg.outer_lr > 0):
        raise ValueError(f"optimizer.outer_lr={cfg.outer_lr!r} must be a number > 0 (1 = plain averaging)")
    if not (isinstance(cfg.outer_momentum, (int, float)) and 0 <= cfg.outer_momentum < 1):
        raise ValueError(f"optimizer.outer_momentum={cfg.outer_momentum!r} must lie in [0, 1) "
                         f"(0 = plain averaging)")
    _choice("mask_rule", cfg.mask_rule, MASK_RULES)
    _choice("normalizer", cfg.normalizer, NORMALIZERS)
    _choice("exchange", cfg.exchange, EXCHANGES)
    if not (isinstance(cfg.step_bound, (int, float)) and math.isfinite(cfg.step_bound) and cfg.step_bound >= 0):
        raise ValueError(f"optimizer.step_bound={cfg.step_bound!r} must be a number >= 0 "
                         f"(0 = sqrt(copies / (1 - b2)), AdamS's largest step on a copy's share of the batch)")
    fresh = cfg.fresh_step_bound
    if not (isinstance(fresh, (int, float)) and math.isfinite(fresh) and fresh >= 0):
        raise ValueError(f"optimizer.fresh_step_bound={fresh!r} must be a number >= 0 "
                         f"(0 = optimizer.step_bound on every coordinate)")
    embedding = cfg.embedding_step_bound
    if not (isinstance(embedding, (int, float)) and math.isfinite(embedding) and embedding >= 0):
        raise ValueError(f"optimizer.embedding_step_bound={embedding!r} must be a number >= 0 "
                         f"(0 = optimizer.step_bound on the embedding tables too)")
    scaled = cfg.scaled_embedding_step_bound
    if not (isinstance(scaled, (int, float)) and not isinstance(scaled, bool) and math.isfinite(scaled)
            and scaled >= 0):
        raise ValueError(f"optimizer.scaled_embedding_step_bound={scaled!r} must be a number >= 0 (the bound "
                         f"on the embedding tables where embedding_lr_scale > 1; 0 = optimizer.step_bound)")
    _choice("average_momentum", cfg.average_momentum, (True, False))
    floor = cfg.own_denominator_floor
    if not (isinstance(floor, (int, float)) and not isinstance(floor, bool) and math.isfinite(floor) and floor >= 0):
        raise ValueError(f"optimizer.own_denominator_floor={floor!r} must be a number >= 0 (0 = no floor; "
                         f"f: D >= the copy's own AdamS denominator / (f copies))")
    if floor and (cfg.normalizer == "local" or cfg.exchange != "drift" or cfg.local_momentum != "own"):
        raise ValueError(f"optimizer.own_denominator_floor={floor} floors the shared denominator of a copy's "
                         "own momentum step; it needs optimizer.normalizer=shared, revealed or oracle, "
                         "exchange=drift and local_momentum=own")
    if cfg.average_momentum and cfg.exchange == "momentum":
        raise ValueError("optimizer.average_momentum=true snaps the momenta where the drifts are averaged; "
                         "optimizer.exchange=momentum averages momentum sums instead: use exchange=drift")
    _choice("local_momentum", cfg.local_momentum, LOCAL_MOMENTA)
    if cfg.local_momentum == "consensus" and (cfg.normalizer != "shared" or cfg.exchange != "drift"
                                              or cfg.average_momentum):
        raise ValueError("optimizer.local_momentum=consensus estimates the shared momentum from the averaged drift "
                         "over the shared denominator; it needs optimizer.normalizer=shared, exchange=drift and "
                         "average_momentum=false")
    power = cfg.density_lr_power
    if not (isinstance(power, (int, float)) and math.isfinite(power)):
        raise ValueError(f"optimizer.density_lr_power={power!r} must be a number (0 = constant density, "
                         f"1 = the density falls with the lr, -1 = it rises as the lr falls)")
    floor = cfg.min_sparsity
    # with the density falling with the lr (power > 0) the bound may sit below the base density: it
    # caps the bytes per step at the peak lr; otherwise a bound above the sparsity would cut the base
    if power > 0 and not (isinstance(floor, (int, float)) and 0.0 <= floor < 1.0):
        raise ValueError(f"optimizer.min_sparsity={floor!r} must lie in [0, 1): it caps the density that "
                         f"density_lr_power={power} sets, the bytes per step at the peak lr (0 = no cap)")
    if power <= 0 and not (isinstance(floor, (int, float)) and 0.0 <= floor <= sparsity):
        raise ValueError(f"optimizer.min_sparsity={floor!r} must lie in [0, optimizer.sparsity={sparsity}]: "
                         f"it bounds the density that density_lr_power sets (0 = no bound)")
    if not (isinstance(cfg.ranks_per_copy, int) and not isinstance(cfg.ranks_per_copy, bool)
            and cfg.ranks_per_copy >= 1):
        raise ValueError(f"optimizer.ranks_per_copy={cfg.ranks_per_copy!r} must be an integer >= 1 "
                         f"(1 = a copy per rank; the GPUs per node = a copy per node)")
    _choice("value_bits", cfg.value_bits, (0, *QUANTIZED_BITS))
    if cfg.value_bits and (cfg.normalizer in ("revealed", "oracle") or cfg.average_momentum
                           or cfg.exchange != "drift"):
        raise ValueError(f"optimizer.value_bits={cfg.value_bits} quantizes the drifts only; it needs "
                         f"optimizer.normalizer=local or shared, average_momentum=false and exchange=drift")
    _choice("value_quantizer", cfg.value_quantizer, VALUE_QUANTIZERS)
    if cfg.value_quantizer == "midtread" and cfg.value_bits not in MIDTREAD_BITS:
        raise ValueError(f"optimizer.value_quantizer=midtread has 2^b - 1 levels, one of them 0; it needs "
                         f"optimizer.value_bits={' or '.join(map(str, MIDTREAD_BITS))}, not {cfg.value_bits}")
    _choice("quantized_collective", cfg.quantized_collective, QUANTIZED_COLLECTIVES)
    if cfg.quantized_collective != "all_gather" and not cfg.value_bits:
        raise ValueError(f"optimizer.quantized_collective={cfg.quantized_collective} says how quantized drifts "
                         f"travel; it needs optimizer.value_bits=1, 2 or 4")
    _choice("requantization_error", cfg.requantization_error, REQUANTIZATION_ERRORS)
    _choice("grad_clip_scope", cfg.grad_clip_scope, GRAD_CLIP_SCOPES)
    if cfg.requantization_error != "copy" and cfg.quantized_collective != "compressed_all_reduce":
        raise ValueError(f"optimizer.requantization_error={cfg.requantization_error} says where the owners' second "
                         f"quantization error goes; it needs optimizer.quantized_collective=compressed_all_reduce")
    _choice("clamp_excess", cfg.clamp_excess, CLAMP_EXCESSES)
    if cfg.clamp_excess != "drop":
        _needs_shared_steps(cfg, f"clamp_excess={cfg.clamp_excess}", "sends what the step bound cuts off a local "
                            "step over a shared denominator with the drift")
    if fresh and cfg.normalizer == "local":
        raise ValueError(f"optimizer.fresh_step_bound={fresh} bounds the steps over a freshly exchanged shared "
                         f"denominator; it needs optimizer.normalizer=shared, revealed or oracle")
    if embedding:
        _needs_shared_steps(cfg, f"embedding_step_bound={embedding}", "bounds the local steps over a shared "
                            "denominator on the embedding tables")
    lr_scale = embedding_lr_scale(cfg)
    if lr_scale != 1 and cfg.name == "sparse_avg":  # SCAPE scales its one step (scape/update.py)
        _needs_shared_steps(cfg, f"embedding_lr_scale={lr_scale:g}", "scales the local steps over a shared "
                            "denominator on the embedding tables")
    if cfg.step_bound and cfg.normalizer == "local":
        raise ValueError(f"optimizer.step_bound={cfg.step_bound} bounds the steps over a shared denominator; "
                         f"it needs optimizer.normalizer=shared, revealed or oracle")
    if cfg.exchange == "momentum" and (cfg.normalizer != "local" or cfg.outer_lr != 1 or cfg.outer_momentum != 0
                                       or cfg.mask_rule == "deviation"):
        raise ValueError("optimizer.exchange=momentum steps the consensus on the averaged momentum over its own "
                         "shared denominator; it needs optimizer.normalizer=local, outer_lr=1, outer_momentum=0 "
                         "and a mask_rule other than deviation")
    scale = cfg.local_step_scale
    if not (isinstance(scale, (int, float)) and 0 <= scale <= 1):
        raise ValueError(f"optimizer.local_step_scale={scale!r} must lie in [0, 1] (1 = the copies take "
                         f"their whole local step; 0 = min(1, (4 / copies)^local_step_scale_power))")
    table = cfg.embedding_local_step_scale
    if not (isinstance(table, (int, float)) and 0 <= table <= 1):
        raise ValueError(f"optimizer.embedding_local_step_scale={table!r} must lie in [0, 1] (the share of its "
                         f"local step a copy takes on the embedding tables; 0 = optimizer.local_step_scale)")
    if table:
        _needs_shared_steps(cfg, f"embedding_local_step_scale={table}", "scales the local steps over a shared "
                            "denominator on the embedding tables")
    for key in ("denominator_beta", "embedding_denominator_beta", "scaled_embedding_denominator_beta"):
        _check_memory(cfg, key)
    score_scale = cfg.embedding_score_scale
    if not (isinstance(score_scale, (int, float)) and math.isfinite(score_scale) and score_scale > 0):
        raise ValueError(f"optimizer.embedding_score_scale={score_scale!r} must be a number > 0 (the top-k score "
                         f"of the embedding tables' drifts times it; 1 = scored as the rest)")
    if score_scale != 1 and cfg.mask_rule not in ("drift", "deviation"):
        raise ValueError(f"optimizer.embedding_score_scale={score_scale:g} scales the drifts' top-k score; "
                         f"optimizer.mask_rule={cfg.mask_rule} does not score them: leave it 1")
    power = cfg.local_step_scale_power
    if not (isinstance(power, (int, float)) and 0 <= power <= 1):
        raise ValueError(f"optimizer.local_step_scale_power={power!r} must lie in [0, 1]: with local_step_scale=0 "
                         f"the copies take min(1, (4 / copies)^power) of their step (0 = the whole step, 0.5 = "
                         f"4 copies' spread on any number)")
    if cfg.normalizer != "local" and (cfg.outer_lr != 1 or cfg.outer_momentum != 0):
        raise ValueError(f"optimizer.normalizer={cfg.normalizer} reads the mean momentum from the plainly averaged "
                         "drift; it needs optimizer.outer_lr=1 and optimizer.outer_momentum=0")
    b1, b2 = cfg.betas
    if not (0.0 <= b1 < 1.0 and 0.0 <= b2 < 1.0):
        raise ValueError(f"optimizer.betas={list(cfg.betas)} must lie in [0, 1)")
