"""The worker-mask planner: which worker holds which component (docs/specs/SDP.md).

A plan is a K x n boolean matrix A (workers x maskable components). Everything else in sdp/
reads a plan: the subnetwork a worker builds, the holder sets its gradients are averaged over,
and the report that says what a plan costs and saves before a cluster is asked for.

Components:
  - ``block`` (B-SDP): component l is transformer block l.
  - ``neuron`` (N-SDP): in every block, ``groups_per_block`` groups of attention heads (grouped by
    key/value head, so grouped-query attention stays consistent) and ``groups_per_block`` groups of
    MLP hidden units; fewer groups when a block has fewer heads or units than that.

The strategies are applied per family of interchangeable components: over all blocks for B-SDP,
and per (block, heads|mlp) for N-SDP, so that every N-SDP worker holds a share C of the heads and
of the units of *every* block (a plan that held whole blocks would be B-SDP by another name).

Run ``python scripts/plan_sdp.py model=llama500m sdp.kind=block sdp.coverage=0.5 sdp.workers=32``.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from models.common import resolved_ffn_hidden, resolved_kv_heads
from models.config import ModelConfig
from sdp.config import SDPConfig

BYTES_FP32 = 4
# Optimizer state tensors per parameter (fp32), by optimizer name.
OPTIMIZER_STATES = {"adamw": 2, "adams": 1, "scape": 2, "sgd": 0}


# --------------------------------------------------------------------------- model shapes

def ffn_hidden_size(cfg: ModelConfig) -> int:
    return resolved_ffn_hidden(cfg)


def kv_heads(cfg: ModelConfig) -> int:
    return resolved_kv_heads(cfg)


def head_dim(cfg: ModelConfig) -> int:
    return cfg.d_model // cfg.n_head


def _head_group_params(cfg: ModelConfig, n_query: int, n_kv: int) -> int:
    d, hd = cfg.d_model, head_dim(cfg)
    weights = d * hd * (n_query + 2 * n_kv) + n_query * hd * d  # q, k, v rows; output-proj columns
    biases = hd * (n_query + 2 * n_kv) if cfg.family == "gpt" else 0
    return weights + biases


def _mlp_group_params(cfg: ModelConfig, units: int) -> int:
    d = cfg.d_model
    if cfg.family == "gpt":
        return 2 * d * units + units  # fc rows (+ bias), proj columns
    return 3 * d * units  # gate, up rows; down columns


def _block_always_held_params(cfg: ModelConfig) -> int:
    """Parameters of a block that belong to no head or unit group: norms, output biases."""
    d = cfg.d_model
    if cfg.family == "gpt":
        return 2 * 2 * d + 2 * d  # two LayerNorms (weight, bias); attn-proj and mlp-proj biases
    return 2 * d  # two RMSNorm weights


def block_params(cfg: ModelConfig) -> int:
    return (_head_group_params(cfg, cfg.n_head, kv_heads(cfg)) + _mlp_group_params(cfg, ffn_hidden_size(cfg))
            + _block_always_held_params(cfg))


def outside_block_params(cfg: ModelConfig) -> int:
    """Embeddings, final norm and LM head: held by every worker."""
    d, v = cfg.d_model, cfg.vocab_size
    if cfg.family == "gpt":
        return v * d + cfg.seq_len * d + 2 * d + (0 if cfg.tie_embeddings else v * d)
    return v * d + d + (0 if cfg.tie_embeddings else v * d)


def total_params(cfg: ModelConfig) -> int:
    return outside_block_params(cfg) + cfg.n_layer * block_params(cfg)


# --------------------------------------------------------------------------- components

@dataclass(frozen=True)
class Component:
    """One maskable unit. ``members`` are query-head indices (heads) or hidden-unit indices (mlp)."""

    index: int
    name: str
    block: int
    kind: str  # block | heads | mlp
    group: int
    n_params: int
    members: Tuple[int, ...] = ()
    kv_members: Tuple[int, ...] = ()  # key/value heads of a head group


def _split(n: int, groups: int) -> List[List[int]]:
    return [list(map(int, chunk)) for chunk in np.array_split(np.arange(n), groups)]


def enumerate_components(cfg: ModelConfig, kind: str, groups_per_block: int = 8) -> List[Component]:
    """The maskable components of a model, in plan-column order."""
    if kind == "block":
        n = block_params(cfg)
        return [Component(l, f"block{l}", l, "block", 0, n) for l in range(cfg.n_layer)]
    if kind != "neuron":
        raise ValueError(f"sdp.kind must be one of block|neuron for a plan, got {kind!r}")
    if groups_per_block < 1:
        raise ValueError(f"sdp.groups_per_block must be >= 1, got {groups_per_block}")
    n_kv, rep = kv_heads(cfg), cfg.n_head // kv_heads(cfg)
    kv_groups = _split(n_kv, min(groups_per_block, n_kv))
    unit_groups = _split(ffn_hidden_size(cfg), min(groups_per_block, ffn_hidden_size(cfg)))
    out: List[Component] = []
    for l in range(cfg.n_layer):
        for g, kvs in enumerate(kv_groups):
            queries = tuple(q for k in kvs for q in range(k * rep, (k + 1) * rep))
            out.append(Component(len(out), f"block{l}.heads{g}", l, "heads", g,
                                 _head_group_params(cfg, len(queries), len(kvs)), queries, tuple(kvs)))
        for g, units in enumerate(unit_groups):
            out.append(Component(len(out), f"block{l}.mlp{g}", l, "mlp", g,
                                 _mlp_group_params(cfg, len(units)), tuple(units)))
    return out


def _families(components: Sequence[Component]) -> List[List[int]]:
    """Column indices of interchangeable components, to which a strategy is applied together."""
    families: Dict[Tuple[int, str], List[int]] = {}
    for c in components:
        key = (-1, "block") if c.kind == "block" else (c.block, c.kind)
        families.setdefault(key, []).append(c.index)
    return list(families.values())


# --------------------------------------------------------------------------- strategies

def components_per_worker(n: int, coverage: float) -> int:
    """b = round(C n), the spec's count of components a worker holds out of a family of n."""
    return int(math.floor(coverage * n + 0.5))


