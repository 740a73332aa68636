"""SCAPE inside SDP holder groups (sdp/groups.py): C = 1 is plain SCAPE; at C = 0.5 holders stay
identical, the state is the subnetwork's, the bytes are SCAPE's per group, and resume is exact."""
from __future__ import annotations

import io

import pytest
import torch

import scape  # noqa: F401 - registers SCAPE as the optimizer inside holder groups
import sdp
from models import build_model
from scape.synchronizer import ScapeSynchronizer
from sdp.config import SDPConfig
from sdp.groups import HolderGroupSynchronizer
from tests.dist_helpers import run_distributed
from tests.sdp._bodies import SEED, assert_holders_identical, full_flat, optimizer_cfg, tiny, train_step
from tests.train_helpers import TINY, check, read_metrics, train_cli, train_losses


def _scape_cfg():
    cfg = optimizer_cfg("scape")
    cfg.sparsity = 0.9
    return cfg


def _build(cfg, sdp_cfg, rank, world):
    torch.manual_seed(SEED)
    return sdp.build_synchronizer(cfg, sdp_cfg, _scape_cfg(), world, rank, torch.device("cpu"))


def _full_coverage_is_plain_scape(rank: int, world: int) -> None:
    cfg = tiny("llama")
    for masking in ("forward", "backward"):
        torch.manual_seed(SEED)
        plain_model = build_model(cfg)
        plain = ScapeSynchronizer(plain_model, _scape_cfg())
        model, sync = _build(cfg, SDPConfig(kind="block", coverage=1.0, masking=masking), rank, world)
        assert isinstance(sync, HolderGroupSynchronizer) and len(sync.members) == 1
        norms = [(train_step(plain_model, plain, cfg, rank, step), train_step(model, sync, cfg, rank, step))
                 for step in range(8)]
        assert any(a > 1.0 for a, _ in norms), "clipping never engaged; the test would not cover it"
        assert all(a == b for a, b in norms), norms
        assert torch.equal(full_flat(cfg, sync.model_state_dict()), full_flat(cfg, plain_model.state_dict())), \
            f"{masking}: SCAPE in one holder group of everyone differs from plain SCAPE"
        old, new = plain.comm.counter.bytes, sync.comm.counter.bytes
        assert new["scape_values"] == old["scape_values"] > 0 and new["scape_mask"] == old["scape_mask"]


def test_full_coverage_equals_plain_scape():
    run_distributed(_full_coverage_is_plain_scape, world_size=2)


def _roundtrip(obj):
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def _half_coverage(rank: int, world: int) -> None:
    cfg = tiny("llama")
    for masking in ("forward", "backward"):
        sdp_cfg = SDPConfig(kind="block", coverage=0.5, masking=masking, strategy="cyclic")
        model, sync = _build(cfg, sdp_cfg, rank, world)
        assert len(sync.members) > 1, "C = 0.5: the world's group and this worker's block groups"
        # the optimizer state and the residual cover what this worker holds, not the full model
        momentum = sum(m.optimizer.momentum.numel() for _, m in sync.members)
        residual = sum(m.residual.numel for _, m in sync.members)
        assert sync.held_numel <= momentum == residual < 0.8 * sync.full_numel
        for step in range(3):
            train_step(model, sync, cfg, rank, step)
            assert_holders_identical(cfg, model, sync, f"{masking} after step {step}")
        counted = sync.comm.counter.bytes
        assert counted["scape_values"] > 0 and counted["scape_mask"] > 0 and "sdp_grad" not in counted
        for ranks, member in sync.members:  # each group's partitions are its own ranks
            assert member.layout.num_partitions == len(ranks) == member.world
        # N -> N resume through the state dicts: the steps of an uninterrupted run, bit for bit
        saved = _roundtrip({"model": sync.model_state_dict(), "replicated": sync.state_dict(),
                            "local": sync.local_state_dict()})
        expected = [train_step(model, sync, cfg, rank, step) for step in range(3, 5)]
        final = full_flat(cfg, sync.model_state_dict())
        torch.manual_seed(99)
        model, sync = sdp.build_synchronizer(cfg, sdp_cfg, _scape_cfg(), world, rank, torch.device("cpu"))
        sync.load_model_state_dict(saved["model"])
        sync.load_state_dict(saved["replicated"])
        sync.load_local_state_dict(saved["local"])
        assert [train_step(model, sync, cfg, rank, step) for step in range(3, 5)] == expected
        assert torch.equal(full_flat(cfg, sync.model_state_dict()), final)


