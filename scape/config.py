"""The optimizer selector's config schema (Hydra group ``optimizer``).

One dataclass for AdamW, AdamS and SCAPE: the keys every optimizer reads come from
core.optim.DenseOptimizerConfig; the SCAPE keys (docs/specs/SCAPE.md, "Options") are ignored by
the dense optimizers.
"""
from __future__ import annotations

from dataclasses import dataclass

from core.optim import DenseOptimizerConfig


@dataclass
class OptimizerConfig(DenseOptimizerConfig):
    # --- SCAPE ---
    sparsity: float = 0.99
    dense_warmup_steps: int = 1
    sparsity_warmup_steps: int = 0
    mask_transport: str = "auto"  # bitmap | indices | auto
    value_dtype: str = "fp32"  # fp32 | bf16
    offload_residual: bool = False
    lag: bool = True
    update: str = "lazy"  # lazy | all
    stale_scale_cap: int = 1
    base: str = "adams"  # adams | adamw
    score: str = "moment"  # moment | gradient
