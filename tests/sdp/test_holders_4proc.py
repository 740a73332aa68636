"""SDP on 4 gloo processes at C = 0.5: what each worker allocates, and that holders agree.

One spawn covers every masking and granularity: starting 4 ranks costs more here than the
checks themselves.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from models import count_parameters
from sdp.config import SDPConfig
from sdp.plan import make_plan, report
from tests.dist_helpers import run_distributed
from tests.sdp._bodies import all_gather_rows, assert_holders_identical, build_sdp, full_flat, tiny, train_step


def _forward_masking(rank: int, world: int) -> None:
    for family, kind in [("llama", "block"), ("llama", "neuron"), ("gpt", "neuron")]:
        cfg = tiny(family)
        sdp_cfg = SDPConfig(kind=kind, coverage=0.5, groups_per_block=4, strategy="cyclic")
        model, sync = build_sdp(cfg, sdp_cfg, rank, world)
        # a forward-masked worker allocates exactly its share of the parameters
        share = report(make_plan(cfg, sdp_cfg, world), cfg)["params_per_worker"]
        allocated = count_parameters(model)
        assert allocated == share["max"] == share["min"], (allocated, share)
        assert allocated < 0.8 * sync.full_numel
        assert sync.held_numel == allocated
        if kind == "block":
            assert sorted(int(b) for b in model.blocks.keys()) == sync.spec.held_blocks(cfg.n_layer)
            assert len(model.blocks) == 2
        assert_holders_identical(cfg, model, sync, f"{family} {kind} at init")
        for step in range(3):
            train_step(model, sync, cfg, rank, step)
            assert_holders_identical(cfg, model, sync, f"{family} {kind} after step {step}")
        # validation runs the full model: equal on every rank, and equal to the gathered weights
        validation = sync.validation_model()
        x = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len), generator=torch.Generator().manual_seed(5))
        val_loss = validation(x[:, :-1], x[:, 1:]).reshape(1)
        losses = all_gather_rows(val_loss)
        assert torch.equal(losses, losses[:1].expand_as(losses)), losses
        own_loss = model(x[:, :-1], x[:, 1:]).detach().reshape(1)
        assert not torch.equal(own_loss, val_loss), "validation did not use the full model"
        assert sync.metrics()["sdp/params_held_fraction"] < 0.8


def _backward_masking(rank: int, world: int) -> None:
    for kind in ["block", "neuron"]:
        cfg = tiny()
        model, sync = build_sdp(cfg, SDPConfig(kind=kind, coverage=0.5, masking="backward", groups_per_block=4),
                                rank, world, "adams")
        assert count_parameters(model) == sync.full_numel  # the full forward
        state_numel = sum(s["exp_avg"].numel() for s in sync.optimizer.state.values()) if sync.optimizer.state else 0
        assert state_numel == 0
        before = full_flat(cfg, model.state_dict())
        for step in range(3):
            train_step(model, sync, cfg, rank, step)
            rows = all_gather_rows(full_flat(cfg, model.state_dict()))
            assert torch.equal(rows, rows[:1].expand_as(rows)), \
                f"{kind}: workers' full parameters differ after step {step}"
        assert not torch.equal(rows[0], before), "nothing was trained"
        # optimizer state only for held parameters
        state_numel = sum(s["exp_avg"].numel() for s in sync.optimizer.state.values())
        assert state_numel == sync.held_numel < sync.full_numel


def _all(rank: int, world: int) -> None:
    _forward_masking(rank, world)
    _backward_masking(rank, world)
    dist.barrier()


def test_forward_and_backward_masking_on_4_workers():
    run_distributed(_all, world_size=4)
