"""An optimizer that communicates (SCAPE) run inside each SDP holder group.

Plain SDP averages each holder group's gradients with one dense all-reduce per group. Here each
holder group this worker belongs to gets its own synchroniser from core.sync's group registry
(SCAPE registers one: scape/holder_group.py), built over the tensors that group holds and bound
to the group's process group: SCAPE's mask partitions are the group's ranks, its mask all-gather
and its one all-reduce of the masked values stay inside the group. So a worker keeps the
optimizer state (and SCAPE's residual) of its subnetwork only — SDP's memory — and sends SCAPE's
sparse bytes for it.

Shared with plain SDP (sdp/synchronizer.py): the plan, the process groups (created in the same
global order on every rank, so no two ranks wait on different groups), full-model validation,
checkpoint weights and the refresh under backward masking. The clipping norm is the one global
norm: each group's norm counted once (by its lowest rank), summed over the world in one scalar
all-reduce, and handed back to every group, so holders stay identical and C = 1 (one group, the
world) is plain SCAPE, bit for bit (tests/sdp/test_scape_groups.py).

Block SDP only: a neuron-SDP tensor is split between holder groups by rows or columns, and
SCAPE's flat buffer needs whole tensors.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn

from core.comm import Collectives
from core.sync import GradientSynchronizer, GroupSynchronizerBuilder
from sdp.layout import ALWAYS_HELD, ComponentLayout
from sdp.plan import Plan
from sdp.synchronizer import SubnetworkSynchronizer


class _HeldTensors(nn.Module):
    """The tensors one holder group holds, as a module a synchroniser can be built over."""

    def __init__(self, tensors: List[nn.Parameter]) -> None:
        super().__init__()
        self.tensors = nn.ParameterList(tensors)


class _GroupOptimizers:
    """What ``GradientSynchronizer.step`` drives: each group's update at the step's lr."""

    def __init__(self, members: List[Tuple[Tuple[int, ...], GradientSynchronizer]]) -> None:
        self.members = members
        self.param_groups = [{"lr": 0.0}]

    def step(self) -> None:
        for _, member in self.members:
            member.step(self.param_groups[0]["lr"])


class HolderGroupSynchronizer(SubnetworkSynchronizer):
    """SDP whose holder groups each run the synchroniser ``group_builder`` makes (see module doc)."""

    def load_resharded_state(self, state, shards) -> None:
        """Not elastic yet: the optimizer state is cut by the old ranks' partitions (or holder
        groups), which a resume on another number of ranks would have to re-cut; refused here
        rather than loaded wrongly through the parent class's path."""
        raise ValueError(f"SCAPE inside SDP holder groups cannot continue on another number of "
                         f"ranks yet (the checkpoint was written by {shards.world}); resume on "
                         f"{shards.world} ranks, or start from its weights with "
                         f"train.init_from=<checkpoint folder>")

    def __init__(self, model: nn.Module, plan: Plan, layout: ComponentLayout, rank: int, masking: str,
                 group_builder: GroupSynchronizerBuilder, opt_cfg: Any,
                 flop_matched_coverage: Optional[float] = None, comm: Optional[Collectives] = None) -> None:
        if plan.kind != "block":
            raise ValueError(f"optimizer=scape inside SDP holder groups needs sdp.kind=block (got "
                             f"{plan.kind!r}): neuron SDP splits tensors between holder groups and "
                             f"SCAPE's flat buffer needs whole tensors")
        self._group_builder, self._opt_cfg = group_builder, opt_cfg
        self._counter_comm = comm if comm is not None else Collectives()
        super().__init__(model, plan, layout, rank, masking, self._build_members,
                         flop_matched_coverage, self._counter_comm)

    # --- construction (called by SubnetworkSynchronizer.__init__) ------------------------------
    def _create_groups(self) -> Dict[Tuple[int, ...], Optional[dist.ProcessGroup]]:
        """Plain SDP's groups, and one for each single-rank holder set too: its member then runs
        with a world of one (no collective), as a group that holds a component alone should."""
        groups = super()._create_groups()
        if self.world > 1 and dist.is_available() and dist.is_initialized():
            for ranks in self.plan.distinct_holder_sets():
                if len(ranks) == 1:
                    groups[ranks] = dist.new_group(list(ranks))
        return groups

    def _build_buckets(self, held):
        """No dense buckets: every gradient lives in its group member's flat buffer."""
        return []

    def _build_members(self, held: List[nn.Parameter]) -> _GroupOptimizers:
        """One member per holder group this worker is in, in the plan's global order."""
        world = tuple(range(self.world))
        holder_sets = self.plan.holder_sets()
        by_set: Dict[Tuple[int, ...], List[nn.Parameter]] = {}
        for tensor in held:
            name = self._names[id(tensor)]
            (piece,) = self.layout.local_pieces(name, tensor.shape, self.spec)  # block SDP: whole
            ranks = world if piece.component == ALWAYS_HELD else holder_sets[piece.component]
            by_set.setdefault(ranks, []).append(tensor)
        members = []
        for ranks in self.plan.distinct_holder_sets():
            if ranks in by_set:
                comm = self._counter_comm.in_group(self.groups.get(ranks))
                members.append((ranks, self._group_builder(_HeldTensors(by_set[ranks]), self._opt_cfg, comm)))
        self.members = members
        return _GroupOptimizers(members)

    def _held_tensors(self, model: nn.Module):
        held, shadows = super()._held_tensors(model)
        self._names = {id(t): name for name, t in held}
        return held, shadows

    # --- every step --------------------------------------------------------------------------
    def zero_grad(self) -> None:
        for _, member in self.members:
            member.zero_grad()

    def reduce_gradients(self) -> None:
        for _, member in self.members:
            member.reduce_gradients()

    def clip_gradients(self, max_norm: float) -> float:
        """The global norm (each group's counted once, by its lowest rank), one scalar all-reduce."""
        squares = torch.zeros(1, dtype=torch.float64, device=self.device)
        for ranks, member in self.members:
            if ranks[0] == self.rank:
                squares += member.gradient_norm().double().square()
        if self.world > 1 and dist.is_available() and dist.is_initialized():
            self.comm.all_reduce(squares, kind="sdp_norm")
        total = squares.sqrt().float().reshape(())
        for _, member in self.members:
            member.clip_with_norm(total, max_norm)
        return float(total)

    def after_step(self) -> None:
        for _, member in self.members:
            member.after_step()

    # --- what the Trainer asks, and checkpoints ------------------------------------------------
    def metrics(self) -> Dict[str, float]:
        """SDP's, and the members' summed as what they are: densities weighted by the values
        they cover, residual norms combined in quadrature, times added."""
        out = super().metrics()
        merged: Dict[str, List[float]] = {}
        for _, member in self.members:
            for key, value in member.metrics().items():
                merged.setdefault(key, []).append(value)
        weights = [member.layout.padded_numel for _, member in self.members]
        for key, values in merged.items():
            if key == "scape/residual_norm":
                out[key] = float(sum(v * v for v in values)) ** 0.5
            elif key.startswith("scape/time_"):
                out[key] = float(sum(values))
            elif len(values) == len(weights):
                out[key] = float(sum(v * w for v, w in zip(values, weights)) / sum(weights))
        return out

    def state_dict(self) -> Dict[str, Any]:
        """Replicated: the plan only (each group's optimizer state is per group: local_state_dict;
        the parent's moment records are for its one torch optimizer, which this class has not)."""
        return {"sdp_plan": self.plan.to_json()}

    def local_state_dict(self) -> Dict[str, Any]:
        """Each group member's state: replicated within its group but not across the world, so
        every rank writes its own."""
        return {"held": self.plan.held(self.rank), "masking": self.masking,
                "groups": [{"ranks": list(ranks), "state": member.state_dict(),
                            "local": member.local_state_dict()} for ranks, member in self.members]}

    def load_local_state_dict(self, state: Dict[str, Any]) -> None:
        if list(state.get("held", [])) != self.plan.held(self.rank) or state.get("masking") != self.masking \
                or [g["ranks"] for g in state.get("groups", [])] != [list(r) for r, _ in self.members]:
            raise ValueError(f"rank {self.rank}'s checkpointed optimizer state belongs to another "
                             f"subnetwork, masking or optimizer; resume with the run's own sdp and "
                             f"optimizer settings")
        for saved, (_, member) in zip(state["groups"], self.members):
            member.load_state_dict(saved["state"])
            member.load_local_state_dict(saved["local"])
