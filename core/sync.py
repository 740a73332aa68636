"""The gradient-synchronisation seam: the interface the Trainer talks to, and the dense one.

docs/DESIGN.md: dense all-reduce, SCAPE and SDP each own exactly one place where gradients cross ranks,
and the Trainer does not know which one runs. A synchroniser owns the optimizer too, because
SCAPE's communication and update are one algorithm (its mask comes from the momentum) and SDP
keeps optimizer state only for held parameters.

The step (trainer/step.py) runs each micro-batch's forward (through ``sync.train_module``) and
backward inside ``sync.micro_batch_context(last)``, then calls, once per optimizer step:

    sync.reduce_gradients()          # the collective(s); timed as communication
    norm = sync.clip_gradients(max)  # returns the pre-clip global norm
    sync.step(lr)                    # the update; timed as optimizer
    sync.after_step()                # e.g. SCAPE starts its async mask all-gather

and between steps ``sync.zero_grad()``. Everything else the Trainer needs to know is asked here,
never of the config: ``parameter_counts``, ``compute_spec`` (for FLOPs), ``step_budget``,
``validation_model``, ``evaluation_weights``, ``metrics``. Checkpoints call ``state_dict``
(replicated state, written by rank 0), ``local_state_dict`` (this rank's own, e.g. SCAPE's
residual, written by every rank) and ``model_state_dict`` (the full model's weights). A checkpoint
written by another number of ranks is loaded with ``load_resharded_state`` (elastic resume).

scape/ and sdp/ register their builders with ``register_synchronizer``; the Trainer looks them
up by name with ``synchronizer_builder``.
"""
from __future__ import annotations

import contextlib
import inspect
from typing import Any, Callable, ContextManager, Dict, Iterator, List, Literal, Optional, Tuple

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from core.choices import check_choice
from core.comm import Collectives
from core.flat import FlatParameters


def distinct_numel(module: torch.nn.Module) -> int:
    """Distinct parameters (a tied tensor counts once), trainable or not."""
    return sum(p.numel() for p in {id(p): p for p in module.parameters()}.values())


