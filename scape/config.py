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
    lossless_clip: bool = False  # the part of ghat that clipping removes goes back to the residual
    base: str = "adams"  # adams | adamw
    score: str = "moment"  # moment | gradient
    # --- sparse model averaging (optimizer=sparse_avg) only ---
    # outer Nesterov step on the averaged drift (DiLoCo's outer optimizer, per coordinate, applied
    # when the coordinate is exchanged); 1 and 0 = plain averaging
    outer_lr: float = 1.0
    outer_momentum: float = 0.0
    # how the exchanged coordinates are chosen: the owner's top-k of drift |y_i - x| or of
    # deviation |y_i - x - v age| (v: the consensus's drift per step at the coordinate's last
    # exchange, so agreed movement scores low), or a uniform draw (random), each all-gathered;
    # cyclic: every rank walks the same fixed permutation of each partition, k a step, so no
    # mask crosses the network
    mask_rule: str = "drift"
    # the denominator of the local AdamS steps: each rank's own (local) or one replicated
    # denominator (shared) built from the momentum the averaged drifts reveal, so every local
    # step is linear and the average of the local steps is the step on the mean momentum;
    # revealed: the same, D from the mean momentum itself, sent beside the drifts (twice the values);
    # oracle: D from every coordinate's mean momentum at every step, one extra dense all-reduce a
    # step -- a decomposition tool (what the sparse estimate of D costs), not an efficient setting
    normalizer: str = "local"
    # the momenta travel beside the drifts (twice the values; with normalizer=revealed they are
    # already there) and every rank's momentum snaps to their mean where the copies snap to x
    average_momentum: bool = False
    # the momentum of the local steps: own (each rank's momentum of its own gradients) or consensus
    # (MimeLite's rule: one replicated momentum M, frozen between a coordinate's exchanges and
    # re-estimated at each from the mean step the averaged drift reveals; a local step is
    # b1 M + (1 - b1) g_i, so the copies share the momentum and differ by one step's gradient
    # noise only). consensus needs normalizer=shared
    local_momentum: str = "own"
    # the density follows the lr: (1 - sparsity) x (lr_t / lr)^density_lr_power, lr_t the last
    # step's lr and lr the peak; 0 = constant, 1 = falls with the lr (the copies are averaged
    # less often as it decays), -1 = rises as it falls; at most 1 - min_sparsity (a byte budget
    # per step), and never below the sparsity warm-up's
    density_lr_power: float = 0.0
    min_sparsity: float = 0.0
    # the share of its local step a copy takes (normalizer shared, revealed or oracle): y_i moves by
    # local_step_scale x the step, and an exchange adds the mean drift / local_step_scale to x, so
    # the consensus and the averaged model move as at 1 while the copies stray less from x
    # between exchanges (their gradients are taken nearer x); towards 0 each coordinate's update
    # reaches x only at its exchange, a delayed dense step. 0 = min(1, (4 / copies)^power), power
    # local_step_scale_power (0.5 holds the copies' spread at what 4 copies have at the whole step)
    local_step_scale: float = 1.0
    local_step_scale_power: float = 0.37
    # the share on the embedding tables; 0 = local_step_scale. With embedding_lr_scale k a share
    # of local_step_scale / k moves the copies' tables as at k = 1 while x moves by k lr there
    embedding_local_step_scale: float = 0.0
    # the top-k score of the embedding tables' coordinates times this (mask_rule drift or
    # deviation). With embedding_lr_scale k the tables' drifts are k times larger than the rest's
    # for the same number of steps; in a partition that holds a table and other weights they
    # then take its values, and 1 / k scores the table in the rest's units
    embedding_score_scale: float = 1.0
    # the shared denominator's memory: D^2 is an average of the revealed q^2 with this beta per
    # step covered (None = betas[1], an EMA over ~20 steps; 0 = D is the last revealed |q|).
    # AdamS's own denominator has no memory (sqrt(b2 m^2 + (1 - b2) g^2) of this step); a shorter
    # one lets D follow a momentum that decays, a longer one averages more samples of q
    # (docs/RESULTS.md compares them)
    denominator_beta: Optional[float] = None
    # denominator_beta on the embedding tables' coordinates (None = denominator_beta): a row whose
    # token stopped appearing keeps moving under AdamS while its momentum decays; a beta below
    # b2 lets D^2 there fall as fast as the momentum's square (b1^2 a step), so the row keeps moving
    embedding_denominator_beta: Optional[float] = None
    # the tables' memory where they train faster than the lr (embedding_lr_scale > 1) and
    # embedding_denominator_beta is None; None = denominator_beta there too. With the table at
    # k lr such a row moves k times as far before it stops, and a short memory stops it sooner;
    # at k = 1 the same memory is worse, so the shipped default (conf/optimizer/sparse_avg.yaml)
    # follows the table's lr (docs/RESULTS.md, "The table's memory becomes the default")
    scaled_embedding_denominator_beta: Optional[float] = None
    # whose norm clips a copy's gradient at grad_clip: rank (each copy by its own norm, so the
    # mean gradient weighs each copy's by 1 / its norm while it is clipped) or shared (every copy
    # by the same factor, grad_clip / the copies' RMS norm: the mean is the mean gradient scaled
    # once, as DDP's clip scales it; no extra bytes, the squared norms already cross)
    grad_clip_scope: str = "rank"
    # ranks that train one copy together (a dense gradient all-reduce among them, as DDP): set
    # to the GPUs per node and the sparse exchange runs between nodes only, among fewer copies
    # (consecutive ranks form a copy; the exchange group is one rank of each copy)
    ranks_per_copy: int = 1
    # shared / revealed: the bound on a local step's |(m / bc) / D|; 0 = sqrt(copies / (1 - b2)),
    # AdamS's largest step on one copy's share of the batch (a small bound makes the local steps
    # sign steps of size lr * bound)
    step_bound: float = 0.0
    # the bound where a coordinate's D was refreshed at this step's exchange (its age is 0; every
    # coordinate at density 1); 0 = step_bound. Between exchanges D ages, and the bound is for that
    fresh_step_bound: float = 0.0
    # the bound on the coordinates of the model's embedding tables (torch.nn.Embedding weights);
    # 0 = step_bound. A token only one copy's batch holds has its whole gradient on that copy, so
    # its row's local steps are the ones the bound clamps most (docs/RESULTS.md, "What the step
    # bound protects, and where it binds")
    embedding_step_bound: float = 0.0
    # the tables' bound where they train faster than the lr (embedding_lr_scale > 1) and
    # embedding_step_bound is 0; 0 = step_bound there too. A row of a token that only a few
    # copies' batches hold takes k times the rest's steps at k lr, and the copy's bound lets it
    # run on those few copies; AdamS's own largest step, 1 / sqrt(1 - b2), keeps it where one
    # copy training the whole batch would. At k = 1 the same bound costs, so the shipped default
    # (conf/optimizer/sparse_avg.yaml) follows the table's lr (docs/RESULTS.md, "The table's
    # bound becomes the default where the table's lr is raised")
    scaled_embedding_step_bound: float = 0.0
    # f > 0: a copy's local step divides by max(D, its own AdamS denominator / (f copies)). Where
    # one copy holds a coordinate's whole gradient (a token only its batch has) its step is then
    # at most f C times its own AdamS step, and the mean over the copies f times that AdamS step
    # (f = 1: as dense AdamS takes on the mean gradient); where the copies share the gradient the
    # floor is mostly below D. 0 = no floor
    own_denominator_floor: float = 0.0
    # what the bound cuts off a local step: drop (lost, the rule so far) or send (kept beside the
    # copy and added to its drift at the coordinate's next exchange: the copy stays within the
    # bound while the consensus moves by the mean of the unbounded steps; one more flat buffer)
    clamp_excess: str = "drop"
    # what the all-reduce averages: the drift y_i - x (the copies' mean becomes the consensus), or
    # momentum: each rank's lr-weighted sum of its momentum since the coordinate's last exchange,
    # on which the consensus takes its own step over one shared denominator (the copies only
    # say where the gradients are taken)
    exchange: str = "drift"
    # 0: the drifts travel in value_dtype through the all-reduce; 1, 2 or 4: each rank sends its
    # drifts on the mask as that many bits per value (uniform codes, one value_dtype scale per 64
    # values; scape/quantize.py), the ranks all-gather the codes and average what they stand for,
    # and each copy keeps what its codes did not say (error feedback). An all-gather sends
    # (N - 1) / 2 times the bytes of an all-reduce of the same payload: on 4 ranks equal bytes
    # buy about 2x (4 bits) to 6x (1 bit) as many coordinates per step as bf16 values
    value_bits: int = 0
    # the codes' levels: midrise (2^b levels at +-1/2, +-3/2, ... steps: no level at 0) or midtread
    # (2^b - 1 levels at 0, +-1, ... steps; 2 or 4 bits), where a drift far below its block's RMS
    # reads back as 0 instead of half a step
    value_quantizer: str = "midrise"
    # how the codes travel: all_gather (every rank reads every rank's codes; exact mean of the
    # codes, (N - 1) x the payload) or compressed_all_reduce (an all-to-all to each chunk's owner,
    # which averages and quantizes again, then an all-gather: 2 (N - 1) / N x the payload, as an
    # all-reduce, so the bytes do not grow with the ranks)
    quantized_collective: str = "all_gather"
    # compressed_all_reduce: where the owner's re-quantization error of a chunk's mean goes.
    # copy: into the owner's own copy, C times (the copies' mean keeps it; that copy's drift sends
    # it again, but the copy trains C times the error away from the others); owner: into a buffer
    # over the owner's chunk, added to that chunk's next mean before it is quantized (1-bit
    # Adam's server-side error feedback), so no copy carries it; one buffer of 1 / C of the model
    requantization_error: str = "copy"