def cyclic_assignment(workers: int, n: int, coverage: float) -> np.ndarray:
    """Worker i holds components (floor(i n / K) + t) mod n for t < round(C n)."""
    b = components_per_worker(n, coverage)
    a = np.zeros((workers, n), dtype=bool)
    for i in range(workers):
        start = (i * n) // workers
        for t in range(b):
            a[i, (start + t) % n] = True
    return a


def random_assignment(workers: int, n: int, coverage: float, rng: np.random.Generator) -> np.ndarray:
    """Seeded random and balanced: each worker takes b components among those with fewest holders.

    Holder counts then differ by at most one between components, which is as balanced as K b / n
    allows, while which workers share a component is random (unlike cyclic's fixed neighbours).
    """
    b = components_per_worker(n, coverage)
    a = np.zeros((workers, n), dtype=bool)
    holders = np.zeros(n, dtype=np.int64)
    for i in rng.permutation(workers):
        keys = holders * n + rng.permutation(n)  # fewest holders first, random among equals
        chosen = np.argsort(keys, kind="stable")[:b]
        a[i, chosen] = True
        holders[chosen] += 1
    return a


# --------------------------------------------------------------------------- the plan

@dataclass
class Plan:
    """A fixed K x n holder matrix over a model's components, plus what built it."""

    kind: str
    coverage: float
    strategy: str
    seed: int
    groups_per_block: int
    components: List[Component]
    assignment: np.ndarray  # (workers, n) bool
    model_name: str = ""
    _holder_sets: Optional[List[Tuple[int, ...]]] = field(default=None, repr=False)

    @property
    def workers(self) -> int:
        return int(self.assignment.shape[0])

    def held(self, rank: int) -> List[int]:
        return [int(j) for j in np.flatnonzero(self.assignment[rank])]

    def holders(self, component: int) -> Tuple[int, ...]:
        return tuple(int(i) for i in np.flatnonzero(self.assignment[:, component]))

    def holder_sets(self) -> List[Tuple[int, ...]]:
        """Holder set of every component, in column order (cached: masks are fixed)."""
        if self._holder_sets is None:
            self._holder_sets = [self.holders(j) for j in range(len(self.components))]
        return self._holder_sets

    def distinct_holder_sets(self) -> List[Tuple[int, ...]]:
        """Every distinct holder set, the whole world first, then in a fixed order all ranks agree on."""
        world = tuple(range(self.workers))
        rest = sorted({h for h in self.holder_sets() if h != world}, key=lambda h: (len(h), h))
        return [world] + rest

    def subnet_spec(self, rank: int):
        """What a worker holds, as the model factory's ``SubnetSpec``."""
        from models.subnet import SubnetSpec

        return SubnetSpec(**self.subnet_layout(rank))

    def subnet_layout(self, rank: int) -> Dict[str, Any]:
        """What a worker holds, in the model factory's terms (SubnetSpec's fields; JSON-friendly)."""
        held = [self.components[j] for j in self.held(rank)]
        if self.kind == "block":
            return {"blocks": sorted(c.block for c in held), "heads": None, "mlp_units": None}
        heads: Dict[int, List[int]] = {}
        units: Dict[int, List[int]] = {}
        for c in held:
            target = heads if c.kind == "heads" else units
            target.setdefault(c.block, []).extend(c.members)
        n_layer = 1 + max(c.block for c in self.components)
        return {"blocks": None,
                "heads": {l: sorted(heads.get(l, [])) for l in range(n_layer)},
                "mlp_units": {l: sorted(units.get(l, [])) for l in range(n_layer)}}

    def validate(self, world_size: Optional[int] = None) -> None:
        """Fail with a message naming the key to change; called at launch with the real world size."""
        validate_coverage(self.coverage)
        if world_size is not None and self.workers != world_size:
            raise ValueError(
                f"the SDP plan has {self.workers} workers but the world size is {world_size}: launch "
                f"{self.workers} ranks, or set sdp.workers={world_size} (or write a plan for "
                f"{world_size} workers with `python scripts/plan_sdp.py ... sdp.workers={world_size} --json PATH`)")
        counts = self.assignment.sum(axis=0)
        orphans = [self.components[j].name for j in np.flatnonzero(counts == 0)]
        if orphans:
            shown = ", ".join(orphans[:8]) + (" ..." if len(orphans) > 8 else "")
            raise ValueError(
                f"{len(orphans)} SDP component(s) have no holder ({shown}): with sdp.workers="
                f"{self.workers} raise sdp.coverage (each component needs workers * round(coverage * n)"
                f" >= n) or use more workers")
        empty = [i for i in range(self.workers) if not self.assignment[i].any()]
        if empty:
            raise ValueError(f"SDP worker(s) {empty} hold no component: raise sdp.coverage")

    # ----------------------------------------------------------------- JSON

    def to_json(self) -> Dict[str, Any]:
        return {"kind": self.kind, "coverage": self.coverage, "strategy": self.strategy,
                "seed": self.seed, "groups_per_block": self.groups_per_block,
                "model": self.model_name, "workers": self.workers,
                "components": [c.name for c in self.components],
                "assignment": self.assignment.astype(int).tolist()}

    @classmethod
    def from_json(cls, data: Dict[str, Any], model_cfg: ModelConfig) -> "Plan":
        components = enumerate_components(model_cfg, data["kind"], int(data["groups_per_block"]))
        names = [c.name for c in components]
        if names != list(data["components"]):
            raise ValueError(
                f"the SDP plan's components ({len(data['components'])}) do not match model "
                f"{model_cfg.name!r} ({len(names)}) with sdp.kind={data['kind']}: write the plan "
                f"for this model (sdp.plan_path points at a plan for another one)")
        assignment = np.asarray(data["assignment"], dtype=bool)
        if assignment.shape != (int(data["workers"]), len(components)):
            raise ValueError(f"the SDP plan's assignment has shape {assignment.shape}, expected "
                             f"({data['workers']}, {len(components)})")
        return cls(data["kind"], float(data["coverage"]), data["strategy"], int(data["seed"]),
                   int(data["groups_per_block"]), components, assignment, data.get("model", ""))


