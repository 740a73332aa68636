"""All trainable parameters and their gradients as views into two flat fp32 buffers."""
from __future__ import annotations

import math
from typing import Any, Callable, Dict, List, Sequence, Set, Tuple, TypeVar

import torch


class FlatParameters:
    """All trainable parameters and their gradients as views into two flat fp32 buffers.

    One contiguous buffer lets a synchroniser reduce gradients with one collective and lets
    SCAPE partition the parameter space. ``pad_to`` pads the length to a multiple (SCAPE's equal
    partitions); the padding stays zero.
    """

    def __init__(self, params: List[torch.nn.Parameter], pad_to: int = 1) -> None:
        self.params = params
        self.numel = sum(p.numel() for p in params)
        self.padded_numel = int(math.ceil(self.numel / pad_to) * pad_to) if pad_to > 1 else self.numel
        device = params[0].device
        self.data = torch.zeros(self.padded_numel, dtype=torch.float32, device=device)
        self.grad = torch.zeros_like(self.data)
        offset = 0
        self.offsets: List[int] = []
        for p in params:
            n = p.numel()
            self.data[offset:offset + n].copy_(p.detach().reshape(-1))
            p.data = self.data[offset:offset + n].view_as(p)
            p.grad = self.grad[offset:offset + n].view_as(p)
            self.offsets.append(offset)
            offset += n

    def zero_grad(self) -> None:
        self.grad.zero_()

    def ranges(self, ids: Set[int]) -> List[Tuple[int, int]]:
        """``[start, end)`` in the flat buffer of each parameter whose ``id`` is in ``ids``."""
        return [(offset, offset + p.numel()) for p, offset in zip(self.params, self.offsets) if id(p) in ids]


Item = TypeVar("Item")


def decays(param: torch.Tensor) -> bool:
    """Weight decay on matrices only (ndim >= 2), never on norms and biases (nanoGPT's rule)."""
    return param.ndim >= 2


def flat_order(items: Sequence[Item], param: Callable[[Item], torch.Tensor] = lambda item: item) -> List[Item]:
    """The order of the parameters in a flat buffer: the decayed ones first, so that weight decay
    covers one prefix, then the rest, each group in model order. ``param`` reads the tensor from
    an item (``lambda named: named[1]`` for ``named_parameters()``)."""
    return [x for x in items if decays(param(x))] + [x for x in items if not decays(param(x))]


def embedding_weight_ids(model: torch.nn.Module) -> Set[int]:
    """The ids of the weights of the model's ``torch.nn.Embedding`` tables (a tied output head
    shares them): what a parameter group's ``match: embedding`` selects (``optimizer.param_groups``)."""
    return {id(module.weight) for module in model.modules() if isinstance(module, torch.nn.Embedding)}


def param_groups(params: List[torch.nn.Parameter], weight_decay: float,
                 scaled: Set[int] = frozenset(), lr_scale: float = 1.0) -> List[Dict[str, Any]]:
    """The decayed parameters (``decays``) in one group, the rest without weight decay. With
    ``lr_scale`` != 1 the matrices whose ids are in ``scaled`` (embedding tables) form a third,
    decayed group whose ``lr_scale`` the synchroniser multiplies the learning rate by."""
    if lr_scale == 1.0:
        scaled = frozenset()
    decay = [p for p in params if decays(p) and id(p) not in scaled]
    no_decay = [p for p in params if not decays(p) and id(p) not in scaled]
    groups = [{"params": decay, "weight_decay": weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    tables = [p for p in params if id(p) in scaled]
    if any(not decays(p) for p in tables):
        raise ValueError("param_groups: an lr-scaled parameter is not a matrix; only embedding tables are scaled")
    if tables:
        groups.append({"params": tables, "weight_decay": weight_decay, "lr_scale": lr_scale})
    return groups
