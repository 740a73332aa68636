"""The configs of the methods' optimizers (Hydra group ``optimizer``): one dataclass each.

``ScapeConfig`` (``optimizer=scape``; the spec's rule is ``optimizer=scape_spec``) and
``SparseAverageConfig`` (``optimizer=sparse_avg``) add their keys to the ones every optimizer
reads (core.optim.DenseOptimizerConfig, whose ``AdamWConfig`` and ``AdamSConfig`` are the dense
optimizers'). Each checks its own values when it is built, and its defaults are the ones its
conf/optimizer/*.yaml file composes to (tests/trainer/test_config.py). The one exception is the
sparsity warm-up, which the yaml files tie to the run's own schedule (0 here: none).
``optimizer_config`` builds the right one from a name and its values, refusing a key the
optimizer does not have.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, ClassVar, Dict, Mapping, Optional, Tuple, Type

from core.optim import AdamSConfig, AdamWConfig, DenseOptimizerConfig, as_param_groups


@dataclass
class ScapeConfig(DenseOptimizerConfig):
    """SCAPE (docs/specs/SCAPE.md, "Options"): AdamS with sparse, shared-mask communication of
    the first-moment contribution. The defaults are the study's rule; ``SPEC_RULE`` is the
    spec's as written (``optimizer=scape_spec``)."""
    name: str = "scape"
    sparsity: float = 0.99  # 1 - density: k = ceil((1 - sparsity) * partition) values per partition
    dense_warmup_steps: int = 1  # the first W steps all-reduce the dense gradient (>= 1: no mask yet)
    sparsity_warmup_steps: int = 0  # density from 1 to 1 - sparsity geometrically over this many steps
    mask_transport: str = "auto"  # bitmap | indices | auto (indices when density < 1/32)
    topk_method: str = "exact"  # exact | threshold: how the k per partition are found (same k, same set)
    value_dtype: str = "fp32"  # fp32 | bf16: the all-reduce payload
    offload_residual: bool = False  # the residual in CPU memory, streamed in double-buffered chunks
    overlap_backward: bool = True  # with lag: the value all-reduce starts during the last backward
    update: str = "lazy"  # lazy (mask only) | all (AdamS everywhere, ghat = 0 off the mask)
    score_timing: str = "post_step"  # post_step (b1 m_t + e after the send) | pre_send (the spec's)
    stale_scale: str = "lr_sum"  # lr_sum | steps: how the staleness of a lazy step is measured
    stale_scale_cap: float = 32.0  # 1 = off; > 1: scale a lazy step by min(staleness, cap); 0 = 1/density
    # the paper's ablations, which the study reproduces (docs/specs/SCAPE.md, "Ablations")
    lag: bool = True  # false: the mask from the current step, its all-gather on the critical path
    base: str = "adams"  # adamw: keep v, Adam's bias corrections
    score: str = "moment"  # gradient: top-k of |a| (DGC-style)

    # the spec's rule as written: the next mask scored before the send, no catch-up, no sparsity warm-up
    SPEC_RULE: ClassVar[Dict[str, Any]] = dict(score_timing="pre_send", stale_scale="steps",
                                               stale_scale_cap=1.0, sparsity_warmup_steps=0)
    # not an option of SCAPE: clipping drops what it removes
    lossless_clip: ClassVar[bool] = False

    def __post_init__(self) -> None:
        super().__post_init__()
        from scape.options import validate_config

        validate_config(self)