def validate_coverage(coverage: float) -> None:
    if not (isinstance(coverage, (int, float)) and 0.0 < float(coverage) <= 1.0):
        raise ValueError(f"sdp.coverage must lie in (0, 1], got {coverage!r}: set e.g. sdp.coverage=0.5")


def make_plan(model_cfg: ModelConfig, sdp_cfg: SDPConfig, world_size: Optional[int] = None) -> Plan:
    """The plan for this run: read from ``sdp.plan_path`` or built by the strategy; validated."""
    if sdp_cfg.kind not in ("block", "neuron"):
        raise ValueError(f"sdp.kind must be block or neuron to plan, got {sdp_cfg.kind!r}")
    validate_coverage(sdp_cfg.coverage)
    if sdp_cfg.plan_path:
        with open(sdp_cfg.plan_path) as f:
            plan = Plan.from_json(json.load(f), model_cfg)
        if plan.kind != sdp_cfg.kind:
            raise ValueError(f"sdp.plan_path holds a {plan.kind} plan but sdp.kind={sdp_cfg.kind}")
        plan.validate(world_size)
        return plan
    workers = sdp_cfg.workers if sdp_cfg.workers is not None else world_size
    if workers is None or workers < 1:
        raise ValueError("sdp.workers must be set (>= 1) when planning outside a launched run")
    if world_size is not None and workers != world_size:
        raise ValueError(f"sdp.workers={workers} does not match the world size {world_size}: set "
                         f"sdp.workers={world_size} or leave it unset (null) to use the world size")
    components = enumerate_components(model_cfg, sdp_cfg.kind, sdp_cfg.groups_per_block)
    assignment = np.zeros((workers, len(components)), dtype=bool)
    rng = np.random.default_rng(sdp_cfg.seed)
    for family in _families(components):
        if components_per_worker(len(family), sdp_cfg.coverage) < 1:
            raise ValueError(
                f"sdp.coverage={sdp_cfg.coverage} holds round({sdp_cfg.coverage} * {len(family)}) = 0 "
                f"of {len(family)} components: raise sdp.coverage to at least {0.5 / len(family):.3g}"
                + (" or sdp.groups_per_block" if sdp_cfg.kind == "neuron" else ""))
        if sdp_cfg.strategy == "cyclic":
            sub = cyclic_assignment(workers, len(family), sdp_cfg.coverage)
        else:  # "random" (SDPConfig checks the choice)
            sub = random_assignment(workers, len(family), sdp_cfg.coverage, rng)
        assignment[:, family] = sub
    plan = Plan(sdp_cfg.kind, float(sdp_cfg.coverage), sdp_cfg.strategy, sdp_cfg.seed,
                sdp_cfg.groups_per_block, components, assignment, model_cfg.name)
    plan.validate(world_size)
    return plan


