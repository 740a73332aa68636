"""The gradient-synchronisation seam.

DESIGN.md: dense all-reduce, SCAPE and SDP each own exactly one place where gradients cross ranks,
and the loop does not know which one runs. A synchroniser owns the optimizer too, because SCAPE's
communication and update are one algorithm (its mask comes from the momentum) and SDP keeps
optimizer state only for held parameters.

The loop calls, once per optimizer step, after the micro-batches' backward passes:

    sync.reduce_gradients()          # the collective(s); timed as communication
    norm = sync.clip_gradients(max)  # returns the pre-clip global norm
    sync.step(lr)                    # the update; timed as optimizer
    sync.after_step()                # e.g. SCAPE starts its async mask all-gather

and between steps ``sync.zero_grad()``. Checkpoints call ``state_dict`` (replicated state, written
by rank 0) and ``local_state_dict`` (this rank's own state, e.g. SCAPE's residual, written by
every rank). Validation and export run inside ``with sync.evaluation_weights():`` (every
rank enters it): the model then holds the weights to evaluate, e.g. sparse model averaging's
average of the ranks' copies; for the others these are the training weights themselves.
"""
from __future__ import annotations

import contextlib
import math
from typing import Any, Dict, Iterator, List

import torch
import torch.distributed as dist

from trainer import comm


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


def param_groups(params: List[torch.nn.Parameter], weight_decay: float) -> List[Dict[str, Any]]:
    """Weight decay on matrices only (ndim >= 2), never on norms and biases (nanoGPT's rule)."""
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


class GradientSynchronizer:
    """Base class: the optimizer step and the bookkeeping every synchroniser shares."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model = model
        self.optimizer = optimizer
        self.params = [p for p in model.parameters() if p.requires_grad]

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=False)

    def reduce_gradients(self) -> None:
        raise NotImplementedError

    def clip_gradients(self, max_norm: float) -> float:
        """Global L2 norm of the (already reduced, hence replicated) gradients; clip if max_norm > 0."""
        if max_norm > 0:
            return float(torch.nn.utils.clip_grad_norm_(self.params, max_norm))
        return float(torch.linalg.vector_norm(
            torch.stack([torch.linalg.vector_norm(p.grad) for p in self.params])))

    def step(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()

    def after_step(self) -> None:
        pass

    def metrics(self) -> Dict[str, float]:
        """Extra per-step metrics (prefixed scape/, sdp/, ...)."""
        return {}

    def state_dict(self) -> Dict[str, Any]:
        return {"optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state["optimizer"])

    def local_state_dict(self) -> Dict[str, Any]:
        return {}

    def load_local_state_dict(self, state: Dict[str, Any]) -> None:
        pass

    @contextlib.contextmanager
    def evaluation_weights(self) -> Iterator[None]:
        """Inside, the model holds the weights to validate and export; restored on exit.

        Every rank enters it (it may be a collective). Base: the training weights, nothing to do.
        """
        yield

    def model_state_dict(self) -> Dict[str, torch.Tensor]:
        """The full model's weights for checkpoints and export (collective for SDP; every rank calls)."""
        return self.model.state_dict()

    def load_model_state_dict(self, state: Dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            self.model.load_state_dict(state)


class DenseAllReduce(GradientSynchronizer):
    """Data parallelism as DDP does it: the mean gradient over all ranks, one flat collective.

    The all-reduce runs after the last micro-batch's backward (not overlapped with it) so that
    communication time is measured on its own and compares like for like with SCAPE and SDP.
    """

    def __init__(self, model: torch.nn.Module, optimizer_factory) -> None:
        params = [p for p in model.parameters() if p.requires_grad]
        self.flat = FlatParameters(params)
        super().__init__(model, optimizer_factory(params))
        self.world = dist.get_world_size() if dist.is_initialized() else 1

    def zero_grad(self) -> None:
        self.flat.zero_grad()

    def reduce_gradients(self) -> None:
        if self.world > 1:
            comm.all_reduce(self.flat.grad, kind="grad_allreduce")
            self.flat.grad.div_(self.world)
