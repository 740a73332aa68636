"""The worker-mask planner: coverage, balance, spectral gap, validation errors, report, CLI."""
from __future__ import annotations

import json

import numpy as np
import pytest

import sdp
from models import build_model, count_parameters, load_model_config
from models.subnet import SubnetSpec
from sdp.config import SDPConfig
from sdp.layout import skip_meta_init
from sdp.plan import (Plan, cyclic_assignment, enumerate_components, make_plan, report,
                      spectral_gap, total_params)


def main(argv):
    """The planner's CLI, scripts/plan_sdp.py."""
    from tests.train_helpers import load_script

    return load_script("plan_sdp").main(argv)


def _tiny():
    return load_model_config("tiny_llama")


@pytest.mark.parametrize("kind", ["block", "neuron"])
@pytest.mark.parametrize("strategy", ["cyclic", "random"])
@pytest.mark.parametrize("workers,coverage", [(4, 0.5), (8, 0.25), (3, 0.75), (5, 0.5)])
def test_plan_covers_every_component_and_is_balanced(kind, strategy, workers, coverage):
    plan = make_plan(_tiny(), SDPConfig(kind=kind, coverage=coverage, strategy=strategy, workers=workers,
                                        groups_per_block=4))
    a = plan.assignment
    assert a.shape == (workers, len(plan.components))
    holders = a.sum(axis=0)
    assert holders.min() >= 1, "a component without a holder"
    per_worker = a.sum(axis=1)
    assert per_worker.max() == per_worker.min(), "workers hold different numbers of components"
    # balance within each family of interchangeable components: holder counts differ by <= 1
    for block in range(_tiny().n_layer) if kind == "neuron" else [None]:
        for ckind in (["heads", "mlp"] if kind == "neuron" else ["block"]):
            cols = [c.index for c in plan.components if c.kind == ckind and (block is None or c.block == block)]
            assert holders[cols].max() - holders[cols].min() <= 1


