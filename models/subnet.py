"""Subnetworks of a model for subnetwork data parallelism (see docs/specs/SDP.md).

A subnetwork is the full model with some blocks removed (B-SDP) and/or some attention heads and
MLP hidden units removed inside the blocks it keeps (N-SDP). It keeps the full model's parameter
names so that SDP can move tensors between the two by name; only the sliced tensors have smaller
shapes:

- kept heads select rows of ``attn.q_proj`` (weight and bias), rows of ``attn.k_proj`` /
  ``attn.v_proj`` for the kv groups of those heads, and columns of ``attn.o_proj.weight``;
- kept MLP units select rows of ``mlp.gate_proj`` / ``mlp.up_proj`` (llama) or ``mlp.fc`` (gpt,
  weight and bias) and columns of ``mlp.down_proj.weight`` / ``mlp.proj.weight``.

Everything else in a held block (norms, output-projection biases) and everything outside the
blocks (embeddings, final norm, LM head) is always whole.

Grouped-query attention rule: with ``n_kv_head < n_head`` each kv head serves a group of
``n_head // n_kv_head`` consecutive query heads, and a subnetwork must keep whole groups (every
query head of a group, or none of them); anything else is rejected by ``SubnetSpec.validate``,
because a kv head shared by held and unheld query heads would belong to two components.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Tuple

import torch

from models.config import ModelConfig

# Parameter-name suffixes (inside ``blocks.<i>.``) and how kept heads / units slice them:
# (dimension, what selects the indices).
_SLICE_RULES: Dict[str, Tuple[int, str]] = {
    "attn.q_proj.weight": (0, "q"),
    "attn.q_proj.bias": (0, "q"),
    "attn.k_proj.weight": (0, "kv"),
    "attn.k_proj.bias": (0, "kv"),
    "attn.v_proj.weight": (0, "kv"),
    "attn.v_proj.bias": (0, "kv"),
    "attn.o_proj.weight": (1, "q"),
    "mlp.gate_proj.weight": (0, "unit"),
    "mlp.up_proj.weight": (0, "unit"),
    "mlp.fc.weight": (0, "unit"),
    "mlp.fc.bias": (0, "unit"),
    "mlp.down_proj.weight": (1, "unit"),
    "mlp.proj.weight": (1, "unit"),
}


def _int_keys(mapping: Optional[Mapping]) -> Optional[Dict[int, List[int]]]:
    # Plans arrive from JSON, where dict keys are strings.
    if mapping is None:
        return None
    return {int(layer): sorted(int(i) for i in kept) for layer, kept in mapping.items()}


@dataclass
class SubnetSpec:
    """Which parts of the full model a worker holds. ``None`` anywhere means "all of it".

    blocks: held block indices; an unheld block is the identity on the residual stream.
    heads: per layer index, the kept attention (query) heads; layers absent keep all heads.
    mlp_units: per layer index, the kept MLP hidden units; layers absent keep all units.
    """

    blocks: Optional[List[int]] = None
    heads: Optional[Dict[int, List[int]]] = None
    mlp_units: Optional[Dict[int, List[int]]] = None

    def __post_init__(self) -> None:
        if self.blocks is not None:
            self.blocks = sorted(int(b) for b in self.blocks)
        self.heads = _int_keys(self.heads)
        self.mlp_units = _int_keys(self.mlp_units)

    def held_blocks(self, n_layer: int) -> List[int]:
        return list(range(n_layer)) if self.blocks is None else list(self.blocks)

    def kept_heads(self, layer: int, n_head: int) -> List[int]:
        if self.heads is None or layer not in self.heads:
            return list(range(n_head))
        return list(self.heads[layer])

    def kept_units(self, layer: int, ffn_hidden: int) -> List[int]:
        if self.mlp_units is None or layer not in self.mlp_units:
            return list(range(ffn_hidden))
        return list(self.mlp_units[layer])

    def validate(self, cfg: ModelConfig) -> None:
        """Reject specs that do not describe a subnetwork of ``cfg`` (clear errors, at build)."""
        from models.common import resolved_ffn_hidden, resolved_kv_heads

        n_kv = resolved_kv_heads(cfg)
        group = cfg.n_head // n_kv
        ffn = resolved_ffn_hidden(cfg)

        def check(kind: str, indices: List[int], bound: int) -> None:
            if len(set(indices)) != len(indices):
                raise ValueError(f"SubnetSpec.{kind}: duplicate indices {indices}")
            if any(i < 0 or i >= bound for i in indices):
                raise ValueError(f"SubnetSpec.{kind}: indices {indices} outside [0, {bound})")

        check("blocks", self.held_blocks(cfg.n_layer), cfg.n_layer)
        for layer, kept in (self.heads or {}).items():
            check(f"heads[{layer}] layer", [layer], cfg.n_layer)
            check(f"heads[{layer}]", kept, cfg.n_head)
            groups = {h // group for h in kept}
            whole = sorted(g * group + j for g in groups for j in range(group))
            if whole != sorted(kept):
                raise ValueError(
                    f"SubnetSpec.heads[{layer}]={kept}: with grouped-query attention "
                    f"({cfg.n_head} heads, {n_kv} kv heads) keep whole groups of {group} "
                    f"consecutive heads, e.g. {whole}")
        for layer, kept in (self.mlp_units or {}).items():
            check(f"mlp_units[{layer}] layer", [layer], cfg.n_layer)
            check(f"mlp_units[{layer}]", kept, ffn)

    def is_full(self, cfg: ModelConfig) -> bool:
        return not parameter_slices(cfg, self) and self.held_blocks(cfg.n_layer) == list(
            range(cfg.n_layer))


def _block_index(name: str) -> Optional[Tuple[int, str]]:
    if not name.startswith("blocks."):
        return None
    _, layer, suffix = name.split(".", 2)
    return int(layer), suffix


def parameter_slices(cfg: ModelConfig, subnet: Optional[SubnetSpec]
                     ) -> Dict[str, Tuple[int, torch.Tensor]]:
    """For every sliced tensor of the subnetwork: (dimension, full-model indices along it).

    Position p of the subnetwork tensor along that dimension is index ``indices[p]`` of the full
    tensor. SDP uses this to find which rows/columns of a worker's tensor belong to which head
    group or unit group. Tensors not listed are held whole (or not at all: see ``held_blocks``).
    """
    from models.common import resolved_ffn_hidden, resolved_kv_heads

    if subnet is None:
        return {}
    head_dim = cfg.d_model // cfg.n_head
    group = cfg.n_head // resolved_kv_heads(cfg)
    ffn = resolved_ffn_hidden(cfg)
    slices: Dict[str, Tuple[int, torch.Tensor]] = {}
    for layer in subnet.held_blocks(cfg.n_layer):
        heads = subnet.kept_heads(layer, cfg.n_head)
        units = subnet.kept_units(layer, ffn)
        selectors: Dict[str, torch.Tensor] = {}
        if len(heads) != cfg.n_head:
            kv_heads = sorted({h // group for h in heads})
            selectors["q"] = _expand(heads, head_dim)
            selectors["kv"] = _expand(kv_heads, head_dim)
        if len(units) != ffn:
            selectors["unit"] = torch.tensor(units, dtype=torch.long)
        for suffix, (dim, selector) in _SLICE_RULES.items():
            if selector in selectors:
                slices[f"blocks.{layer}.{suffix}"] = (dim, selectors[selector])
    return slices


def _expand(heads: List[int], head_dim: int) -> torch.Tensor:
    if not heads:
        return torch.zeros(0, dtype=torch.long)
    base = torch.tensor(heads, dtype=torch.long)[:, None] * head_dim
    return (base + torch.arange(head_dim)[None, :]).reshape(-1)


def _is_held(name: str, held: set) -> bool:
    located = _block_index(name)
    return located is None or located[0] in held


def slice_state_dict(full_sd: Mapping[str, torch.Tensor], cfg: ModelConfig,
                     subnet: Optional[SubnetSpec]) -> Dict[str, torch.Tensor]:
    """The subnetwork's state dict cut out of a full one (names kept, unheld blocks dropped).

    Sliced tensors are new tensors; whole ones are the same tensor objects as in ``full_sd`` (no
    copy), since ``load_state_dict`` copies anyway.
    """
    if subnet is None:
        return dict(full_sd)
    held = set(subnet.held_blocks(cfg.n_layer))
    slices = parameter_slices(cfg, subnet)
    sub_sd: Dict[str, torch.Tensor] = {}
    for name, tensor in full_sd.items():
        if not _is_held(name, held):
            continue
        if name in slices:
            dim, indices = slices[name]
            sub_sd[name] = tensor.index_select(dim, indices.to(tensor.device))
        else:
            sub_sd[name] = tensor
    return sub_sd


@torch.no_grad()
def scatter_state_dict(sub_sd: Mapping[str, torch.Tensor], full_sd: Mapping[str, torch.Tensor],
                       cfg: ModelConfig, subnet: Optional[SubnetSpec]) -> None:
    """Write a subnetwork's tensors back into a full state dict, in place (inverse of slicing).

    Every name of ``sub_sd`` must exist in ``full_sd``; full-model entries the subnetwork does not
    hold are left untouched.
    """
    slices = parameter_slices(cfg, subnet)
    for name, tensor in sub_sd.items():
        if name not in full_sd:
            raise KeyError(f"scatter_state_dict: {name!r} is not in the full state dict")
        target = full_sd[name]
        if name in slices:
            dim, indices = slices[name]
            target.index_copy_(dim, indices.to(target.device), tensor.to(target.dtype))
        else:
            if target.shape != tensor.shape:
                raise ValueError(f"scatter_state_dict: {name!r} has shape {tuple(tensor.shape)}, "
                                 f"the full model's is {tuple(target.shape)}")
            target.copy_(tensor)
