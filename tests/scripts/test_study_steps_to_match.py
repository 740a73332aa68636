"""The horizon read in steps: AdamS steps that match a method's loss, from study JSONs."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.train_helpers import load_script

match_steps = load_script("study_steps_to_match")


def _power_law(steps: float) -> float:
    return 2.0 + 10.0 * steps ** -0.5


def _write(path: Path, steps: int, arms: dict) -> Path:
    path.write_text(json.dumps({"settings": {"steps": steps},
                                "arms": {name: {"seed_losses_at_best_lr": losses} for name, losses in arms.items()}}))
    return path


def test_steps_to_reach_interpolates_in_log_steps_and_refuses_to_extrapolate():
    ref = [(100, _power_law(100)), (400, _power_law(400))]
    assert match_steps.steps_to_reach(ref, _power_law(100)) == pytest.approx(100)
    assert match_steps.steps_to_reach(ref, _power_law(400)) == pytest.approx(400)
    # log-linear: halfway in loss between two lengths is their geometric mean
    assert match_steps.steps_to_reach(ref, (_power_law(100) + _power_law(400)) / 2) == pytest.approx(200)
    assert match_steps.steps_to_reach(ref, _power_law(50)) is None
    assert match_steps.steps_to_reach(ref, _power_law(800)) is None


def test_a_constant_speed_up_reads_as_a_constant_ratio_while_its_lead_in_nats_shrinks(tmp_path):
    refs = [_write(tmp_path / f"adams{s}.json", s,
                   {"adams": {"1337": _power_law(s), "1": _power_law(s) + 0.01}})
            for s in (300, 375, 450, 1200, 1500, 1800)]
    methods = [_write(tmp_path / f"method{s}.json", s,
                      {"adams": {"1337": _power_law(s), "1": _power_law(s) + 0.01},
                       "fast": {"1337": _power_law(1.25 * s), "1": _power_law(1.25 * s) + 0.01}})
               for s in (300, 1200)]
    out = match_steps.match(refs, methods, "fast")
    short, long = out["methods"]
    assert short["ratio"] == pytest.approx(1.25, rel=1e-6) and long["ratio"] == pytest.approx(1.25, rel=1e-6)
    assert short["per_seed"]["1"]["ratio"] == pytest.approx(1.25, rel=1e-6)
    lead_short = short["loss"] - _power_law(300)
    lead_long = long["loss"] - _power_law(1200)
    assert lead_short < lead_long < 0  # the nats gap "grows" although the speed-up is the same


def test_a_loss_beyond_the_references_is_null_with_the_lengths_to_add(tmp_path):
    refs = [_write(tmp_path / f"adams{s}.json", s, {"adams": {"1337": _power_law(s)}}) for s in (300, 375)]
    method = _write(tmp_path / "m.json", 300, {"fast": {"1337": _power_law(600)}})
    row = match_steps.match(refs, [method], "fast")["methods"][0]
    assert row["adams_steps"] is None and row["ratio"] is None
    assert "outside AdamS's references" in row["note"] and "375 steps" in row["note"]


def test_studies_of_one_length_merge_seed_by_seed(tmp_path):
    """A second seed is often its own study: both sides merge by length, paired by seed."""
    refs = [_write(tmp_path / "adams300.json", 300, {"adams": {"1337": _power_law(300), "1": _power_law(300) + 0.02}}),
            _write(tmp_path / "adams1200.json", 1200, {"adams": {"1337": _power_law(1200)}}),
            _write(tmp_path / "adams1200_s1.json", 1200, {"adams": {"1": _power_law(1200) + 0.02}})]
    methods = [_write(tmp_path / "m600.json", 600, {"fast": {"1337": _power_law(750)}}),
               _write(tmp_path / "m600_s1.json", 600, {"fast": {"1": _power_law(750) + 0.02}})]
    out = match_steps.match(refs, methods, "fast")
    assert out["reference"]["1200"] == pytest.approx(_power_law(1200) + 0.01)
    (row,) = out["methods"]
    assert row["steps"] == 600 and row["studies"] == [str(methods[0]), str(methods[1])]
    assert row["loss"] == pytest.approx(_power_law(750) + 0.01)
    assert set(row["per_seed"]) == {"1337", "1"}
    assert all(seed["adams_steps"] is not None for seed in row["per_seed"].values())
    # each seed is read against its own references: a constant shift of a seed's losses reads the same
    assert row["per_seed"]["1"]["ratio"] == pytest.approx(row["per_seed"]["1337"]["ratio"], rel=1e-9)
    assert row["ratio"] == pytest.approx(row["per_seed"]["1337"]["ratio"], rel=1e-9)
    # a power law read log-linearly through two lengths only: above the true 750 / 600, not far
    assert 1.25 < row["ratio"] < 1.4


def test_bad_input_names_the_problem(tmp_path, capsys):
    ref = _write(tmp_path / "a.json", 300, {"adams": {"1337": 4.0}})
    dup = _write(tmp_path / "b.json", 300, {"adams": {"1337": 4.1}})  # seed 1337 at 300 steps again
    method = _write(tmp_path / "m.json", 300, {"fast": {"1337": 4.0}})
    with pytest.raises(SystemExit, match="no arm 'slow'.*it has fast"):
        match_steps.match([ref, _write(tmp_path / "c.json", 600, {"adams": {"1337": 3.5}})], [method], "slow")
    with pytest.raises(SystemExit, match="seed 1337 of 'adams' at 300 steps is in two studies.*a.json and .*b.json"):
        match_steps.match([ref, dup, _write(tmp_path / "c.json", 600, {"adams": {"1337": 3.5}})], [method], "fast")
    with pytest.raises(SystemExit, match="two lengths or more"):
        match_steps.match([ref], [method], "fast")
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(SystemExit, match="cannot read the study"):
        match_steps.main(["--arm", "fast", "--reference", str(tmp_path / "broken.json"), str(ref),
                          "--method", str(method)])