# --------------------------------------------------------------------------- the report

def spectral_gap(assignment: np.ndarray) -> float:
    """Second-smallest eigenvalue of the normalized Laplacian of W = A A^T (0 iff disconnected).

    W's diagonal (components a worker holds) is kept as self-loops; they do not change which
    workers are connected, so the eigenvalue 0 still has one eigenvector per island.
    """
    a = assignment.astype(np.float64)
    w = a @ a.T
    if w.shape[0] < 2:
        return 0.0
    deg = w.sum(axis=1)
    inv_sqrt = np.where(deg > 0, 1.0 / np.sqrt(np.maximum(deg, 1e-300)), 0.0)
    lap = np.eye(w.shape[0]) - inv_sqrt[:, None] * w * inv_sqrt[None, :]
    eig = np.sort(np.linalg.eigvalsh(lap))
    gap = float(eig[1])
    return 0.0 if abs(gap) < 1e-9 else gap


def activation_bytes_per_token_block(cfg: ModelConfig, head_share: float = 1.0,
                                     unit_share: float = 1.0) -> float:
    """Rough fp32 bytes a block saves for backward per token (SDPA, no s^2 attention matrix).

    Counts the tensors autograd keeps: norm inputs/outputs and the residual (about 4 d), q, k, v,
    the attention output (4 x the held attention width) and the MLP's inputs and activations (about
    4 x the held units for SwiGLU's gate, up, product and activation). An estimate for planning,
    not a measurement (``scripts/bench_sdp.py`` measures).
    """
    d = cfg.d_model
    attn = 4 * d * head_share
    mlp = 4 * ffn_hidden_size(cfg) * unit_share
    return BYTES_FP32 * (4 * d + attn + mlp)