@dataclass
class SparseAverageConfig(DenseOptimizerConfig):
    """Sparse model averaging (scape/sparse_averaging.py): every rank steps its own copy over one shared
    denominator; each step averages the drifts of the next window of a fixed cycle of
    coordinates, as 2-bit codes through a compressed all-reduce, as many a step as the byte
    budget plans from the run's lr schedule (scape/budget.py)."""
    name: str = "sparse_avg"
    lr: float = 1e-3
    # bytes per rank per step over the run, every exchange of the drifts counted (scape/budget.py):
    # 0 = SCAPE-99's sparse step for this model and world; in (0, 1]: that fraction of the dense
    # fp32 all-reduce
    byte_budget: float = 0.0
    dense_warmup_steps: int = 1  # steps 2..W average the whole drift
    sparsity_warmup_steps: int = 0  # density from 1 to the planned one geometrically over this many steps
    value_bits: int = 2  # 1, 2 or 4: the drifts as codes (compressed all-reduce) | 0: value_dtype values
    value_dtype: str = "bf16"  # bf16 | fp32: the codes' scales (with value_bits 0: the drifts)
    # the largest local step over the shared denominator, in lr: 0 = sqrt(copies / (1 - b2))
    step_bound: float = 0.0
    # the share of its local step a copy takes: 0 = min(1, (4 / copies) ^ local_step_scale_power)
    local_step_scale: float = 0.0
    local_step_scale_power: float = 0.37
    ranks_per_copy: int = 1  # ranks that train one copy (their gradients averaged densely, as DDP)

    # a parameter group may set its own lr multiple, local-step bound and denominator memory
    GROUP_FIELDS: ClassVar[Tuple[str, ...]] = ("lr_scale", "step_bound", "denominator_beta")
    # not options here: every rank computes the cycle alike, no score is ranked, and the density
    # is the byte budget's plan (MaskExchange's own schedule, unused, stays at density 1)
    mask_transport: ClassVar[str] = "auto"
    topk_method: ClassVar[str] = "exact"
    sparsity: ClassVar[float] = 0.0

    def __post_init__(self) -> None:
        super().__post_init__()
        from scape.options import validate_sparse_avg

        validate_sparse_avg(self)


OPTIMIZER_CONFIGS: Dict[str, Type[DenseOptimizerConfig]] = {
    "adamw": AdamWConfig, "adams": AdamSConfig, "scape": ScapeConfig, "sparse_avg": SparseAverageConfig}


_OWNERS = {"adamw": "an AdamW", "adams": "an AdamS", "scape": "a SCAPE", "sparse_avg": "a sparse_avg"}


def config_keys(name: str) -> tuple:
    return tuple(f.name for f in fields(OPTIMIZER_CONFIGS[name]))


def refuse_unknown_keys(name: str, values: Mapping[str, Any]) -> None:
    """A key optimizer=name does not have is an error naming it (and the optimizer it belongs to)."""
    if name not in OPTIMIZER_CONFIGS:
        raise ValueError(f"optimizer.name={name!r} must be one of {', '.join(OPTIMIZER_CONFIGS)}")
    known = config_keys(name)
    as_param_groups(values.get("param_groups"))  # a group's unknown field, before the schema sees it
    for key in values:
        if key in known:
            continue
        owners = [_OWNERS[other] for other in OPTIMIZER_CONFIGS if key in config_keys(other)]
        where = f"is {owners[-1]} option; " if owners else "is not a key; "
        raise ValueError(f"optimizer.{key}={values[key]!r} {where}optimizer={name} does not use it (its keys: "
                         f"{', '.join(known)}): remove it, or choose the optimizer that has it")


def optimizer_config(values: Optional[Mapping[str, Any]] = None, **more: Any) -> DenseOptimizerConfig:
    """The config of optimizer ``values["name"]`` (adamw if none) from its values: unknown keys
    refused, every value checked by the dataclass."""
    values = {**(values or {}), **more}
    name = values.get("name", "adamw")
    refuse_unknown_keys(name, values)
    cls = OPTIMIZER_CONFIGS[name]
    try:  # the values as the schema types them (a command line's "3" for a float), else a clear error
        from omegaconf import OmegaConf
        from omegaconf.errors import ValidationError
    except ImportError:  # pragma: no cover - hydra is a dependency of the trainer
        return cls(**values)
    try:
        typed = OmegaConf.to_container(OmegaConf.merge(OmegaConf.structured(cls), values))
    except ValidationError as exc:
        raise ValueError(f"optimizer={name}: {exc}".splitlines()[0] + f" (key {exc.full_key})") from None
    return cls(**typed)


# the config of the optimizer its ``name`` says (AdamW without one): one call for every optimizer
OptimizerConfig = optimizer_config
