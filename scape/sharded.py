"""Sharded SCAPE (``optimizer.shard=true``): the distributed-optimizer form of the paper's runs.

SCAPE already splits the flat parameters into rank-owned partitions (scape/partition.py): rank r
scores and selects the mask of its own region. Here that region is also its optimizer shard:
rank r keeps the momentum (AdamW's v and the staleness counters too, when on) of its region only,
so the optimizer state per rank is 1/N of the replicated one. The residual stays per rank and
full-length, as in replicated SCAPE (it is each rank's own error feedback).

Per sparse step, against replicated SCAPE's one all-reduce of the N k masked values:

- reduce-scatter of the masked values (kind ``scape_values``): rank r receives the sum of its own
  partitions' k values per partition, (N - 1) / N * N k * s bytes sent;
- the owner updates its masked coordinates (the lazy rule, with the decay applied to its shard;
  every rank decays the rest of the decayed range itself, which is what the owners do too);
- all-gather of the updated fp32 parameters on the mask (kind ``scape_params``), (N - 1) k * 4
  bytes; every rank writes them into its model.

With fp32 values that is exactly the all-reduce's 2 (N - 1) / N * N k * 4 bytes; with a bf16
payload it is 3/2 of it (the parameters travel in fp32 to stay equal to replicated SCAPE). The
clipping norm of ghat, now spread over the owners, costs one fp64 scalar all-reduce (kind
``grad_norm``). Dense steps are ZeRO-1's: reduce-scatter of the gradient, the update of the
shard, all-gather of the shard. The mask exchange, its lag and its score are replicated SCAPE's:
the score |b1 m + e| of the owned region only ever needed the owned momentum.

``update=all`` is refused: it moves every coordinate, so its all-gather would be dense.
"""
from __future__ import annotations

from typing import Any, Dict, Optional

import torch

from core.checkpoint import repad
from core.comm import Collectives
from scape.config import OptimizerConfig
from scape.options import as_dataclass
from scape.residual import DEFAULT_CHUNK_NUMEL
from scape.synchronizer import ScapeSynchronizer
from scape.update import ScapeOptimizer