class GradientSynchronizer:
    """Base class: the optimizer step and the bookkeeping every synchroniser shares."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 comm: Optional[Collectives] = None) -> None:
        self.model = model
        self.optimizer = optimizer
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.comm = comm if comm is not None else Collectives()
        # The module the step's forward calls: the model, or a wrapper whose backward hooks
        # communicate (DDP); the Trainer compiles this one.
        self.train_module: torch.nn.Module = model

    # --- the step ------------------------------------------------------------------------------
    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=False)

    def micro_batch_context(self, last: bool) -> ContextManager:
        """Wraps one micro-batch's forward and backward; ``last`` marks the step's final one.

        The seam for communication that overlaps backward: a DDP-style synchroniser skips its
        all-reduce on the earlier micro-batches (``no_sync``) and starts it from gradient hooks
        during the last one; ``reduce_gradients`` then waits for what was started.
        """
        return contextlib.nullcontext()

    def reduce_gradients(self) -> None:
        raise NotImplementedError

    def clip_gradients(self, max_norm: float) -> torch.Tensor:
        """Global L2 norm of the (already reduced, hence replicated) gradients; clip if max_norm > 0.

        Returned as a tensor on the device (no host read); the step reads it at log steps only."""
        if max_norm > 0:
            return torch.nn.utils.clip_grad_norm_(self.params, max_norm)
        return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in self.params]))

    @property
    def ranks_reduced_in_backward(self) -> int:
        """How many ranks' gradients ``p.grad`` averages right after the last backward: 1, or the
        world where the reduction runs inside backward (DDP). The noise scale's batch size."""
        return 1

    @property
    def takes_skip_flag(self) -> bool:
        """True when ``step(lr, skip)`` takes the skip decision as a device tensor: the loop then
        runs the reduction and the clip unconditionally and never reads the flag itself. False:
        the loop reads the control flags on the host and skips ``reduce_gradients`` and ``step``
        (what SCAPE and SDP need: a skipped step must leave their bookkeeping untouched)."""
        return False

    def step(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr * group.get("lr_scale", 1.0)  # lr_scale: core.flat.param_groups
        self.optimizer.step()

    def after_step(self) -> None:
        pass

    # --- what the Trainer asks -----------------------------------------------------------------
    def parameter_counts(self) -> Tuple[int, int]:
        """(parameters this rank's model holds, parameters of the full model)."""
        n = distinct_numel(self.model)
        return n, n

    def compute_spec(self) -> Any:
        """The subnetwork this rank computes, for FLOP counting; None = the full model."""
        return None

    def step_budget(self, train_steps: int) -> int:
        """Optimizer steps to run for ``train.steps`` (SDP's FLOP-matched budget differs)."""
        return int(train_steps)

    def validation_model(self, train_model: Optional[torch.nn.Module] = None) -> torch.nn.Module:
        """The module validation loss is computed with (default: the one that trains, e.g. the
        compiled model the Trainer passes in)."""
        return train_model if train_model is not None else self.model

    def downstream_model(self) -> torch.nn.Module:
        """The model in-loop downstream evaluation scores on rank 0."""
        return self.model

    @contextlib.contextmanager
    def evaluation_weights(self) -> Iterator[None]:
        """Inside, the model holds the weights to validate and score (e.g. sparse model averaging's
        average of the ranks' copies); restored exactly on exit. Every rank enters it (it may be a
        collective). Default: the training weights themselves, nothing to do. Checkpoints need no
        context: ``model_state_dict`` already returns the weights to save."""
        yield

    def metrics(self) -> Dict[str, float]:
        """Extra per-step metrics (prefixed scape/, sdp/, ...)."""
        return {}

    # --- checkpoint state ----------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        return {"optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        if "sharded_over" in state["optimizer"]:  # core/zero.py wrote it
            raise ValueError("this checkpoint was written with optimizer.shard=true (each rank's file "
                             "holds its optimizer shard): resume with optimizer.shard=true")
        saved, groups = len(state["optimizer"]["param_groups"]), self.optimizer.param_groups
        if saved != len(groups):
            raise ValueError(f"this checkpoint's optimizer has {saved} parameter groups, this run's {len(groups)}: "
                             f"a parameter group with lr_scale != 1 (optimizer.param_groups) puts the embedding "
                             f"tables in a group of their own; resume with one exactly when the checkpoint was "
                             f"written with one")
        scales = [group.get("lr_scale") for group in groups]
        self.optimizer.load_state_dict(state["optimizer"])
        # the run's config decides the scale, as it does the lr (torch made new groups from the saved ones)
        for group, scale in zip(self.optimizer.param_groups, scales):
            if scale is not None:
                group["lr_scale"] = scale

    def local_state_dict(self) -> Dict[str, Any]:
        return {}

    def load_local_state_dict(self, state: Dict[str, Any]) -> None:
        pass

    def load_resharded_state(self, state: Dict[str, Any], shards: Any) -> None:
        """Elastic resume: the replicated ``state`` and this rank's own state from a checkpoint
        written by ``shards.world`` ranks (``core.checkpoint.RankShards``), not this run's number.
        Collective: every rank calls it, after the model's weights are loaded.

        Default: the replicated state as it is (dense AdamW/AdamS: one optimizer state over the
        full model, the same on every rank, so nothing depends on the number of ranks). A
        synchroniser with per-rank state overrides this and says how the old ranks' states
        combine; one that does not is refused here rather than silently losing that state."""
        if self.local_state_dict():
            raise ValueError(f"{type(self).__name__} keeps per-rank state and cannot continue on another "
                             f"number of ranks (the checkpoint was written by {shards.world}); resume with "
                             f"{shards.world} processes")
        self.load_state_dict(state)

    def model_state_dict(self) -> Dict[str, torch.Tensor]:
        """The full model's weights for checkpoints and export (collective for SDP; every rank calls)."""
        return self.model.state_dict()

    def load_model_state_dict(self, state: Dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            self.model.load_state_dict(state)


GradSync = Literal["ddp", "after_backward"]  # optimizer.grad_sync: how the dense arms all-reduce


class DenseAllReduce(GradientSynchronizer):
    """Data parallelism: the mean gradient over all ranks, in one of two ways (``grad_sync``).

    - ``ddp``: torch's DistributedDataParallel, the baseline users run: buckets are all-reduced as
      their gradients become final during the last micro-batch's backward (``no_sync`` on the
      earlier ones), gradients live in DDP's buckets (``gradient_as_bucket_view``). The step's
      forward must go through ``train_module`` (the DDP wrapper), or nothing is reduced.
    - ``after_backward``: one flat all-reduce after the last micro-batch's backward, so that
      communication is timed on its own and compares like for like with SCAPE and SDP.

    Both count their bytes on ``comm`` under ``grad_allreduce`` (DDP through a comm hook) and
    divide the sum by the world size after the all-reduce, so on 2 ranks they agree bit for bit.
    Both take the skip decision in ``step(lr, skip)`` and skip on the device when the optimizer
    takes a ``found_inf`` flag (torch's fused AdamW), so the loop need not read the flag on the host.
    """

    def __init__(self, model: torch.nn.Module, optimizer_factory: Callable[[List[torch.nn.Parameter]],
                 torch.optim.Optimizer], comm: Optional[Collectives] = None,
                 grad_sync: str = "after_backward") -> None:
        check_choice("optimizer.grad_sync", grad_sync, GradSync)
        params = [p for p in model.parameters() if p.requires_grad]
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.grad_sync = grad_sync
        self.ddp: Optional[DistributedDataParallel] = None
        self.flat: Optional[FlatParameters] = None
        if grad_sync == "after_backward":
            self.flat = FlatParameters(params)
        super().__init__(model, optimizer_factory(params), comm)
        self.train_module = model
        self._buckets_reduced = 0
        if grad_sync == "ddp" and self.world > 1:
            # The models' buffers (RoPE tables) are deterministic: no broadcast before each forward
            # (forward_sync_buffers in newer torch, which deprecates broadcast_buffers).
            no_buffer_sync = {"forward_sync_buffers": False} if "forward_sync_buffers" in inspect.signature(
                DistributedDataParallel.__init__).parameters else {"broadcast_buffers": False}
            self.ddp = DistributedDataParallel(model, gradient_as_bucket_view=True, **no_buffer_sync)
            self.ddp.register_comm_hook(self, _counted_allreduce_hook)
            self.train_module = self.ddp

    def zero_grad(self) -> None:
        if self.flat is not None:
            self.flat.zero_grad()
        else:  # DDP's bucket views: zeroed in place, never replaced
            self.optimizer.zero_grad(set_to_none=False)

    def micro_batch_context(self, last: bool) -> ContextManager:
        if self.ddp is not None and not last:
            return self.ddp.no_sync()
        return contextlib.nullcontext()

    def reduce_gradients(self) -> None:
        if self.ddp is not None:  # reduced during backward; DDP waited for its buckets at its end
            if self._buckets_reduced == 0:
                raise RuntimeError("optimizer.grad_sync=ddp: no gradient bucket was all-reduced in this step; the "
                                   "forward must call sync.train_module (the DistributedDataParallel wrapper), "
                                   "not sync.model")
            self._buckets_reduced = 0
            return
        if self.world > 1:
            self.comm.all_reduce(self.flat.grad, kind="grad_allreduce")
            self.flat.grad.div_(self.world)

    takes_skip_flag = True

    @property
    def ranks_reduced_in_backward(self) -> int:
        return self.world if self.ddp is not None else 1

    @property
    def skips_on_device(self) -> bool:
        """The optimizer takes a ``found_inf`` flag (torch's fused AdamW): no host read at all."""
        return bool(self.optimizer.defaults.get("fused"))

    def step(self, lr: float, skip: Optional[torch.Tensor] = None) -> None:
        """The update; ``skip`` (a bool tensor alike on every rank) turns it into a no-op on the
        device for fused optimizers (torch's ``found_inf``, as GradScaler uses it: the step count is
        not advanced either). Otherwise it is read on the host here: one read per step, of a flag
        already reduced, after the reduction and the clip are queued (AdamS keeps its step count on
        the host for the bias correction, so it must know)."""
        if skip is None or not self.skips_on_device:
            if skip is None or not bool(skip):
                super().step(lr)
            return
        self.optimizer.found_inf = skip.to(torch.float32).reshape(())
        try:
            super().step(lr)
        finally:
            del self.optimizer.found_inf


def _counted_allreduce_hook(sync, bucket):
    """DDP's all-reduce of one ``dist.GradBucket`` through ``sync.comm`` (so its bytes are counted),
    summed then divided by the world size like the after-backward mode; returns DDP's future.
    (No annotations: DDP checks them against the classes, and this module's are strings.)"""
    buffer = bucket.buffer()
    sync._buckets_reduced += 1
    work = sync.comm.all_reduce(buffer, kind="grad_allreduce", async_op=True)
    world = sync.world
    return work.get_future().then(lambda fut: fut.value()[0].div_(world))


# A builder takes (run config, device, collectives) and returns the synchroniser; its model is
# ``sync.model``. The run config is duck-typed here: this layer knows no config schema above it.
SynchronizerBuilder = Callable[[Any, torch.device, Collectives], GradientSynchronizer]
_BUILDERS: Dict[str, SynchronizerBuilder] = {}


def register_synchronizer(name: str, builder: SynchronizerBuilder) -> None:
    """Offer a synchroniser under ``name`` (scape/ and sdp/ do this when imported)."""
    _BUILDERS[name] = builder


def synchronizer_builder(name: str) -> SynchronizerBuilder:
    if name not in _BUILDERS:
        raise ValueError(f"no gradient synchroniser named {name!r}; registered: {', '.join(sorted(_BUILDERS))}")
    return _BUILDERS[name]


# SDP runs one synchroniser inside each holder group (sdp/groups.py). A group builder takes (the
# module of the parameters the group holds, the optimizer config, collectives bound to the group)
# and returns a synchroniser whose collectives stay among the group's ranks. Besides the loop's
# calls it offers ``gradient_norm()`` (the norm of its reduced gradient, equal on the group's
# ranks) and ``clip_with_norm(norm, max_norm)`` (clip by the norm over all groups), so that every
# holder of every component clips with one coefficient.
GroupSynchronizerBuilder = Callable[[torch.nn.Module, Any, Collectives], GradientSynchronizer]
_GROUP_BUILDERS: Dict[str, GroupSynchronizerBuilder] = {}


def register_group_synchronizer(name: str, builder: GroupSynchronizerBuilder) -> None:
    """Offer the optimizer ``name`` inside SDP holder groups (scape/ does this when imported)."""
    _GROUP_BUILDERS[name] = builder


def group_synchronizer_builder(name: str) -> GroupSynchronizerBuilder:
    if name not in _GROUP_BUILDERS:
        raise ValueError(f"optimizer={name} cannot run inside SDP holder groups; those that can: "
                         f"{', '.join(sorted(_GROUP_BUILDERS)) or 'none registered'}")
    return _GROUP_BUILDERS[name]
