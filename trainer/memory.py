"""The memory pre-flight: per-rank bytes of a run from its config, before anything is built.

``estimate_memory(cfg, world_size, device_type)`` adds up, for the rank that holds the most:

- persistent state: the fp32 parameters and gradients (flat or DDP buckets), the optimizer's and
  the synchroniser's buffers (AdamW's m and v, AdamS's m, SCAPE's momentum, staleness counters,
  residual on the device or the host, score, mask; sparse averaging's consensus and shared
  denominator; each 1/N of the flat buffer where ``optimizer.shard`` splits it);
- the forward/backward peak: the activations autograd saves (one micro-batch; with activation
  checkpointing the blocks' inputs plus one block recomputed), bf16 weight copies under
  autocast, the fused loss's chunk and its saved gradients, and the backward's working set;
- the optimizer step's transients (top-k at ``TOPK_BYTES_PER_ELEMENT``, payloads, the CPU
  reference kernels' temporaries);
- on the host: an offloaded residual and the checkpoint's copies.

The peak is the persistent state plus the larger of the two transient phases. The activation
terms count the tensors each implementation saves (models/llama.py, models/gpt.py,
models/cpu_kernels.py, models/loss.py); tests/trainer/test_memory.py holds them to autograd's
saved tensors and the whole estimate to the measured peak of tiny runs.

``check_memory`` is the Trainer's gate: it refuses a run whose estimate exceeds the device's
free memory (``torch.cuda.mem_get_info``) or, on CPU, the host's MemAvailable shared by the
local ranks, naming the estimate, the limit and the knobs that would make it fit.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any, List, Optional, Tuple

GIB = float(1 << 30)
# Threshold/exact top-k's working memory per element of a partition (scape/topk.py's bound).
TOPK_BYTES_PER_ELEMENT = 8
# The CUDA caching allocator's fragmentation and the collectives' buffers: a share of the peak.
CUDA_SLACK = 0.05
NCCL_BUFFER_BYTES = 0.5 * GIB  # per process with more than one rank (NCCL's channels and streams)


class MemoryPlanError(ValueError):
    """A run that cannot fit; the message names the estimate, the limit and the knobs."""


@dataclass
class MemoryPart:
    name: str
    bytes: float
    # persistent | activations (held through forward and backward) | forward (at its end: the
    # loss) | loss_backward | backward (a block's working set) | step | checkpoint | host
    phase: str


@dataclass
class MemoryEstimate:
    """Per-rank bytes of one run (the rank that holds the most)."""
    parts: List[MemoryPart] = field(default_factory=list)
    world_size: int = 1
    device_type: str = "cpu"

    def add(self, name: str, nbytes: float, phase: str) -> None:
        if nbytes > 0:
            self.parts.append(MemoryPart(name, float(nbytes), phase))

    def total(self, phase: str) -> float:
        """The phase's bytes; the step's parts come one after another, so its largest."""
        sizes = [p.bytes for p in self.parts if p.phase == phase]
        return max(sizes, default=0.0) if phase == "step" else sum(sizes)

    @property
    def device_peak(self) -> float:
        """Persistent state plus the larger transient phase (on CPU the checkpoint's copies too)."""
        backward = max(self.total("forward"), self.total("loss_backward"), self.total("backward"))
        phases = [self.total("activations") + backward, self.total("step")]
        if self.device_type == "cpu":
            phases.append(self.total("checkpoint"))
        peak = self.total("persistent") + max(phases) + (self.total("host") if self.device_type == "cpu" else 0)
        return peak * (1 + CUDA_SLACK) if self.device_type == "cuda" else peak

    @property
    def host_peak(self) -> float:
        """Host memory a GPU rank needs besides its process (offloaded residual, checkpoint copies)."""
        return self.total("host") + self.total("checkpoint")


# ------------------------------------------------------------------------------------ shapes
@dataclass(frozen=True)
class _Block:
    """One held block's widths: query width, k/v width, heads, MLP units."""
    q_width: int
    kv_width: int
    heads: int
    units: int


def _model_shape(model_cfg: Any, spec: Any) -> Tuple[int, List[_Block]]:
    """(parameters held, the held blocks' widths) of a (sub)network."""
    from models import build_model, count_parameters
    from models.common import resolved_ffn_hidden, resolved_kv_heads
    from models.subnet import SubnetSpec

    model = build_model(model_cfg, spec, device="meta")  # shapes only: nothing is allocated
    held = count_parameters(model)
    hd, group = model_cfg.d_model // model_cfg.n_head, model_cfg.n_head // resolved_kv_heads(model_cfg)
    spec = spec or SubnetSpec()
    blocks = []
    for layer in spec.held_blocks(model_cfg.n_layer):
        heads = spec.kept_heads(layer, model_cfg.n_head)
        kv_heads = len({h // group for h in heads}) if model_cfg.family == "llama" else len(heads)
        blocks.append(_Block(len(heads) * hd, kv_heads * hd, len(heads),
                             len(spec.kept_units(layer, resolved_ffn_hidden(model_cfg)))))
    return held, blocks


_SHAPES: dict = {}


def _rank_shapes(cfg: Any, world: int) -> Tuple[int, List[_Block], int]:
    """(held parameters, computed blocks, full parameters) of the rank holding the most; SDP's
    ranks hold subnetworks (forward masking computes only them). Cached per model, SDP and world."""
    key = (repr(cfg.model), repr(cfg.sdp), world)
    if key not in _SHAPES:
        _SHAPES[key] = _compute_rank_shapes(cfg, world)
    return _SHAPES[key]


def _compute_rank_shapes(cfg: Any, world: int) -> Tuple[int, List[_Block], int]:
    full, blocks = _model_shape(cfg.model, None)
    if cfg.sdp.kind == "none":
        return full, blocks, full
    from sdp.plan import make_plan

    plan = make_plan(cfg.model, cfg.sdp, world)
    ranks = [_model_shape(cfg.model, plan.subnet_spec(r)) for r in range(plan.workers)]
    held, sub_blocks = max(ranks, key=lambda shape: shape[0])
    return held, (sub_blocks if cfg.sdp.masking == "forward" else blocks), full


# ------------------------------------------------------------------------------ activations
def _kernel_path(cfg: Any, device_type: str) -> Tuple[str, int]:
    """('cpu' | 'stock', bytes of an activation): the CPU kernels run on CPU tensors (models/ops.py)."""
    precision = cfg.train.precision
    bf16 = precision == "bf16" or (precision == "auto" and device_type == "cuda")
    kernels = cfg.model.kernels
    cpu = kernels == "cpu" or (kernels == "auto" and device_type == "cpu")
    return ("cpu" if cpu else "stock"), (2 if bf16 and not cpu else 4)


def _block_bytes_per_token(family: str, path: str, a: int, d: int, b: _Block, length: int,
                           device_type: str = "cuda") -> float:
    """Bytes autograd saves per token in one block's forward (each line's comment lists them)."""
    q, kv, f, heads = b.q_width, b.kv_width, b.units, b.heads
    if path == "cpu":  # fp32, models/cpu_kernels.py: one GEMM per projection, shared input
        if length <= 512:  # blocked attention: the blocked q/k/v copies and the probabilities
            attention = 4 * (q + 2 * kv) + 2 * heads * (math.ceil(length / 64) * 64 + 64)
        else:  # SDPA's CPU flash kernel: q, k (rotated), v and the log-sum-exp
            attention = 4 * (q + 2 * kv) + 4 * heads
        if family == "llama":  # x, rstd, normed x, o_proj input; x', rstd, normed x'; gate, up, h
            return 4 * (d + d + q) + 4 + attention + 4 * (d + d) + 4 + 12 * f
        # x, normed x, o_proj input, LayerNorm statistics; x', normed x'; fc and gelu outputs
        return 4 * (d + d + q) + 16 + attention + 4 * (d + d) + 8 * f
    if family == "llama":  # models/ops.py's stock path: q/k/v and gate/up as one GEMM each
        # x, rstd, normed x (cast once under autocast); q/k/v output (RoPE keeps it whole), q and
        # k rotated, attention output, lse; x', rstd, normed x'; gate/up output, silu, product
        saved = (4 * d + 4 + a * d + a * (q + 2 * kv) + a * (q + kv) + a * q + 4 * heads
                 + 4 * d + 4 + a * d + 2 * a * f + 2 * a * f)
        if device_type == "cpu":  # F.rms_norm's CPU composite also keeps x / rms (CUDA's fused one not)
            saved += 2 * 4 * d
        return saved
    # GPT: x, LayerNorm statistics, normed x (fp32, cast once for the one q/k/v GEMM under
    # autocast); q/k/v output (its views kept whole), attention output, lse; x', normed x';
    # fc output, gelu output
    cast = 2 if a == 2 else 0
    return (4 * d + 8 + 4 * d * (a == 4) + cast * d + a * (q + 2 * kv) + a * q + 4 * heads
            + 4 * d + 8 + 4 * d * (a == 4) + cast * d + 2 * a * f)


def _block_weight_copies(family: str, path: str, a: int, d: int, b: _Block) -> float:
    """Bytes of weight copies a block's forward saves: the stacked q/k/v (and llama's gate/up)
    weights in the compute dtype, and under autocast bf16 copies of the other matrices."""
    stacked = (b.q_width + 2 * b.kv_width) * d + (2 * b.units * d if family == "llama" else 0)
    others = b.q_width * d + b.units * d * (1 if family == "llama" else 2)
    if path == "cpu":
        return 4 * 3 * b.q_width * d if family == "gpt" else 0
    return a * stacked + (2 * others if a == 2 else 0)


def _backward_bytes_per_token(path: str, a: int, d: int, b: _Block) -> float:
    """The working set of one block's backward: the gradients alive at once (fp32 stream)."""
    width = max(b.units, b.q_width + 2 * b.kv_width)
    return 3 * a * width + 4 * 4 * d if path == "stock" else 3 * 4 * width + 4 * 4 * d


def _add_activations(est: MemoryEstimate, cfg: Any, blocks: List[_Block], device_type: str, world: int) -> None:
    from models.loss import _chunk_rows

    m, t = cfg.model, cfg.train
    tokens = t.micro_batch_size * m.seq_len
    path, a = _kernel_path(cfg, device_type)
    per_block = [_block_bytes_per_token(m.family, path, a, m.d_model, b, m.seq_len, device_type) for b in blocks]
    largest = max(blocks, key=lambda b: b.units + b.q_width) if blocks else None
    if t.activation_checkpointing:  # each block keeps its input; backward recomputes one block
        est.add("activations: block inputs (checkpointed)", 4 * m.d_model * tokens * len(blocks), "activations")
        est.add("activations: one block recomputed", max(per_block, default=0) * tokens, "backward")
    else:
        est.add(f"activations: {len(blocks)} blocks x {tokens} tokens", sum(per_block) * tokens, "activations")
    if largest is not None:
        est.add("backward working set (one block)",
                _backward_bytes_per_token(path, a, m.d_model, largest) * tokens, "backward")
    # kept for backward, or with checkpointing until the forward ends (autocast's cache)
    est.add("weight copies of the forward", sum(_block_weight_copies(m.family, path, a, m.d_model, b)
                                                 for b in blocks),
            "forward" if t.activation_checkpointing else "activations")
    vocab, d = m.vocab_size, m.d_model
    est.add("final norm input", 4 * d * tokens, "activations")
    est.add("final norm output (the loss's input)", 4 * d * tokens, "forward")
    if m.loss == "standard":  # [N, V] logits, their fp32 copy, log-softmax, its gradient
        est.add("loss: [tokens, vocab] logits", (a + 12) * vocab * tokens, "forward")
        return
    rows = min(_chunk_rows(vocab, _device(device_type)), tokens)
    chunk = 4 * vocab * rows + (2 * 2 * vocab * rows + 2 * vocab * d if a == 2 else 0)
    est.add(f"loss: logits chunk of {rows} rows", chunk, "forward")
    saved = 4 * (d * tokens + vocab * d)
    est.add("loss: saved gradients (hidden, head)", saved, "forward")
    # backward scales them into new tensors while the saved ones are held (CUDA, or accum > 1)
    copies = 2 if device_type == "cuda" or _accumulation(cfg, world) > 1 else 1
    est.add("loss backward: the saved gradients and their scaled copies", copies * saved, "loss_backward")


def _device(device_type: str):
    import torch

    return torch.device(device_type)


def _accumulation(cfg: Any, world: int = 1) -> int:
    t = cfg.train
    return max(1, t.global_batch_tokens // (t.micro_batch_size * cfg.model.seq_len * world))


# ------------------------------------------------------------------------ optimizer state
def _add_dense(est: MemoryEstimate, cfg: Any, held: int, largest: int, world: int, device_type: str) -> None:
    """AdamW (m, v) or AdamS (m), replicated or ZeRO-1 (optimizer.shard: 1/N each, core/zero.py)."""
    o, cpu = cfg.optimizer, device_type == "cpu"
    moments = 2 if o.name == "adamw" else 1
    shard = o.shard and cfg.sdp.kind == "none"
    owned = math.ceil(held / world) if shard else held
    est.add(f"{o.name} state ({moments} x fp32{', 1/%d' % world if shard else ''})", 4 * moments * owned,
            "persistent")
    if shard:
        est.add("gradient shard", 4 * owned, "persistent")
        est.add("updated shard (all-gather input)", 4 * owned, "step")
    # torch's single-tensor AdamW and the AdamS reference hold temporaries of one tensor on CPU;
    # the fused CUDA kernels none
    temps = (2 if o.name == "adamw" else 1) * 4 * (owned if shard else largest)
    if cpu:
        est.add("optimizer temporaries (CPU)", temps, "step")


def _masks(cfg: Any, padded: int, world: int) -> Tuple[int, int]:
    """(partition size, the most values per partition a sparse step sends): SCAPE's schedule
    (scape/masking.py) at the first sparse step, sparse averaging's plan at its densest one."""
    import torch

    from scape.masking import MaskExchange
    from scape.options import as_dataclass
    from scape.partition import Partitioning

    layout = Partitioning(padded, world, world)
    if cfg.optimizer.name == "sparse_avg":  # the byte budget's plan (scape/budget.py): its densest step
        from scape.budget import density_plan

        o = as_dataclass(cfg.optimizer)
        copies = max(1, world // int(o.ranks_per_copy))
        plan = density_plan(o, padded, world, copies, int(cfg.train.steps))
        return layout.partition_size, max(layout.k(d) for d in plan.densities[o.dense_warmup_steps:] or [1.0])
    masks = MaskExchange(as_dataclass(cfg.optimizer), layout, torch.device("meta"), "estimate", None)
    return layout.partition_size, masks.k_at(cfg.optimizer.dense_warmup_steps + 1)


def _topk_bytes(cfg: Any, partition: int, k: int, device_type: str) -> float:
    """One partition's top-k (scape/topk.py). threshold: the bounded working set,
    TOPK_BYTES_PER_ELEMENT. exact on CUDA: torch.topk's k values and indices (12 bytes each) on
    top of that bound; exact on the CPU: the bracket's lists, per candidate (about k of them) its
    int64 index (8), fp32 value (4), sure flag (1), int64 position inside the bracket (8) and the
    inner top-k's int64 index (8)."""
    if cfg.optimizer.topk_method != "exact":
        return TOPK_BYTES_PER_ELEMENT * partition
    if device_type == "cuda":
        return TOPK_BYTES_PER_ELEMENT * partition + 12 * k
    return 29 * k


def _add_scape(est: MemoryEstimate, cfg: Any, padded: int, world: int, device_type: str) -> None:
    """SCAPE (scape/synchronizer.py, scape/update.py, scape/residual.py, scape/masking.py)."""
    from scape.residual import DEFAULT_CHUNK_NUMEL

    o, cpu = cfg.optimizer, device_type == "cpu"
    partition, k = _masks(cfg, padded, world)
    sent = world * k
    state = partition if o.shard else padded  # sharded: the owned partition only
    est.add(f"SCAPE momentum{' (1/%d)' % world if o.shard else ''}", 4 * state, "persistent")
    if o.base == "adamw":
        est.add("SCAPE second moment", 4 * state, "persistent")
    density = round(1.0 - float(o.sparsity), 12)
    if (float(o.stale_scale_cap) or 1.0 / density) > 1:
        est.add("SCAPE last-sent steps (int32)", 4 * state, "persistent")
    if o.offload_residual:
        est.add("SCAPE residual (host)", 4 * padded, "host")
        est.add("SCAPE residual chunk buffers", 2 * 4 * min(DEFAULT_CHUNK_NUMEL, padded), "persistent")
    else:
        est.add("SCAPE residual", 4 * padded, "persistent")
    est.add("mask score (owned partition)", 4 * partition, "persistent")
    est.add("mask held and in flight", 8 * sent + min(4 * sent, padded // 8), "persistent")
    value = 2 if o.value_dtype == "bf16" else 4
    est.add("top-k of a partition and the selection", _topk_bytes(cfg, partition, k, device_type)
            + partition, "step")
    # the masked update: the payload (fp32: ghat in place) and its copy for a rollback, with the
    # staleness of each sent coordinate (scape/update.py: its int32 last step, the int64 index and
    # float64 lr sums it gathers) or, on the CPU, the reference kernel's m, denominator, step and scale
    stale = {"lr_sum": 20, "steps": 12}.get(o.stale_scale, 0) if (float(o.stale_scale_cap) or 1.0 / density) > 1 else 0
    work = max(stale, 16 if cpu else 0)
    est.add("masked update: payload, its copy, staleness", sent * (2 * value + (4 if value == 2 else 0) + work),
            "step")
    if o.overlap_backward and o.lag and not o.shard:  # scape/overlap.py packs the payload during backward
        est.add("payload packed during the last backward", sent * value, "backward")
    if cpu:  # the dense warm-up step's reference AdamS: two temporaries of the flat buffer
        est.add("dense warm-up update temporaries (CPU)", 2 * 4 * state, "step")
    if o.update == "all":
        est.add("update=all: dense ghat", 4 * padded, "step")


def _add_sparse_avg(est: MemoryEstimate, cfg: Any, padded: int, world: int, device_type: str) -> None:
    """Sparse model averaging (scape/sparse_averaging.py): the copy y_i (the parameters), x, the local
    momentum and the shared denominator, each over the whole flat buffer."""
    from core.optim import override_group

    o = cfg.optimizer
    partition, k = _masks(cfg, padded, world)
    copies = max(1, world // int(getattr(o, "ranks_per_copy", 1)))
    est.add("sparse_avg consensus x and local momentum", 2 * 4 * padded, "persistent")
    est.add("shared denominator: average of q^2, lr sum, D, last exchange", 4 * 4 * padded, "persistent")
    group = override_group(o)
    tables = [("per-coordinate table bound", group is not None and group.step_bound is not None),
              ("per-coordinate lr scale", group is not None and float(group.lr_scale) != 1),
              ("per-coordinate denominator memory", group is not None and group.denominator_beta is not None)]
    for name, present in tables:
        if present:
            est.add(name, 4 * padded, "persistent")
    if int(getattr(o, "value_bits", 0)):
        est.add("owners' re-quantization error (1/C of the buffer)", 4 * padded // copies, "persistent")
    est.add("mask score and cyclic order", 8 * partition, "persistent")
    # the local step's quotient (and the CPU reference's two flat temporaries)
    est.add("local step temporaries", (3 if device_type == "cpu" else 1) * 4 * padded, "step")
    # the exchange of the most coordinates (the sparsity warm-up's first step, or a dense one): the
    # drift, the mean and what the copy keeps, and the denominator's fold of them (q, the taken
    # second moment and lr sum, the steps covered, the memory, its weight, the folded values):
    # about 13 fp32 buffers of the exchanged coordinates
    exchanged = padded if o.dense_warmup_steps > 1 else world * k
    est.add(f"exchange of up to {exchanged} coordinates", 13 * 4 * exchanged, "step")


# ------------------------------------------------------------------------------- the estimate
def estimate_memory(cfg: Any, world_size: int, device_type: str) -> MemoryEstimate:
    """Per-rank bytes of the run ``cfg`` (trainer.config.Config) on ``world_size`` ranks of
    ``device_type`` ('cpu' or 'cuda'), for the rank that holds the most (see the module doc)."""
    from scape.partition import Partitioning

    est = MemoryEstimate(world_size=world_size, device_type=device_type)
    held, blocks, full = _rank_shapes(cfg, world_size)
    name = cfg.optimizer.name
    flat = name in ("scape", "sparse_avg") and cfg.sdp.kind == "none"
    padded = Partitioning(held, world_size, world_size).padded_numel if flat else held
    params = full if cfg.sdp.kind != "none" and cfg.sdp.masking == "backward" else held
    est.add("parameters (fp32)", 4 * (padded if flat else params), "persistent")
    est.add("gradients (fp32)", 4 * (padded if flat else params), "persistent")
    if params != held:  # backward masking: the held slices as their own tensors, with gradients
        est.add("SDP held slices and their gradients", 8 * held, "persistent")
    if name in ("adamw", "adams"):
        largest = max(cfg.model.vocab_size * cfg.model.d_model, max((b.units * cfg.model.d_model for b in blocks), default=0))
        _add_dense(est, cfg, held, largest, world_size, device_type)
    elif name == "scape":
        _add_scape(est, cfg, padded if flat else Partitioning(held, world_size, world_size).padded_numel,
                   world_size, device_type)
    else:
        _add_sparse_avg(est, cfg, padded, world_size, device_type)
    _add_activations(est, cfg, blocks, device_type, world_size)
    # a checkpoint's files are written one after another (trainer/checkpoint.py): rank 0's copy of
    # the weights, then the state dicts, each a copy of state counted above
    state = max((p.bytes for p in est.parts if p.phase == "persistent" and "gradient" not in p.name), default=0)
    est.add("checkpoint: the largest copy it writes", max(4 * full, state), "checkpoint")
    if device_type == "cuda" and world_size > 1:
        est.add("collective buffers (NCCL)", NCCL_BUFFER_BYTES, "persistent")
    return est


# --------------------------------------------------------------------------------- the gate
def memory_limit(device: Any, override_gib: Optional[float] = None) -> Tuple[float, str]:
    """(bytes this rank may use, what they are): the GPU's free memory, or on CPU the host's
    MemAvailable divided among the local ranks; ``override_gib`` (train.memory_limit_gib) wins."""
    if override_gib is not None:
        return override_gib * GIB, f"train.memory_limit_gib={override_gib:g}"
    if device.type == "cuda":
        import torch

        free, total = torch.cuda.mem_get_info(device)
        return float(free), f"the free memory of {device} (torch.cuda.mem_get_info: {free / GIB:.1f} of {total / GIB:.1f} GiB)"
    available = _mem_available()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    share = f", shared by {local} local ranks" if local > 1 else ""
    return available / local, f"MemAvailable in /proc/meminfo{share}"


def _mem_available() -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return float(line.split()[1]) * 1024
    raise OSError("/proc/meminfo has no MemAvailable line; pass train.memory_limit_gib or train.memory_check=false")


def fitting_knobs(cfg: Any, world_size: int, device_type: str, limit: float) -> List[str]:
    """Single changes that bring the estimate under ``limit``, each with its estimate."""
    import dataclasses

    t, o = cfg.train, cfg.optimizer
    trials = []
    for size in (t.micro_batch_size // 2, t.micro_batch_size // 4, 1):
        if 0 < size < t.micro_batch_size:
            trials.append((f"train.micro_batch_size={size}", dataclasses.replace(
                cfg, train=dataclasses.replace(t, micro_batch_size=size)), world_size))
    if not t.activation_checkpointing:
        trials.append(("train.activation_checkpointing=true", dataclasses.replace(
            cfg, train=dataclasses.replace(t, activation_checkpointing=True)), world_size))
    if o.name in ("scape", "sparse_avg") and o.sparsity_warmup_steps > 0:  # its first sparse steps are near-dense
        trials.append(("optimizer.sparsity_warmup_steps=0", dataclasses.replace(
            cfg, optimizer=dataclasses.replace(o, sparsity_warmup_steps=0)), world_size))
    if o.name == "scape" and not o.offload_residual:
        trials.append(("optimizer.offload_residual=true", dataclasses.replace(
            cfg, optimizer=dataclasses.replace(o, offload_residual=True)), world_size))
    sharded = dataclasses.replace(cfg, optimizer=dataclasses.replace(o, shard=True))
    if o.name != "sparse_avg" and not o.shard and cfg.sdp.kind == "none":
        trials.append(("optimizer.shard=true", sharded, world_size))
    if o.name != "sparse_avg" and cfg.sdp.kind == "none":
        trials += [(f"optimizer.shard=true on {n} ranks", sharded, n) for n in (8, 32, 128) if n > world_size]
    fits, seen = [], set()
    for label, trial, world in trials:  # the first that fits of each knob (the largest micro-batch)
        key = label.split("=")[0]
        if key in seen:
            continue
        try:
            peak = estimate_memory(trial, world, device_type).device_peak
        except ValueError:  # e.g. an SDP plan that needs other world sizes
            continue
        if peak <= limit:
            seen.add(key)
            fits.append(f"{label} ({peak / GIB:.1f} GiB)")
    return fits


def check_memory(cfg: Any, world_size: int, device: Any) -> MemoryEstimate:
    """Refuse (MemoryPlanError) a run whose per-rank estimate exceeds this rank's limit."""
    est = estimate_memory(cfg, world_size, device.type)
    limit, what = memory_limit(device, cfg.train.memory_limit_gib)
    fits = est.device_peak <= limit
    if _any_rank_refuses(not fits, device):
        knobs = fitting_knobs(cfg, world_size, device.type, limit)
        largest = sorted(est.parts, key=lambda p: -p.bytes)[:3]
        raise MemoryPlanError(
            f"memory pre-flight: this run needs about {est.device_peak / GIB:.1f} GiB per rank on {world_size} "
            f"{device.type} rank(s) (largest: {', '.join(f'{p.name} {p.bytes / GIB:.1f} GiB' for p in largest)}), "
            f"but the limit is {limit / GIB:.1f} GiB ({what}); nothing was built or written. "
            + (f"What would fit: {'; '.join(knobs)}. " if knobs else
               "No single knob fits it: combine train.micro_batch_size, train.activation_checkpointing, "
               "optimizer.shard and more ranks, or a larger device. ")
            + f"`python -m scripts.plan_memory <this run's overrides> world={world_size} device={device.type}` prints the table; "
              "train.memory_check=false skips this check.")
    return est


def _any_rank_refuses(refuse: bool, device: Any) -> bool:
    """Every rank refuses if one does (a rank that went on alone would hang in a collective)."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return refuse
    flag = torch.tensor([1.0 if refuse else 0.0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item() > 0)