def test_half_coverage_on_4_ranks_keeps_holders_identical_and_resumes_exactly():
    run_distributed(_half_coverage, world_size=4)


def test_neuron_sdp_with_scape_is_refused_naming_the_fix():
    with pytest.raises(ValueError, match="sdp.kind=block"):
        _build(tiny("llama"), SDPConfig(kind="neuron", coverage=1.0), 0, 1)


def test_tiny_bsdp50_scape90_runs_through_train_py_and_resumes_exactly(tmp_path, prepared_cache):
    common = ["+experiment=tiny_bsdp50_scape90", *TINY, f"out_dir={tmp_path}",
              f"data.cache_dir={prepared_cache}", "train.steps=3", "train.ckpt_every=0"]
    check(train_cli([*common, "run_name=combined"], nproc=2))
    check(train_cli([*common, "run_name=split", "train.stop_after_steps=3"], nproc=2))
    check(train_cli([*common, "run_name=split", "resume=auto"], nproc=2))
    run = tmp_path / "combined"
    losses, split = train_losses(run), train_losses(tmp_path / "split")
    assert losses == split, "a resumed run repeats the uninterrupted one's losses exactly"
    assert sorted(losses) == list(range(1, 7)), "flop_matched at C = 0.5 doubles the steps"
    steps = [r for r in read_metrics(run) if "train/loss" in r]
    assert all(r["sdp/params_held_fraction"] < 1.0 for r in steps)
    sparse = [r for r in steps if r["scape/dense_step"] == 0.0]
    assert len(sparse) == 5, "step 1 is dense, then SCAPE's sparse steps in every holder group"
    assert all(r["comm/bytes_scape_values"] > 0 and "comm/bytes_sdp_grad" not in r for r in sparse)
    assert sparse[-1]["scape/density"] < 0.5


def _compose(overrides):
    from tests.train_helpers import compose_config
    from trainer.config import to_config

    cfg = compose_config(overrides)
    to_config(cfg)  # the typed checks of train.py
    return cfg


def _builds_on_4_workers(cfg) -> None:
    """The synchroniser of the config's rank 0 of 4 (one process: each group a world of one)."""
    torch.manual_seed(SEED)
    _, sync = sdp.build_synchronizer(cfg.model, cfg.sdp, cfg.optimizer, 4, 0, torch.device("cpu"))
    assert isinstance(sync, HolderGroupSynchronizer) and len(sync.members) > 1
    assert sync.held_numel < sync.full_numel


TINY_SHAPES = ["model.n_layer=4", "model.d_model=32", "model.n_head=4", "model.n_kv_head=2",
               "model.ffn_hidden=64", "model.vocab_size=128", "model.seq_len=16"]


@pytest.mark.parametrize("experiment", ["llama500m_bsdp50_scape90", "tiny_bsdp50_scape90"])
def test_combined_experiments_compose_and_build_on_tiny_shapes(experiment):
    cfg = _compose([f"+experiment={experiment}", *TINY_SHAPES])
    got = (cfg.optimizer.name, cfg.optimizer.sparsity, cfg.sdp.kind, cfg.sdp.coverage)
    assert got == ("scape", 0.9, "block", 0.5)
    _builds_on_4_workers(cfg)


def test_study_arm_bsdp50_scape90_parses_and_builds(tmp_path):
    from tests.train_helpers import REPO, load_script

    study = load_script("study_quality")
    args = study.parse_args(["--arms", "bsdp50_scape90", "--corpus", "embedded"])
    assert args.arm_names == ["bsdp50_scape90"]
    assert "bsdp50_scape90" in [n for n, a in study.ARMS.items() if a.in_all]
    command = study.arm_command(study.ARMS["bsdp50_scape90"], args, tmp_path / "bsdp50_scape90")
    overrides = command[command.index(str(REPO / "train.py")) + 1:]
    overrides = [o for o in overrides if not o.startswith(("out_dir=", "run_name="))]
    cfg = _compose([*overrides, *TINY_SHAPES])
    assert (cfg.optimizer.name, cfg.optimizer.sparsity, cfg.sdp.kind, cfg.sdp.coverage, cfg.sdp.masking) == \
        ("scape", 0.9, "block", 0.5, "forward")
    _builds_on_4_workers(cfg)
