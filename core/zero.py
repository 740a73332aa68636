"""ZeRO-1 for the dense optimizers (``optimizer.shard=true`` with adamw / adams).

The flat parameters (matrices first, as SCAPE lays them out, so weight decay is one prefix) are
split into N equal contiguous shards; rank r keeps the optimizer state (AdamW's m and v, AdamS's
m) of shard r only, 1/N of DenseAllReduce's. Per step:

    reduce-scatter of the gradient (kind grad_reducescatter): rank r gets the mean of its shard
    one fp64 scalar all-reduce of the squared shard norms (kind grad_norm): the clipping norm
    the optimizer steps its shard (torch's AdamW or our AdamS, unchanged)
    all-gather of the updated shard (kind param_allgather) into every rank's model

Reduce-scatter plus all-gather send exactly the bytes of the one fp32 all-reduce of
DenseAllReduce (both are the two halves of a ring all-reduce), plus the 8-byte norm. The model
itself stays whole on every rank (its forward needs it); what shrinks is the optimizer state.

The norm stays on the device and the skip decision is taken as DenseAllReduce takes it
(``step(lr, skip)``): on the device with torch's fused AdamW (its ``found_inf``), read once per
step with AdamS (its step count is on the host). A skipped step still all-gathers the shards,
unchanged, so every rank issues the same collectives without knowing the flag.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist

from core.comm import Collectives
from core.flat import FlatParameters, decays, flat_order
from core.optim import optimizer_for_groups
from core.sync import GradientSynchronizer


class ZeroDenseSynchronizer(GradientSynchronizer):
    """Dense data parallelism with the optimizer state sharded over the ranks (see module doc).

    ``cfg`` carries the fields of ``core.optim.DenseOptimizerConfig`` (name adamw or adams).
    """

    def __init__(self, model: torch.nn.Module, cfg: Any, comm: Optional[Collectives] = None) -> None:
        initialized = dist.is_available() and dist.is_initialized()
        self.world = dist.get_world_size() if initialized else 1
        self.rank = dist.get_rank() if initialized else 0
        params = [p for p in model.parameters() if p.requires_grad]
        if not params:
            raise ValueError("optimizer.shard=true needs at least one trainable parameter")
        decay = [p for p in params if decays(p)]
        self.flat = FlatParameters(flat_order(params), pad_to=self.world)
        size = self.flat.padded_numel // self.world
        self.shard = slice(self.rank * size, (self.rank + 1) * size)
        self.grad_shard = torch.zeros(size, dtype=torch.float32, device=self.flat.data.device)
        decay_end = sum(p.numel() for p in decay)
        groups = []
        for lo, hi, weight_decay in ((0, decay_end, float(cfg.weight_decay)),
                                     (decay_end, self.flat.numel, 0.0)):
            lo, hi = max(lo, self.shard.start), min(hi, self.shard.stop)
            if lo < hi:  # the optimizer's view of this piece of the shard, and its gradient
                piece = torch.nn.Parameter(self.flat.data[lo:hi], requires_grad=True)
                piece.grad = self.grad_shard[lo - self.shard.start:hi - self.shard.start]
                groups.append({"params": [piece], "weight_decay": weight_decay})
        if not groups:
            raise ValueError(f"optimizer.shard=true over {self.world} ranks: the model's "
                             f"{self.flat.numel} parameters leave rank {self.rank} an empty shard")
        self.pieces: List[torch.nn.Parameter] = [g["params"][0] for g in groups]
        super().__init__(model, optimizer_for_groups(groups, cfg), comm)

    def zero_grad(self) -> None:
        self.flat.zero_grad()

    def reduce_gradients(self) -> None:
        self.comm.reduce_scatter_tensor(self.grad_shard, self.flat.grad, kind="grad_reducescatter")
        if self.world > 1:
            self.grad_shard.div_(self.world)

    def clip_gradients(self, max_norm: float) -> torch.Tensor:
        """torch.nn.utils.clip_grad_norm_'s rule on the global norm, summed from the shards (a
        device tensor: no host read)."""
        squares = torch.linalg.vector_norm(self.grad_shard).double().square().reshape(1)
        self.comm.all_reduce(squares, kind="grad_norm")
        norm = squares.sqrt().float().squeeze(0)
        if max_norm > 0:
            self.grad_shard.mul_(torch.clamp(max_norm / (norm + 1e-6), max=1.0))
        return norm

    takes_skip_flag = True

    @property
    def skips_on_device(self) -> bool:
        """The optimizer takes a ``found_inf`` flag (torch's fused AdamW): no host read at all."""
        return bool(self.optimizer.defaults.get("fused"))

    def step(self, lr: float, skip: Optional[torch.Tensor] = None) -> None:
        if skip is None or not self.skips_on_device:
            if skip is None or not bool(skip):  # AdamS: the step's one host read
                super().step(lr)
        else:
            self.optimizer.found_inf = skip.to(torch.float32).reshape(())
            try:
                super().step(lr)
            finally:
                del self.optimizer.found_inf
        send = self.flat.data[self.shard].clone()  # the all-gather's output holds the input's storage
        self.comm.all_gather_into_tensor(self.flat.data, send, kind="param_allgather")

    # --- checkpoint state: the optimizer's is per rank ---------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        return {"optimizer": {"sharded_over": self.world}}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        if "sharded_over" not in state["optimizer"]:
            raise ValueError("this checkpoint was written with optimizer.shard=false (the optimizer "
                             "state is replicated in optimizer.pt): resume with optimizer.shard=false")

    def local_state_dict(self) -> Dict[str, Any]:
        """This rank's shard [start, stop) of the padded flat buffer and its optimizer state (the
        unpadded prefix is the same for every world size, which re-slicing on resume relies on)."""
        return {"optimizer": self.optimizer.state_dict(), "shard": [self.shard.start, self.shard.stop],
                "numel": self.flat.numel, "rank": self.rank}

    def load_local_state_dict(self, state: Dict[str, Any]) -> None:
        if "shard" not in state:
            raise ValueError("this rank's checkpoint file holds no optimizer shard: it was written "
                             "with optimizer.shard=false; resume with optimizer.shard=false")
        if list(state["shard"]) != [self.shard.start, self.shard.stop] or state["numel"] != self.flat.numel:
            raise ValueError(f"rank {self.rank}'s checkpointed optimizer shard covers {state['shard']} of "
                             f"{state['numel']} parameters, this run's [{self.shard.start}, "
                             f"{self.shard.stop}) of {self.flat.numel}: resume with the same model "
                             f"and world size")
        self.optimizer.load_state_dict(state["optimizer"])