def test_cyclic_matches_the_spec_formula():
    a = cyclic_assignment(4, 8, 0.5)
    for i in range(4):
        expected = {(i * 8 // 4 + t) % 8 for t in range(4)}
        assert set(np.flatnonzero(a[i])) == expected


def test_neuron_plan_holds_a_share_of_every_block():
    cfg = _tiny()  # 4 heads in 2 kv groups, 768 units
    plan = make_plan(cfg, SDPConfig(kind="neuron", coverage=0.5, workers=4, groups_per_block=4))
    for rank in range(4):
        spec = plan.subnet_spec(rank)
        for layer in range(cfg.n_layer):
            assert len(spec.heads[layer]) == 2  # one of the two kv groups, both its query heads
            assert len(spec.mlp_units[layer]) == 384


def test_random_plan_is_seeded():
    cfg = SDPConfig(kind="block", coverage=0.5, strategy="random", workers=6, seed=3)
    model = load_model_config("llama500m")
    assert (make_plan(model, cfg).assignment == make_plan(model, cfg).assignment).all()
    other = SDPConfig(kind="block", coverage=0.5, strategy="random", workers=6, seed=4)
    assert not (make_plan(model, cfg).assignment == make_plan(model, other).assignment).all()


def test_spectral_gap_is_zero_exactly_for_disconnected_workers():
    disconnected = np.array([[1, 1, 0, 0], [1, 1, 0, 0], [0, 0, 1, 1], [0, 0, 1, 1]], dtype=bool)
    assert spectral_gap(disconnected) == 0.0
    ring = cyclic_assignment(4, 4, 0.5)  # worker i holds i, i+1: a connected ring
    assert spectral_gap(ring) > 0.1
    assert spectral_gap(np.ones((4, 4), dtype=bool)) == pytest.approx(1.0)  # complete graph
    # the report says so for a real plan: 2 workers at C = 0.5 share no block
    plan = make_plan(_tiny(), SDPConfig(kind="block", coverage=0.5, workers=2))
    assert report(plan, _tiny())["spectral_gap"] == 0.0


def test_component_parameter_counts_match_the_model_factory():
    with skip_meta_init():
        _check_component_parameter_counts()


def _check_component_parameter_counts():
    for name in ("tiny_llama", "tiny_gpt"):
        cfg = load_model_config(name)
        full = count_parameters(build_model(cfg, device="meta"))
        assert total_params(cfg) == full
        for comp in enumerate_components(cfg, "neuron", 2)[:4]:
            # the full model minus this component's heads/units
            if comp.kind == "heads":
                spec = SubnetSpec(heads={comp.block: [h for h in range(cfg.n_head) if h not in comp.members]})
            else:
                units = cfg.ffn_hidden or 4 * cfg.d_model
                spec = SubnetSpec(mlp_units={comp.block: [u for u in range(units) if u not in comp.members]})
            assert full - count_parameters(build_model(cfg, spec, device="meta")) == comp.n_params
        block = enumerate_components(cfg, "block")[0]
        without = count_parameters(build_model(cfg, SubnetSpec(blocks=list(range(1, cfg.n_layer))), device="meta"))
        assert full - without == block.n_params


def test_report_against_ddp():
    cfg = load_model_config("llama500m")
    plan = make_plan(cfg, SDPConfig(kind="block", coverage=0.5, workers=32))
    rep = report(plan, cfg, optimizer="adams")
    with skip_meta_init():
        full_count = count_parameters(build_model(cfg, device="meta"))
    assert rep["holders_per_component"] == {"min": 16.0, "mean": 16.0, "max": 16.0}
    assert rep["params_total"] == full_count
    held = rep["params_always_held"] + 12 * plan.components[0].n_params
    assert rep["params_per_worker"]["max"] == held
    assert 0.5 < rep["memory_estimate_bytes"]["ratio_vs_ddp"] < 0.65
    assert 0.5 < rep["allreduce_bytes_per_step"]["ratio_vs_ddp"] < 0.65
    assert rep["spectral_gap"] > 0
    full = report(make_plan(cfg, SDPConfig(kind="block", coverage=1.0, workers=32)), cfg)
    assert full["allreduce_bytes_per_step"]["ratio_vs_ddp"] == pytest.approx(1.0)
    assert full["memory_estimate_bytes"]["ratio_vs_ddp"] == pytest.approx(1.0)


@pytest.mark.parametrize("coverage", [0.0, -0.5, 1.5])
def test_coverage_outside_unit_interval_is_rejected(coverage):
    with pytest.raises(ValueError, match=r"sdp\.coverage must lie in \(0, 1\]"):
        make_plan(_tiny(), SDPConfig(kind="block", coverage=coverage, workers=4))


def test_component_without_holder_is_rejected():
    # 2 workers x round(0.25 * 4) = 1 block each cover only 2 of 4 blocks
    with pytest.raises(ValueError, match=r"have no holder \(block\d.*raise sdp.coverage"):
        make_plan(_tiny(), SDPConfig(kind="block", coverage=0.25, workers=2))
    plan = make_plan(_tiny(), SDPConfig(kind="block", coverage=0.5, workers=4))
    plan.assignment[:, 3] = False  # an edited plan file
    with pytest.raises(ValueError, match="block3"):
        plan.validate(4)


def test_plan_that_does_not_match_the_world_size_is_rejected(tmp_path):
    with pytest.raises(ValueError, match=r"sdp.workers=8 does not match the world size 4"):
        make_plan(_tiny(), SDPConfig(kind="block", coverage=0.5, workers=8), world_size=4)
    path = tmp_path / "plan.json"
    plan = make_plan(_tiny(), SDPConfig(kind="block", coverage=0.5, workers=8))
    path.write_text(json.dumps(plan.to_json()))
    with pytest.raises(ValueError, match=r"has 8 workers but the world size is 4.*launch 8 ranks"):
        make_plan(_tiny(), SDPConfig(kind="block", coverage=0.5, plan_path=str(path)), world_size=4)
    loaded = make_plan(_tiny(), SDPConfig(kind="block", coverage=0.5, plan_path=str(path)), world_size=8)
    assert (loaded.assignment == plan.assignment).all()
    with pytest.raises(ValueError, match="do not match model"):
        Plan.from_json(plan.to_json(), load_model_config("llama500m"))


def test_cli_prints_the_report_and_writes_the_plan(tmp_path, capsys):
    path = tmp_path / "plan.json"
    assert main(["model=llama500m", "sdp.kind=block", "sdp.coverage=0.5", "sdp.workers=32",
                 "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "holders per component     min 16  mean 16.00  max 16" in out
    assert "spectral gap" in out and "vs DDP" in out
    data = json.loads(path.read_text())
    assert data["workers"] == 32 and len(data["components"]) == 24
    assert np.asarray(data["assignment"]).sum(axis=1).tolist() == [12] * 32
    assert main(["sdp.kind=block", "sdp.coverage=2", "sdp.workers=4"]) == 2
    assert "sdp.coverage must lie in (0, 1]" in capsys.readouterr().err


def test_step_budget_scales_by_one_over_coverage_when_flop_matched():
    assert sdp.step_budget(300, SDPConfig(kind="block", coverage=0.5, flop_matched=True)) == 600
    assert sdp.step_budget(300, SDPConfig(kind="block", coverage=0.69, flop_matched=True)) == 435
    assert sdp.step_budget(300, SDPConfig(kind="block", coverage=0.5, flop_matched=False)) == 300
    assert sdp.step_budget(300, SDPConfig(kind="none", coverage=0.5, flop_matched=True)) == 300


@pytest.mark.parametrize("experiment", ["tiny_bsdp50", "tiny_nsdp50", "llama500m_bsdp50", "llama500m_nsdp50",
                                        "llama1_8b_bsdp69"])
def test_sdp_experiments_compose_and_plan(experiment, capsys):
    assert main([f"+experiment={experiment}", "sdp.workers=8"]) == 0
    out = capsys.readouterr().out
    kind = "neuron" if "nsdp" in experiment else "block"
    coverage = "0.69" if experiment.endswith("69") else "0.5"
    assert f"SDP plan: {kind} cyclic C={coverage}" in out
