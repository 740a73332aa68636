"""The optimizer selector's config schema (Hydra group ``optimizer``).

One dataclass for AdamW, AdamS, SCAPE and sparse model averaging: the keys every optimizer reads
come from core.optim.DenseOptimizerConfig; the SCAPE keys (docs/specs/SCAPE.md, "Options") are
ignored by the dense optimizers (sparse_avg reads the mask keys and refuses the SCAPE-only ones).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from core.optim import DenseOptimizerConfig


@dataclass
class OptimizerConfig(DenseOptimizerConfig):
    # --- SCAPE ---
    sparsity: float = 0.99
    dense_warmup_steps: int = 1
    sparsity_warmup_steps: int = 0
    mask_transport: str = "auto"  # bitmap | indices | auto
    topk_method: str = "exact"  # exact | threshold: how the k per partition are found (same k, same set)
    value_dtype: str = "fp32"  # fp32 | bf16
    offload_residual: bool = False
    lag: bool = True
    overlap_backward: bool = True  # with lag: the value all-reduce starts during the last backward
    update: str = "lazy"  # lazy | all
    # the study's rule (conf/optimizer/scape.yaml); the spec's: pre_send, steps, 1 (optimizer=scape_spec)
    score_timing: str = "post_step"  # post_step | pre_send (with lag=true; lag=false scores the step itself)
    stale_scale: str = "lr_sum"  # lr_sum | steps: how the staleness of a lazy step is measured
    stale_scale_cap: float = 32.0  # 1 = off; > 1: scale a lazy step by min(staleness, cap); 0 = 1/density
    # read by SCAPE's synchroniser until it drops the rule (measured worse; docs/JOURNAL.md): always False
    lossless_clip: bool = False
    base: str = "adams"  # adams | adamw
    score: str = "moment"  # moment | gradient
    # --- sparse model averaging (optimizer=sparse_avg) only ---
    # the density follows the lr: (1 - sparsity) x (lr_t / lr)^density_lr_power, lr_t the last
    # step's lr and lr the peak; at most 1 - min_sparsity, never below the sparsity warm-up's
    density_lr_power: float = 0.0
    min_sparsity: float = 0.0
    # the share of its local step a copy takes: y_i moves by local_step_scale x the step, and an
    # exchange adds the mean drift / local_step_scale to x, so the averaged model moves as at 1
    # while the copies stray less from x. 0 = min(1, (4 / copies)^local_step_scale_power)
    local_step_scale: float = 1.0
    local_step_scale_power: float = 0.37
    # the shared denominator's memory: D^2 is an average of the revealed q^2 with this beta per
    # step covered (None = betas[1]; 0 = D is the last revealed |q|)
    denominator_beta: Optional[float] = None
    # denominator_beta on the embedding tables' coordinates (None = denominator_beta)
    embedding_denominator_beta: Optional[float] = None
    # the tables' memory where they train faster than the lr (embedding_lr_scale > 1) and
    # embedding_denominator_beta is None; None = denominator_beta there too
    scaled_embedding_denominator_beta: Optional[float] = None
    # ranks that train one copy together (a dense gradient all-reduce among them, as DDP): set
    # to the GPUs per node and the sparse exchange runs between nodes only, among fewer copies
    ranks_per_copy: int = 1
    # the bound on a local step's |(m / bc) / D|; 0 = sqrt(copies / (1 - b2)), AdamS's largest step
    # on one copy's share of the batch
    step_bound: float = 0.0
    # the bound on the coordinates of the model's embedding tables; 0 = step_bound
    embedding_step_bound: float = 0.0
    # the tables' bound where they train faster than the lr (embedding_lr_scale > 1) and
    # embedding_step_bound is 0; 0 = step_bound there too
    scaled_embedding_step_bound: float = 0.0
    # f > 0: a copy's local step divides by max(D, its own AdamS denominator / (f copies)); 0 = no floor
    own_denominator_floor: float = 0.0
    # 0: the drifts travel in value_dtype through one all-reduce; 1, 2 or 4: as that many bits per
    # value (one value_dtype scale per 64 values; scape/quantize.py) through a compressed
    # all-reduce, each copy keeping what its codes leave out and each chunk's owner what its
    # re-quantized mean leaves out
    value_bits: int = 0
