"""The model factory: Llama and GPT-2 families, named sizes in conf/model/, FLOPs, SDP subnetworks.

Public surface (other parts code against it):
    build_model(cfg, subnet=None, device=None) -> nn.Module
    model(idx, targets=None) -> logits [B, T, V] | scalar fp32 loss
    model.set_activation_checkpointing(enabled)
    model.compile_blocks(**torch_compile_options)   # train.compile: each block on its own
    flops_per_token(cfg, subnet=None) -> float
    count_parameters(model) -> int
    models.subnet: SubnetSpec, slice_state_dict, scatter_state_dict, parameter_slices
"""
from __future__ import annotations

import warnings
from typing import Optional, Union

import torch
import torch.nn as nn

from models.common import (CausalLM, initialise, resolved_ffn_hidden, resolved_kv_heads,
                           validate_config)
from models.config import ModelConfig
from models.gpt import GPT
from models.llama import Llama
from models.subnet import SubnetSpec, parameter_slices

__all__ = ["ModelConfig", "SubnetSpec", "build_model", "flops_per_token", "count_parameters",
           "matmul_parameters", "load_model_config"]

_FAMILIES = {"llama": Llama, "gpt": GPT}


def _coerce_config(cfg) -> ModelConfig:
    # Accept a Hydra DictConfig / plain dict as well as the dataclass.
    if isinstance(cfg, ModelConfig):
        return cfg
    if not isinstance(cfg, dict):
        from omegaconf import OmegaConf
        cfg = OmegaConf.to_container(cfg, resolve=True)
    return ModelConfig(**cfg)


def build_model(cfg: ModelConfig, subnet: Optional[SubnetSpec] = None,
                device: Union[str, torch.device, None] = None) -> CausalLM:
    """Build the model (or an SDP subnetwork of it) directly on ``device``, initialised.

    Initialisation is deterministic given the current torch (CPU) RNG state: one seed is drawn
    from it, and every tensor is drawn from its own generator seeded by that seed and its name,
    so ``build_model(cfg, subnet)`` equals ``slice_state_dict(build_model(cfg).state_dict())`` for
    the same RNG state. Unheld blocks are never allocated; on ``device="meta"`` nothing is.
    """
    cfg = _coerce_config(cfg)
    validate_config(cfg)
    if subnet is not None:
        subnet.validate(cfg)
    device = torch.device(device) if device is not None else torch.device("cpu")
    base_seed = int(torch.randint(0, 2 ** 62, (1,)).item())
    family = _FAMILIES[cfg.family]
    # Construct shapes only, then allocate once on the target device and draw our own init
    # (no throw-away default init, no full-size CPU copy of a big model).
    with torch.device("meta"), warnings.catch_warnings():
        # nn.Linear's default init complains about the empty weights of a block holding no head.
        warnings.filterwarnings("ignore", message="Initializing zero-element tensors is a no-op")
        model = family(cfg, subnet)
    if device.type != "meta":
        model.to_empty(device=device)
        slices = parameter_slices(cfg, subnet)
        full_shapes = {}
        if slices:
            with torch.device("meta"):
                full_shapes = {n: p.shape for n, p in family(cfg).named_parameters()}
        initialise(model, cfg, full_shapes, slices, base_seed)
    return model


def count_parameters(model: nn.Module) -> int:
    """Distinct parameters (a tied tensor counts once), trainable or not."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def matmul_parameters(cfg: ModelConfig, subnet: Optional[SubnetSpec] = None) -> int:
    """N of 6N: weights of the matrix multiplies a token goes through — every linear weight in
    the (held) blocks plus the LM head (d_model x vocab, counted even when tied, because the
    head is a matmul while the embedding is a lookup). Excluded: token and position embeddings,
    norms, biases.
    """
    cfg = _coerce_config(cfg)
    head_dim = cfg.d_model // cfg.n_head
    group = cfg.n_head // resolved_kv_heads(cfg)
    ffn = resolved_ffn_hidden(cfg)
    subnet = subnet or SubnetSpec()
    total = cfg.d_model * cfg.vocab_size
    mlp_matrices = 3 if cfg.family == "llama" else 2
    for layer in subnet.held_blocks(cfg.n_layer):
        heads = subnet.kept_heads(layer, cfg.n_head)
        kv_heads = len({h // group for h in heads})
        total += cfg.d_model * head_dim * (2 * len(heads) + 2 * kv_heads)  # q, o and k, v
        total += mlp_matrices * cfg.d_model * len(subnet.kept_units(layer, ffn))
    return total


def flops_per_token(cfg: ModelConfig, subnet: Optional[SubnetSpec] = None) -> float:
    """Training FLOPs per token: 6 N + 12 L d T (PaLM appendix B), N from ``matmul_parameters``.

    The attention term counts the full (not causally halved) score and value matmuls at
    context T = seq_len, as PaLM does; with a subnetwork, L counts held blocks and d the kept
    heads' width. The trainer's MFU divides by the dense bf16 peak.
    """
    cfg = _coerce_config(cfg)
    subnet = subnet or SubnetSpec()
    head_dim = cfg.d_model // cfg.n_head
    attention_width = sum(len(subnet.kept_heads(layer, cfg.n_head)) * head_dim
                          for layer in subnet.held_blocks(cfg.n_layer))
    return float(6 * matmul_parameters(cfg, subnet) + 12 * attention_width * cfg.seq_len)


def load_model_config(name_or_path: str) -> ModelConfig:
    """A named size from conf/model/<name>.yaml (or a YAML path), as a ModelConfig."""
    import os

    import yaml

    path = name_or_path
    if not os.path.exists(path):
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        path = os.path.join(root, "conf", "model", f"{name_or_path}.yaml")
    with open(path) as f:
        fields = yaml.safe_load(f)
    return ModelConfig(**{k: v for k, v in fields.items() if not k.startswith("_")})