def _stats(x: np.ndarray) -> Dict[str, float]:
    return {"min": float(np.min(x)), "mean": float(np.mean(x)), "max": float(np.max(x))}


def _memory(n_params: int, act_bytes: float, states: int) -> Dict[str, float]:
    mem = {"params": n_params * BYTES_FP32, "grads": n_params * BYTES_FP32,
           "optimizer_state": states * n_params * BYTES_FP32, "activations": act_bytes}
    mem["total"] = float(sum(mem.values()))
    return {key: float(v) for key, v in mem.items()}


def _worker_activations(plan: Plan, model_cfg: ModelConfig, micro_batch_size: int, masking: str,
                        activation_checkpointing: bool) -> Tuple[List[float], float]:
    """Activation bytes of each worker's micro-batch, and of DDP's on the full model.

    With activation checkpointing a block keeps only its input (d per token) and one block's
    activations are live at a time during recomputation."""
    tokens = micro_batch_size * model_cfg.seq_len
    logits_bytes = 2 * BYTES_FP32 * model_cfg.vocab_size  # logits and their gradient, per token
    if activation_checkpointing:
        per_block = lambda hs=1.0, us=1.0: BYTES_FP32 * model_cfg.d_model  # noqa: E731
        recompute = tokens * activation_bytes_per_token_block(model_cfg)
    else:
        per_block = lambda hs=1.0, us=1.0: activation_bytes_per_token_block(model_cfg, hs, us)  # noqa: E731
        recompute = 0.0
    full_block = per_block()
    ddp_act = tokens * (model_cfg.n_layer * full_block + logits_bytes) + recompute
    acts = []
    for i in range(plan.workers):
        held = [plan.components[j] for j in plan.held(i)]
        if masking == "backward":  # the full forward: full activations, full weights present
            act = ddp_act
        elif plan.kind == "block":
            act = tokens * (len(held) * full_block + logits_bytes) + recompute
        else:
            act = tokens * logits_bytes + recompute
            for l in range(model_cfg.n_layer):
                hs = sum(len(c.members) for c in held if c.block == l and c.kind == "heads") / model_cfg.n_head
                us = sum(len(c.members) for c in held if c.block == l and c.kind == "mlp") / ffn_hidden_size(model_cfg)
                act += tokens * per_block(hs, us)
        acts.append(act)
    return acts, ddp_act


def _sent_bytes(plan: Plan, comp_params: np.ndarray, always: int, masking: str) -> Tuple[np.ndarray, np.ndarray]:
    """Bytes each worker sends a step (one ring all-reduce per holder set it belongs to), and the
    bytes it broadcasts to refresh unheld values under backward masking."""
    from core.comm import all_reduce_bytes
    k = plan.workers
    set_params: Dict[Tuple[int, ...], int] = {tuple(range(k)): always}
    for j, h in enumerate(plan.holder_sets()):
        set_params[h] = set_params.get(h, 0) + int(comp_params[j])
    sent = np.zeros(k)
    for h, n in set_params.items():
        for i in h:
            sent[i] += all_reduce_bytes(n * BYTES_FP32, len(h))
    refresh = np.zeros(k)
    if masking == "backward":  # every unheld value is broadcast by one holder to the world
        for j, h in enumerate(plan.holder_sets()):
            if len(h) < k and k > 1:
                refresh[h[j % len(h)]] += comp_params[j] * BYTES_FP32
    return sent, refresh


