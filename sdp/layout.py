"""Where each component of a plan lives inside the model's tensors.

The synchroniser needs two views of the same fact: which rows/columns of *this worker's* tensors
belong to which component (to bucket gradients by holder set), and which rows/columns of the
*full* model's tensors a component covers (to gather the full model for checkpoints, validation
and backward masking's refresh). Both come from ``models.subnet.parameter_slices``, the factory's
own statement of how heads and units slice its tensors, so this file has no copy of the model's
layout beyond "tensors inside ``blocks.<l>.`` belong to block l" and "attention tensors are
sliced by heads, the others by units".
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch
from torch.overrides import TorchFunctionMode

from models import build_model
from models.config import ModelConfig
from models.subnet import SubnetSpec, parameter_slices
from sdp.plan import Plan, head_dim, kv_heads, ffn_hidden_size

ALWAYS_HELD = -1  # the "component" of embeddings, norms, LM head: held by every worker


@dataclass
class LocalPiece:
    """Part of one held tensor that belongs to one component (``dim is None``: all of it)."""

    component: int
    dim: Optional[int]
    positions: Optional[torch.Tensor]  # indices along ``dim`` in the worker's tensor
    numel: int


@dataclass
class FullEntry:
    """Part of one full-model tensor that belongs to one component (``dim is None``: all of it)."""

    name: str
    dim: Optional[int]
    indices: Optional[torch.Tensor]  # indices along ``dim`` in the full tensor


def _block_of(name: str) -> Optional[int]:
    if not name.startswith("blocks."):
        return None
    return int(name.split(".", 2)[1])


class skip_meta_init(TorchFunctionMode):
    """Skip the in-place initialisers on meta tensors while modules are constructed.

    Meta tensors have no values, but ``normal_`` on them runs a Python decomposition that
    imports torch._dynamo (seconds per process, tens of seconds for 4 test ranks on a busy
    CPU). Real tensors are initialised as usual.
    """

    SKIPPED = frozenset({"normal_", "uniform_", "fill_", "zero_", "trunc_normal_", "kaiming_uniform_",
                         "ones_", "zeros_"})

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") in self.SKIPPED:
            target = args[0] if args else kwargs.get("tensor", kwargs.get("self"))
            if isinstance(target, torch.Tensor) and target.is_meta:
                return target
        return func(*args, **kwargs)


def meta_full_model(model_cfg: ModelConfig) -> torch.nn.Module:
    """The full model's structure without memory; leaves the torch RNG as it was (the factory
    draws its init seed even on meta, and the trainer's random stream must not depend on SDP)."""
    with torch.random.fork_rng(devices=[]), skip_meta_init():
        return build_model(model_cfg, device="meta")


class ComponentLayout:
    """Maps between a plan's components and the model's tensors (full and per worker)."""

    def __init__(self, model_cfg: ModelConfig, plan: Plan) -> None:
        self.cfg = model_cfg
        self.plan = plan
        full = meta_full_model(model_cfg)
        self.full_shapes: Dict[str, torch.Size] = {n: t.shape for n, t in full.state_dict().items()}
        self.full_numel = sum(p.numel() for p in {id(p): p for p in full.parameters()}.values())
        self.hd = head_dim(model_cfg)
        self.n_head = model_cfg.n_head
        # Which tensors heads and units slice, and along which dimension: ask the factory with a
        # spec that drops one kv group and one unit in every block, so every sliceable tensor shows.
        rep = model_cfg.n_head // kv_heads(model_cfg)
        probe = SubnetSpec(
            heads={l: list(range(rep, model_cfg.n_head)) for l in range(model_cfg.n_layer)},
            mlp_units={l: list(range(1, ffn_hidden_size(model_cfg))) for l in range(model_cfg.n_layer)})
        self.sliceable: Dict[str, Tuple[int, str]] = {}
        for name, (dim, _) in parameter_slices(model_cfg, probe).items():
            if name not in self.full_shapes:  # the rules name biases a family may not have
                continue
            if ".attn." in name:
                kind = "q" if self.full_shapes[name][dim] == model_cfg.n_head * self.hd else "kv"
            else:
                kind = "unit"
            self.sliceable[name] = (dim, kind)
        # unit (query head, kv head or hidden unit) -> component, per block
        self._owner: Dict[Tuple[int, str], Dict[int, int]] = {}
        for c in plan.components:
            if c.kind == "heads":
                self._owner.setdefault((c.block, "q"), {}).update({h: c.index for h in c.members})
                self._owner.setdefault((c.block, "kv"), {}).update({h: c.index for h in c.kv_members})
            elif c.kind == "mlp":
                self._owner.setdefault((c.block, "unit"), {}).update({u: c.index for u in c.members})

    # ------------------------------------------------------------------ a worker's tensors

    def local_pieces(self, name: str, shape: torch.Size, spec: Optional[SubnetSpec]) -> List[LocalPiece]:
        """The components inside one of a worker's held tensors (built with ``spec``)."""
        numel = int(torch.Size(shape).numel())
        block = _block_of(name)
        if block is None:
            return [LocalPiece(ALWAYS_HELD, None, None, numel)]
        if self.plan.kind == "block":
            return [LocalPiece(block, None, None, numel)]
        if name not in self.sliceable:  # block norms, output-projection biases
            return [LocalPiece(ALWAYS_HELD, None, None, numel)]
        dim, kind = self.sliceable[name]
        sliced = parameter_slices(self.cfg, spec) if spec is not None else {}
        full_idx = sliced[name][1] if name in sliced else torch.arange(self.full_shapes[name][dim])
        unit_width = 1 if kind == "unit" else self.hd
        owner = self._owner[(block, kind)]
        comps = [owner[int(i) // unit_width] for i in full_idx.tolist()]
        order: Dict[int, List[int]] = {}
        for pos, comp in enumerate(comps):
            order.setdefault(comp, []).append(pos)
        per_slice = numel // max(1, shape[dim])
        pieces = []
        for comp, positions in order.items():
            if len(positions) == shape[dim] and len(order) == 1:
                pieces.append(LocalPiece(comp, None, None, numel))
            else:
                pieces.append(LocalPiece(comp, dim, torch.tensor(positions, dtype=torch.long),
                                         len(positions) * per_slice))
        return pieces

    # ------------------------------------------------------------------ the full model's tensors

    def full_entries(self, component: int) -> List[FullEntry]:
        """Where one component lives in the full model, in an order every rank agrees on."""
        c = self.plan.components[component]
        prefix = f"blocks.{c.block}."
        if c.kind == "block":
            return [FullEntry(n, None, None) for n in self.full_shapes if n.startswith(prefix)]
        out = []
        for name, (dim, kind) in self.sliceable.items():
            if not name.startswith(prefix):
                continue
            if c.kind == "heads" and kind in ("q", "kv"):
                heads = c.members if kind == "q" else c.kv_members
                idx = (torch.tensor(heads, dtype=torch.long)[:, None] * self.hd
                       + torch.arange(self.hd)[None, :]).reshape(-1)
                out.append(FullEntry(name, dim, idx))
            elif c.kind == "mlp" and kind == "unit":
                out.append(FullEntry(name, dim, torch.tensor(c.members, dtype=torch.long)))
        return out