class ShardedScapeSynchronizer(ScapeSynchronizer):
    """SCAPE whose optimizer state covers this rank's owned partitions only (see module doc)."""

    TABLE_LR_SCALE = False

    @torch.no_grad()
    def load_resharded_state(self, state: Dict[str, Any], shards: Any) -> None:
        """Elastic resume from a checkpoint of ``shards.world`` ranks (collective).

        The optimizer state is re-cut: each old rank's shard [start, stop) is placed in a buffer
        of the old padded length (zeros elsewhere), so the sum over the old ranks is the whole
        state; ``shards.mean`` returns that sum / N (exact for N a power of two), which is scaled
        back, re-padded for this run and sliced to this rank's new shard. The residual is the mean
        of the old ranks' residuals and the pending mask is re-selected, as replicated SCAPE does
        (``ScapeSynchronizer.load_resharded_state``); the lr-sum table is replicated and comes
        from one old rank's file.
        """
        old = state.get("layout") or {}
        numel, padded = self.layout.numel, self.layout.padded_numel
        if old.get("numel") != numel:
            raise ValueError(f"SCAPE checkpoint has {old.get('numel')} parameters, this model has "
                             f"{numel}: resume with the model the run was started with")
        if "sharded_over" not in (state.get("optimizer") or {}):
            raise ValueError("this SCAPE checkpoint was written with optimizer.shard=false (the "
                             "momentum is replicated in optimizer.pt): resume with optimizer.shard=false")
        opt = self.optimizer
        keys = [k for k in ("momentum", "second_moment", "last_sent") if getattr(opt, k) is not None]
        old_padded = int(old["padded_numel"])

        def placed(local: Dict[str, Any]) -> Dict[str, torch.Tensor]:
            if "optimizer" not in local or "shard" not in local or "residual" not in local:
                raise ValueError("a rank's checkpoint file holds no SCAPE optimizer shard; it was "
                                 "written by another optimizer or with optimizer.shard=false")
            start, stop = local["shard"]
            out = {"residual": local["residual"]}
            for key in keys:
                full = torch.zeros(old_padded)
                full[start:stop] = local["optimizer"][key].float()
                out[key] = full
            return out

        self.masks.wait()
        like = {key: torch.empty(old_padded) for key in (*keys, "residual")}
        total = shards.mean(placed, like, self.comm, self.rank, self.world, self.device)
        for key in keys:
            whole = repad(total[key].mul_(shards.world).cpu(), numel, padded)
            getattr(opt, key).copy_(whole[self.shard].to(getattr(opt, key).dtype))
        if opt.lr_sums is not None:
            opt.lr_sums = shards.read(0)["optimizer"]["lr_sums"].to(opt.lr_sums.device, copy=True)
        self.residual.load(repad(total["residual"].cpu(), numel, padded).to(self.residual.storage.device))
        self.step_count = int(state["step"])
        self.masks.load_state_dict({})  # the old mask is k per old partition: re-selected here
        following = self.step_count + 1
        if "mask" in state and self.cfg.lag and not self.is_dense(following):
            self._score_residual()
            self.masks.exchange(following, self.k_at(following), async_op=False, overlap=False)
            self.masks.wait()

    def __init__(self, model: torch.nn.Module, cfg: OptimizerConfig,
                 num_partitions: Optional[int] = None,
                 residual_chunk_numel: int = DEFAULT_CHUNK_NUMEL, comm: Optional[Collectives] = None) -> None:
        cfg = as_dataclass(cfg)
        if cfg.update != "lazy":
            raise ValueError(f"optimizer.shard=true needs optimizer.update=lazy (got {cfg.update!r}): "
                             f"update=all moves every coordinate, so the sharded all-gather would be "
                             f"dense; set optimizer.shard=false for that ablation")
        super().__init__(model, cfg, num_partitions, residual_chunk_numel, comm)
        # The masked values go to their owners by a reduce-scatter after backward; the overlap of
        # replicated SCAPE's all-reduce with backward (optimizer.overlap_backward) does not apply.
        if self.backward_overlap is not None:
            self.backward_overlap.remove()
            self.backward_overlap = None

    # --- the shard ---------------------------------------------------------------------------
    @property
    def shard(self) -> slice:
        """This rank's optimizer shard: its owned partitions, as a slice of the flat buffer."""
        return slice(self.layout.owned_start, self.layout.owned_start + self.layout.owned_numel)

    def _build_optimizer(self, decay_numel: int, cap: float) -> ScapeOptimizer:
        cfg, shard = self.cfg, self.shard
        self._decay_numel = decay_numel
        local_decay = min(max(decay_numel - shard.start, 0), self.layout.owned_numel)
        # a view: the owner's update writes straight into its model's flat buffer
        return ScapeOptimizer(self.flat.data[shard], local_decay, cfg.lr, cfg.betas, cfg.eps,
                              cfg.weight_decay, cfg.base, cfg.stale_scale, cap)

    def _own_mask(self) -> torch.Tensor:
        """The flat indices of M_t in this rank's shard: one contiguous block of the mask (it is
        ascending with k per partition, and the shard is whole partitions)."""
        per_rank = self.layout.partitions_per_rank * self.mask_k
        return self.mask[self.rank * per_rank:(self.rank + 1) * per_rank]

    # --- the exchange ------------------------------------------------------------------------
    def _reduce_dense(self, grad: torch.Tensor) -> torch.Tensor:
        shard = torch.empty(self.layout.owned_numel, dtype=grad.dtype, device=self.device)
        self.comm.reduce_scatter_tensor(shard, grad, kind="grad_reducescatter")
        if self.world > 1:
            shard.div_(self.world)
        return shard

    def _reduce_values(self, values: torch.Tensor) -> torch.Tensor:
        own = torch.empty(values.numel() // self.world, dtype=values.dtype, device=self.device)
        self.comm.reduce_scatter_tensor(own, values, kind="scape_values")
        return own.float().div_(self.world * (1.0 - self.beta1))

    def _ghat_norm(self) -> torch.Tensor:
        """The global norm of ghat from each owner's part: one fp64 scalar all-reduce."""
        squares = torch.linalg.vector_norm(self._ghat).double().square().reshape(1)
        self.comm.all_reduce(squares, kind="grad_norm")
        return squares.sqrt().float().squeeze(0)

    def _momentum(self, start: int, stop: int) -> torch.Tensor:
        lo = self.layout.owned_start
        return self.optimizer.momentum[start - lo:stop - lo]

    # --- the update --------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, lr: float, skip: Optional[torch.Tensor] = None) -> None:
        """The owner's update and the parameters' all-gather; ``skip`` as in replicated SCAPE
        (read once; every rank reads the same flag, so all skip the collectives alike)."""
        step = self.step_count + 1
        self._skipped = self._skips(skip)
        if self._skipped:
            if self._folded:
                self._rollback()
            self._ghat = self._sent_local = self._residual_at_mask = None
            self._folded = False
            return
        pre_send = self.cfg.score_timing == "pre_send"
        if not self._dense and not self._folded and pre_send:
            self._fold_sent(score=True)
        if self._dense:
            self.optimizer.dense_update(self._ghat, lr, step)
            send = self.optimizer.param.clone()  # the all-gather's output holds the input's storage
            self.comm.all_gather_into_tensor(self.flat.data, send, kind="param_allgather")
        else:
            own = self._own_mask() - self.layout.owned_start
            self.optimizer.masked_update(own, self._ghat, lr, step)
            self._decay_outside_shard(lr)
            send = self.optimizer.param.index_select(0, own)
            received = torch.empty(self.mask.numel(), dtype=send.dtype, device=self.device)
            self.comm.all_gather_into_tensor(received, send, kind="scape_params")
            self.flat.data.index_copy_(0, self.mask, received)
            if not self._folded and not pre_send:  # the post-step score reads the updated shard
                self._fold_sent(score=self.cfg.lag)
        self.step_count = step
        self._ghat = self._sent_local = self._residual_at_mask = None
        self._folded = False

    def _decay_outside_shard(self, lr: float) -> None:
        """The lazy rule's decay of every matrix coordinate, on the part of the model the owner
        of the shard does not update here; the same multiplication the owners apply to theirs."""
        wd, end, shard = self.cfg.weight_decay, self._decay_numel, self.shard
        if wd == 0.0 or end == 0:
            return
        factor = 1.0 - lr * wd
        self.flat.data[:min(end, shard.start)].mul_(factor)
        if end > shard.stop:
            self.flat.data[shard.stop:end].mul_(factor)

    # --- checkpoints -------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        """The replicated state (step, layout, mask); the optimizer's is in each rank's file."""
        self.masks.wait()
        state: Dict[str, Any] = {"step": self.step_count, "layout": self.masks.layout_record(),
                                 "optimizer": {"sharded_over": self.world}}
        state.update(self.masks.state_dict(self.step_count + 1))
        return state

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.masks.check_layout(state["layout"])
        if "sharded_over" not in state["optimizer"]:
            raise ValueError("this SCAPE checkpoint was written with optimizer.shard=false (the "
                             "momentum is replicated in optimizer.pt): resume with optimizer.shard=false")
        self.masks.wait()
        self.step_count = int(state["step"])
        self.masks.load_state_dict(state)

    def local_state_dict(self) -> Dict[str, Any]:
        """The residual, and the optimizer state of the shard [start, stop) of the padded flat
        buffer (the unpadded prefix is the same in every layout, which a re-slicing resume on
        another world size relies on)."""
        state = super().local_state_dict()
        state.update(optimizer=self.optimizer.state_dict(), shard=[self.shard.start, self.shard.stop])
        return state

    def load_local_state_dict(self, state: Dict[str, Any]) -> None:
        if "optimizer" not in state:
            raise ValueError("this rank's SCAPE checkpoint file holds no optimizer shard: it was "
                             "written with optimizer.shard=false; resume with optimizer.shard=false")
        super().load_local_state_dict(state)
        if list(state["shard"]) != [self.shard.start, self.shard.stop]:
            raise ValueError(f"rank {self.rank}'s checkpointed optimizer shard covers {state['shard']}, "
                             f"this run's covers [{self.shard.start}, {self.shard.stop}]")
        self.optimizer.load_state_dict(state["optimizer"])
