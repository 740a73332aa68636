"""Holder-set aggregation: the SDP implementation of the trainer's gradient-sync seam.

Every step, each component's gradient is averaged over the workers that hold it (its holder
set), and the always-held tensors over the whole world. Masks are fixed, so everything that
depends on them is decided once here: one process group per distinct holder set, one flat
bucket per holder set this worker belongs to, one all-reduce per bucket.

Gradients of tensors that belong wholly to one holder set are views into that set's bucket (no
copy, as DDP's flat buffer); tensors split between holder sets (N-SDP: rows/columns of head and
unit groups) are copied in and out around the collective.

Holders stay identical because they start from the same seed, average the same gradients and
clip with one coefficient: the global norm counts every component once (from the lowest-rank
holder of each holder set) and is summed over the world in one scalar all-reduce.

Backward masking (Bb-/Nb-SDP) runs the full model forward; gradients are kept only for held
tensors (unheld blocks are frozen; a partly held tensor's held rows live in a "shadow" parameter
that alone has optimizer state), and after each step every component not held by everyone is
broadcast from one of its holders, so the next forward sees the whole updated model. The same
broadcast gathers the full model for checkpoints and validation under forward masking.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn

from core.comm import Collectives
from core.sync import GradientSynchronizer, distinct_numel
from models.subnet import scatter_state_dict, slice_state_dict
from sdp.layout import ALWAYS_HELD, ComponentLayout, FullEntry, LocalPiece, meta_full_model
from sdp.plan import Plan


@dataclass
class _BucketPiece:
    tensor: torch.Tensor  # the held tensor whose .grad this piece reads and writes
    piece: LocalPiece
    offset: int


@dataclass
class _Bucket:
    ranks: Tuple[int, ...]
    group: Optional[dist.ProcessGroup]
    pieces: List[_BucketPiece]
    buffer: torch.Tensor  # flat fp32 gradients of everything this holder set shares

    @property
    def reduces(self) -> bool:
        return len(self.ranks) > 1


@dataclass
class _Shadow:
    """Backward masking: the held rows/columns of a partly held full tensor, as the optimizer sees them."""

    full: nn.Parameter
    dim: int
    indices: torch.Tensor
    held: nn.Parameter


class _ValidationModel(nn.Module):
    """The full model, gathered on first use after each optimizer step (forward masking).

    The loop asks for its validation model once, before training; this stand-in follows the
    training weights by re-gathering after every step and frees the full copy when the next step
    changes them, so outside validation a worker holds only its subnetwork.
    """

    def __init__(self, gather: Callable[[], nn.Module]) -> None:
        super().__init__()
        self._gather = gather  # a plain attribute: the full model's parameters are not registered here

    def forward(self, idx: torch.Tensor, targets: Optional[torch.Tensor] = None) -> torch.Tensor:
        model = self._gather()
        model.train(self.training)
        with torch.no_grad():
            return model(idx, targets)


def _scattered_moments(cfg, old_plan, local: Dict[str, Any], keys: List[str],
                       like: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """One old worker's moments (and a count of 1) scattered into full-model tensors where its
    subnetwork sits; zeros elsewhere."""
    from models.subnet import parameter_slices

    if "param_names" not in local or "rank" not in local:
        raise ValueError("a rank's checkpoint file holds no SDP parameter names; it was written "
                         "before elastic resume existed: resume it with its own number of ranks")
    slices = parameter_slices(cfg, old_plan.subnet_spec(int(local["rank"])))
    out = {k: torch.zeros(t.shape) for k, t in like.items()}
    for index, name in enumerate(local["param_names"]):
        entry = local["optimizer"]["state"].get(index)
        if not entry:
            continue
        for key in keys + ["count"]:
            value = torch.ones_like(entry[keys[0]]) if key == "count" else entry[key]
            target = out[f"{key}/{name}"]
            if name in slices:
                dim, indices = slices[name]
                target.index_copy_(dim, indices, value.float())
            else:
                target.copy_(value)
    return out


class SubnetworkSynchronizer(GradientSynchronizer):
    """Holder-set all-reduces, one clip coefficient for all, and (backward masking) the refresh."""

    def __init__(self, model: nn.Module, plan: Plan, layout: ComponentLayout, rank: int,
                 masking: str, optimizer_factory: Callable[[List[nn.Parameter]], torch.optim.Optimizer],
                 flop_matched_coverage: Optional[float] = None, comm: Optional[Collectives] = None) -> None:
        self.plan, self.layout, self.rank, self.masking = plan, layout, rank, masking
        self.flop_matched_coverage = flop_matched_coverage  # sdp.coverage when sdp.flop_matched
        self.world = plan.workers
        self.cfg = layout.cfg
        self.spec = plan.subnet_spec(rank)
        self.full_numel = layout.full_numel
        self.device = next(model.parameters()).device
        self._version = 0
        self._validation: Optional[Tuple[int, nn.Module]] = None

        held, self.shadows = self._held_tensors(model)
        self._held = held  # (full-model name, tensor the optimizer steps), for checkpoints
        self.groups = self._create_groups()
        self.buckets = self._build_buckets(held)
        viewed = {id(bp.tensor) for b in self.buckets for bp in b.pieces if bp.piece.dim is None}
        self._own_grads = [t for _, t in held if id(t) not in viewed]
        for t in self._own_grads:
            t.grad = torch.zeros_like(t)
        for s in self.shadows:
            s.full.grad = torch.zeros_like(s.full)
        self.held_numel = sum(t.numel() for _, t in held)
        self._refresh_by_source = self._refresh_plan()
        super().__init__(model, optimizer_factory([t for _, t in held]), comm)
        self.params = [t for _, t in held]

    # ------------------------------------------------------------------ construction

    def _held_tensors(self, model: nn.Module) -> Tuple[List[Tuple[str, nn.Parameter]], List[_Shadow]]:
        if self.masking == "forward":
            return [(n, p) for n, p in model.named_parameters()], []
        from models.subnet import parameter_slices

        slices = parameter_slices(self.cfg, self.spec)
        held_blocks = set(self.spec.held_blocks(self.cfg.n_layer))
        held, shadows = [], []
        for name, p in model.named_parameters():
            block = int(name.split(".", 2)[1]) if name.startswith("blocks.") else None
            if block is not None and block not in held_blocks:
                p.requires_grad_(False)  # unheld block: gradients flow through it, none for it
                continue
            if name in slices:
                dim, indices = slices[name]
                indices = indices.to(p.device)
                if indices.numel() == 0:
                    p.requires_grad_(False)
                    continue
                shadow = nn.Parameter(p.detach().index_select(dim, indices).clone())
                shadows.append(_Shadow(p, dim, indices, shadow))
                held.append((name, shadow))
            else:
                held.append((name, p))
        return held, shadows

    def _create_groups(self) -> Dict[Tuple[int, ...], Optional[dist.ProcessGroup]]:
        """One process group per distinct holder set; every rank creates all, in the same order."""
        groups: Dict[Tuple[int, ...], Optional[dist.ProcessGroup]] = {}
        distributed = dist.is_available() and dist.is_initialized() and self.world > 1
        for ranks in self.plan.distinct_holder_sets():
            if len(ranks) == self.world or len(ranks) < 2 or not distributed:
                groups[ranks] = None  # the world's default group, or no collective at all
            else:
                groups[ranks] = dist.new_group(list(ranks))
        return groups

    def _build_buckets(self, held: List[Tuple[str, nn.Parameter]]) -> List[_Bucket]:
        world = tuple(range(self.world))
        holder_sets = self.plan.holder_sets()
        by_set: Dict[Tuple[int, ...], List[Tuple[nn.Parameter, LocalPiece]]] = {}
        for name, tensor in held:
            pieces = self.layout.local_pieces(name, tensor.shape, self.spec)
            per_set: Dict[Tuple[int, ...], List[LocalPiece]] = {}
            for piece in pieces:
                ranks = world if piece.component == ALWAYS_HELD else holder_sets[piece.component]
                if self.rank not in ranks:
                    raise RuntimeError(f"rank {self.rank} holds {name} of component {piece.component} "
                                       f"but the plan says only ranks {ranks} do")
                per_set.setdefault(ranks, []).append(piece)
            for ranks, same in per_set.items():  # components that share a holder set share a piece
                if len(same) == len(pieces):
                    merged = LocalPiece(same[0].component, None, None, tensor.numel())
                else:
                    positions = torch.cat([p.positions for p in same]).sort().values.to(self.device)
                    merged = LocalPiece(same[0].component, same[0].dim, positions, sum(p.numel for p in same))
                by_set.setdefault(ranks, []).append((tensor, merged))
        buckets = []
        for ranks in self.plan.distinct_holder_sets():  # the global order: no deadlock across groups
            if ranks not in by_set:
                continue
            entries = by_set[ranks]
            total = sum(p.numel for _, p in entries)
            buffer = torch.zeros(total, dtype=torch.float32, device=self.device)
            pieces, offset = [], 0
            for tensor, piece in entries:
                if piece.dim is None:  # the whole tensor: its gradient is a view of the bucket
                    tensor.grad = buffer[offset:offset + piece.numel].view_as(tensor)
                pieces.append(_BucketPiece(tensor, piece, offset))
                offset += piece.numel
            buckets.append(_Bucket(ranks, self.groups.get(ranks), pieces, buffer))
        return buckets

    def _refresh_plan(self) -> List[Tuple[int, List[FullEntry]]]:
        """Per source rank, the full-model parts it broadcasts: every component not held by all.

        The source of component j is the (j mod |H_j|)-th holder, which spreads the sending
        over holders; every rank computes the same list from the plan.
        """
        by_source: Dict[int, List[FullEntry]] = {}
        for j, ranks in enumerate(self.plan.holder_sets()):
            if len(ranks) == self.world:
                continue
            source = ranks[j % len(ranks)]
            by_source.setdefault(source, []).extend(
                FullEntry(e.name, e.dim, None if e.indices is None else e.indices.to(self.device))
                for e in self.layout.full_entries(j))
        return sorted(by_source.items())

    # ------------------------------------------------------------------ every step

    def zero_grad(self) -> None:
        for bucket in self.buckets:
            bucket.buffer.zero_()
        for t in self._own_grads:
            t.grad.zero_()
        for s in self.shadows:
            s.full.grad.zero_()

    def reduce_gradients(self) -> None:
        for s in self.shadows:
            s.held.grad.copy_(s.full.grad.index_select(s.dim, s.indices))
        for bucket in self.buckets:
            if not bucket.reduces:
                continue
            self._pack(bucket)
            self.comm.all_reduce(bucket.buffer, kind="sdp_grad", group=bucket.group)
            bucket.buffer.div_(len(bucket.ranks))
            self._unpack(bucket)

    @staticmethod
    def _pack(bucket: _Bucket) -> None:
        for bp in bucket.pieces:
            if bp.piece.dim is not None:
                part = bp.tensor.grad.index_select(bp.piece.dim, bp.piece.positions)
                bucket.buffer[bp.offset:bp.offset + bp.piece.numel].copy_(part.reshape(-1))

    @staticmethod
    def _unpack(bucket: _Bucket) -> None:
        for bp in bucket.pieces:
            if bp.piece.dim is not None:
                shape = list(bp.tensor.shape)
                shape[bp.piece.dim] = len(bp.piece.positions)
                part = bucket.buffer[bp.offset:bp.offset + bp.piece.numel].view(shape)
                bp.tensor.grad.index_copy_(bp.piece.dim, bp.piece.positions, part)

    def clip_gradients(self, max_norm: float) -> float:
        """One global norm, each component counted once, so every holder clips alike.

        The local part is torch's own total norm (as ``clip_grad_norm_`` computes it), squared
        exactly in fp64 and summed over ranks, and the scaling is torch's, so with C = 1 (one rank
        speaks for the whole world) norm and coefficient are DDP's bit for bit.
        """
        parts = []
        for bucket in self.buckets:
            if bucket.ranks[0] != self.rank:  # the lowest-rank holder speaks for the set
                continue
            for bp in bucket.pieces:
                if bp.piece.dim is None:
                    parts.append(bp.tensor.grad)
                elif bucket.reduces:  # packed: the reduced values sit in the bucket
                    parts.append(bucket.buffer[bp.offset:bp.offset + bp.piece.numel])
                else:
                    parts.append(bp.tensor.grad.index_select(bp.piece.dim, bp.piece.positions))
        local = torch.nn.utils.get_total_norm(parts) if parts else torch.zeros((), device=self.device)
        squares = local.double().square().reshape(1)
        if self.world > 1 and dist.is_available() and dist.is_initialized():
            self.comm.all_reduce(squares, kind="sdp_norm")
        total = squares.sqrt().float().reshape(())
        if max_norm > 0:
            torch.nn.utils.clip_grads_with_norm_(self.params, max_norm, total)
        return float(total)

    def step(self, lr: float) -> None:
        super().step(lr)
        self._version += 1
        self._validation = None  # the full copy is stale: free it until validation asks again
        if self.masking == "backward":
            with torch.no_grad():
                for s in self.shadows:
                    s.full.index_copy_(s.dim, s.indices, s.held)
                self._refresh(dict(self.model.named_parameters()))

    # ------------------------------------------------------------------ the full model

    @torch.no_grad()
    def _refresh(self, full: Dict[str, torch.Tensor]) -> None:
        """Fill every component not held by all from its source: one broadcast per source rank."""
        if self.world < 2 or not (dist.is_available() and dist.is_initialized()):
            return
        for source, entries in self._refresh_by_source:
            sizes = [self._entry_numel(full[e.name], e) for e in entries]
            buffer = torch.empty(sum(sizes), dtype=torch.float32, device=self.device)
            offset = 0
            if self.rank == source:
                for e, n in zip(entries, sizes):
                    part = full[e.name] if e.dim is None else full[e.name].index_select(e.dim, e.indices)
                    buffer[offset:offset + n].copy_(part.reshape(-1))
                    offset += n
            self.comm.broadcast(buffer, src=source, kind="sdp_refresh")
            if self.rank != source:
                for e, n in zip(entries, sizes):
                    target = full[e.name]
                    if e.dim is None:
                        target.copy_(buffer[offset:offset + n].view_as(target))
                    else:
                        shape = list(target.shape)
                        shape[e.dim] = len(e.indices)
                        target.index_copy_(e.dim, e.indices, buffer[offset:offset + n].view(shape))
                    offset += n

    @staticmethod
    def _entry_numel(tensor: torch.Tensor, entry: FullEntry) -> int:
        if entry.dim is None:
            return tensor.numel()
        return tensor.numel() // tensor.shape[entry.dim] * len(entry.indices)

    def _gather_full_model(self) -> nn.Module:
        """The full model with the current weights, on every rank (collective)."""
        if self.masking == "backward":
            return self.model
        if self._validation is not None and self._validation[0] == self._version:
            return self._validation[1]
        self._validation = None
        full = meta_full_model(self.cfg).to_empty(device=self.device)
        with torch.no_grad():
            full_sd = dict(full.state_dict(keep_vars=True))
            scatter_state_dict({n: t.detach() for n, t in self.model.state_dict().items()},
                               {n: t.data for n, t in full_sd.items()}, self.cfg, self.spec)
            self._refresh({n: t.data for n, t in full_sd.items()})
        full.requires_grad_(False)
        self._validation = (self._version, full)
        return full

    def validation_model(self, train_model: Optional[nn.Module] = None) -> nn.Module:
        """The model validation loss is computed with: always the full model (all components)."""
        if self.masking == "backward":
            return self.model
        return _ValidationModel(self._gather_full_model)

    # ------------------------------------------------------------------ what the Trainer asks

    def parameter_counts(self) -> Tuple[int, int]:
        return distinct_numel(self.model), self.full_numel

    def compute_spec(self):
        """A forward-masked worker computes only its subnetwork; under backward masking, all of it."""
        return self.spec if self.masking == "forward" else None

    def step_budget(self, train_steps: int) -> int:
        """With ``sdp.flop_matched`` the paper's budget, steps / C (rounded)."""
        if self.flop_matched_coverage is None:
            return int(train_steps)
        return int(round(train_steps / float(self.flop_matched_coverage)))

    def model_state_dict(self) -> Dict[str, torch.Tensor]:
        """The full model's weights, each component from one holder (collective: every rank calls)."""
        if self.masking == "backward":
            return {n: t.detach() for n, t in self.model.state_dict().items()}
        full = self._gather_full_model()
        state = {n: t.detach() for n, t in full.state_dict().items()}
        self._validation = None  # do not keep a full copy alive between checkpoints
        return state

    def load_model_state_dict(self, state: Dict[str, torch.Tensor]) -> None:
        """Load a full model's weights: re-sliced to this worker's subnetwork (forward masking)."""
        missing = sorted(set(self.layout.full_shapes) - set(state))
        if missing:
            raise KeyError(f"the checkpoint lacks {len(missing)} tensors of the full model, e.g. {missing[:3]}")
        with torch.no_grad():
            if self.masking == "forward":
                self.model.load_state_dict(slice_state_dict(state, self.cfg, self.spec))
            else:
                self.model.load_state_dict(state)
                for s in self.shadows:
                    s.held.copy_(s.full.index_select(s.dim, s.indices))
        self._version += 1
        self._validation = None

    # ------------------------------------------------------------------ checkpoint state

    def state_dict(self) -> Dict[str, Any]:
        """Replicated: the plan, and which optimizer-state entries are per-element moments and
        which scalars (the same on every worker: every held tensor steps every step), for an
        elastic resume (the optimizer state itself differs between workers: local_state_dict)."""
        state: Dict[str, Any] = {"sdp_plan": self.plan.to_json()}
        first = next((self.optimizer.state[p] for p in self.params if self.optimizer.state.get(p)), None)
        if first is not None:
            state["moment_keys"] = sorted(k for k, v in first.items() if torch.is_tensor(v) and v.dim() > 0)
            state["scalars"] = {k: v.detach().cpu().clone() if torch.is_tensor(v) else v
                                for k, v in first.items() if not (torch.is_tensor(v) and v.dim() > 0)}
        return state

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        saved = state.get("sdp_plan")
        if saved is not None and (saved["assignment"] != self.plan.to_json()["assignment"]
                                  or saved["kind"] != self.plan.kind):
            raise ValueError("the checkpoint was written under another SDP plan (sdp.kind, coverage, "
                             "strategy, seed, workers or plan_path differ): resume with the run's own "
                             "sdp settings, or start a new run from its model weights")

    def _param_names(self) -> List[str]:
        """The full-model name of every optimizer parameter, in the optimizer's state-dict order."""
        names = {id(t): n for n, t in self._held}
        return [names[id(p)] for group in self.optimizer.param_groups for p in group["params"]]

    def local_state_dict(self) -> Dict[str, Any]:
        return {"optimizer": self.optimizer.state_dict(), "held": self.plan.held(self.rank),
                "masking": self.masking, "rank": self.rank, "param_names": self._param_names()}

    def load_local_state_dict(self, state: Dict[str, Any]) -> None:
        if not state:
            return
        if list(state.get("held", [])) != self.plan.held(self.rank) or state.get("masking") != self.masking:
            raise ValueError(f"rank {self.rank}'s checkpointed optimizer state belongs to another "
                             f"subnetwork or masking; resume with the run's own sdp settings")
        self.optimizer.load_state_dict(state["optimizer"])

    @torch.no_grad()
    def load_resharded_state(self, state: Dict[str, Any], shards: Any) -> None:
        """Elastic resume: the plan is this run's (made for its number of workers); the full model
        was re-sliced by ``load_model_state_dict``; the optimizer state is re-sliced the same way.

        Each old worker's moments are scattered into full-model tensors where its subnetwork
        sits (with a count of 1 there); ``shards.mean`` adds them over the old workers and the
        count divides them out: every element gets the mean over its old holders, which all held
        the same value (holders average the same gradients). Each new worker then slices its
        own held tensors out, as it sliced the weights. Collective (one all-reduce)."""
        from sdp.plan import Plan

        saved = state.get("sdp_plan")
        if saved is None or saved.get("kind") != self.plan.kind:
            raise ValueError(f"the checkpoint was not written under sdp.kind={self.plan.kind}; resume with "
                             f"the run's own sdp settings, or start a new run from its model weights")
        old_plan = Plan.from_json(saved, self.cfg)  # refuses a plan for another model
        if "moment_keys" not in state:
            self.load_state_dict({})  # written before the first step: no optimizer state yet
            return
        keys, scalars = list(state["moment_keys"]), state["scalars"]
        shapes = self.layout.full_shapes
        like = {f"{key}/{name}": torch.empty(shapes[name]) for key in keys + ["count"] for name in shapes}
        total = shards.mean(lambda local: _scattered_moments(self.cfg, old_plan, local, keys, like), like,
                            self.comm, self.rank, self.world, self.device)
        saved_sd = self.optimizer.state_dict()
        saved_sd["state"] = self._held_moments(total, keys, scalars)
        self.optimizer.load_state_dict(saved_sd)

    def _held_moments(self, total: Dict[str, torch.Tensor], keys: List[str],
                      scalars: Dict[str, Any]) -> Dict[int, Dict[str, Any]]:
        """This worker's optimizer state, sliced out of the old workers' means ``total``."""
        from models.subnet import parameter_slices

        slices = parameter_slices(self.cfg, self.spec)
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        new_state: Dict[int, Dict[str, Any]] = {}
        for index, (name, param) in enumerate(zip(self._param_names(), params)):
            entry = {k: v.clone() if torch.is_tensor(v) else v for k, v in scalars.items()}
            count = total[f"count/{name}"]
            for key in keys:
                # both are means over the old workers: their ratio is the mean over the holders
                # (an element no old worker held has count 0 and total 0, and stays 0)
                full = total[f"{key}/{name}"].div_(count.clamp(min=torch.finfo(count.dtype).tiny))
                if name in slices:
                    dim, indices = slices[name]
                    full = full.index_select(dim, indices.to(full.device))
                if full.shape != param.shape:
                    raise ValueError(f"re-sliced SDP optimizer state for {name} has shape {tuple(full.shape)}, "
                                     f"the held tensor {tuple(param.shape)}")
                entry[key] = full.to(param.device, param.dtype).clone()
            new_state[index] = entry
        return new_state

    def metrics(self) -> Dict[str, float]:
        return {"sdp/coverage": float(self.plan.coverage),
                "sdp/params_held": float(self.held_numel),
                "sdp/params_held_fraction": self.held_numel / self.full_numel,
                "sdp/buckets": float(len(self.buckets))}