def report(plan: Plan, model_cfg: ModelConfig, optimizer: str = "adamw", micro_batch_size: int = 8,
           masking: str = "forward", activation_checkpointing: bool = False) -> Dict[str, Any]:
    """What the plan costs and saves per worker, against DDP on the same model and world."""
    from core.comm import all_reduce_bytes
    a, k = plan.assignment, plan.workers
    comp_params = np.array([c.n_params for c in plan.components], dtype=np.int64)
    total = total_params(model_cfg)
    always = total - int(comp_params.sum())
    params_per_worker = always + a.astype(np.int64) @ comp_params
    states = OPTIMIZER_STATES.get(optimizer, 2)
    acts, ddp_act = _worker_activations(plan, model_cfg, micro_batch_size, masking, activation_checkpointing)
    worker_mem = []
    for i in range(k):
        mem = _memory(int(params_per_worker[i]), acts[i], states)
        if masking == "backward":  # unheld weights are present (no grads, no state)
            mem["params"] = float(total * BYTES_FP32)
            mem["total"] = float(mem["params"] + mem["grads"] + mem["optimizer_state"] + mem["activations"])
        worker_mem.append(mem)
    ddp_mem = _memory(total, ddp_act, states)
    sent, refresh = _sent_bytes(plan, comp_params, always, masking)
    ddp_sent = all_reduce_bytes(total * BYTES_FP32, k)
    peak = max(m["total"] for m in worker_mem)
    return {
        "model": model_cfg.name, "kind": plan.kind, "strategy": plan.strategy, "coverage": plan.coverage,
        "masking": masking, "workers": k, "components": len(plan.components),
        "components_per_worker": _stats(a.sum(axis=1)),
        "holders_per_component": _stats(a.sum(axis=0)),
        "distinct_holder_sets": len(set(plan.holder_sets()) | {tuple(range(k))}),
        "params_total": int(total), "params_always_held": int(always),
        "params_per_worker": _stats(params_per_worker.astype(np.float64)),
        "params_fraction_max": float(params_per_worker.max() / total),
        "memory_estimate_bytes": {"optimizer": optimizer, "micro_batch_size": micro_batch_size,
                                  "activation_checkpointing": bool(activation_checkpointing),
                                  "worker_max": max(worker_mem, key=lambda m: m["total"]),
                                  "ddp": ddp_mem, "ratio_vs_ddp": float(peak / ddp_mem["total"])},
        "allreduce_bytes_per_step": {"worker": _stats(sent), "ddp": float(ddp_sent),
                                     "ratio_vs_ddp": float(sent.max() / ddp_sent) if ddp_sent else 0.0,
                                     "backward_refresh_broadcast": _stats(refresh)},
        "spectral_gap": spectral_gap(a),
    }


def format_report(rep: Dict[str, Any]) -> str:
    gib = 1024 ** 3
    h, p = rep["holders_per_component"], rep["params_per_worker"]
    mem = rep["memory_estimate_bytes"]
    ar = rep["allreduce_bytes_per_step"]
    lines = [
        f"SDP plan: {rep['kind']} {rep['strategy']} C={rep['coverage']} masking={rep['masking']} "
        f"on {rep['model']} x {rep['workers']} workers",
        f"  components                {rep['components']} (per worker "
        f"{rep['components_per_worker']['min']:.0f}-{rep['components_per_worker']['max']:.0f}); "
        f"distinct holder sets {rep['distinct_holder_sets']}",
        f"  holders per component     min {h['min']:.0f}  mean {h['mean']:.2f}  max {h['max']:.0f}",
        f"  params per worker         min {p['min']:,.0f}  mean {p['mean']:,.0f}  max {p['max']:,.0f} "
        f"of {rep['params_total']:,} ({100 * rep['params_fraction_max']:.1f}%; always held "
        f"{rep['params_always_held']:,})",
        f"  est. memory per worker    {mem['worker_max']['total'] / gib:.2f} GiB vs DDP "
        f"{mem['ddp']['total'] / gib:.2f} GiB ({mem['ratio_vs_ddp']:.2f}x; {mem['optimizer']}, "
        f"micro-batch {mem['micro_batch_size']}"
        f"{', activation checkpointing' if mem['activation_checkpointing'] else ''}, fp32)",
        f"  all-reduced per step      {ar['worker']['max'] / 2**20:.1f} MiB per worker (max) vs DDP "
        f"{ar['ddp'] / 2**20:.1f} MiB ({ar['ratio_vs_ddp']:.2f}x)"
        + (f"; + refresh broadcast {ar['backward_refresh_broadcast']['max'] / 2**20:.1f} MiB"
           if rep["masking"] == "backward" else ""),
        f"  spectral gap              {rep['spectral_gap']:.4f}"
        + ("  (disconnected: islands never mix)" if rep["spectral_gap"] == 0 else ""),
    ]
    return "\n".join(lines)
