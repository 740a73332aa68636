"""The quality study end to end at debug size, so the script cannot rot while the trainer moves.

Three arms (dense AdamS, SCAPE-99, FLOP-matched B-SDP) of a few steps on 2 gloo ranks: checks the
study launches real torchrun runs, reads their logs into the table, JSON and plot, applies the
FLOP-matched step budget, and reuses finished arms instead of training them again.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.train_helpers import TINY_DATA, load_script

STEPS = 4


study = load_script("study_quality")

DEBUG_MODEL = ["model.n_layer=2", "model.d_model=64", "model.n_head=4", "model.n_kv_head=2",
               "model.ffn_hidden=192", *TINY_DATA]


def test_bytes_to_reach_interpolates_between_validation_points():
    curve = {"step": [10, 20], "val_loss": [3.0, 2.0], "bytes_sent": [100.0, 200.0]}
    assert study.bytes_to_reach(curve, 2.5) == pytest.approx(150.0)
    assert study.bytes_to_reach(curve, 3.5) == pytest.approx(100.0)
    assert study.bytes_to_reach(curve, 1.0) is None


def test_later_overrides_win_key_by_key():
    merged = study.merge_overrides(["a.b=1", "opt=x"], ["a.b=2"])
    assert merged == ["opt=x", "a.b=2"]


def test_study_runs_arms_and_reports(prepared_cache, tmp_path):
    out, runs = tmp_path / "results", tmp_path / "runs"
    argv = ["--arms", "adams,scape99,bsdp50_fm", "--steps", str(STEPS), "--nproc", "2",
            "--global-batch-tokens", "512", "--seq-len", "64", "--vocab", "8192", "--corpus", "embedded",
            "--cache-dir", str(prepared_cache), "--eval-every", "2", "--eval-batches", "2", "--log-every", "1",
            "--name", "smoke", "--out", str(out), "--runs-dir", str(runs), "--timeout", "240"]
    for item in [*DEBUG_MODEL, "optimizer.warmup_steps=0"]:  # 4 steps: no room for a warm-up (nor SCAPE's, 3 of them)
        argv += ["--set", item]
    assert study.main(argv) == 0, "\n".join(p.read_text()[-3000:] for p in (runs / "smoke").glob("*.log"))

    report = json.loads((out / "smoke.json").read_text())
    arms = report["arms"]
    assert set(arms) == {"adams", "scape99", "bsdp50_fm"}
    for name, record in arms.items():
        summary = record["summary"]
        assert summary["state"] == "completed", name
        assert math.isfinite(summary["final_val_loss"]), name
        assert record["curve"]["step"][-1] == summary["step"], name
    assert arms["adams"]["summary"]["step"] == STEPS
    assert arms["bsdp50_fm"]["summary"]["step"] == 2 * STEPS  # FLOP-matched: 1/C steps at C = 0.5
    # SCAPE-99's first step is dense (its dense warm-up), the 3 others send ~1.5% of a dense step
    # each (values, mask, control): between 1 and 1.1 dense steps in all, not "less than dense".
    dense_step = arms["adams"]["summary"]["bytes_sent_per_rank"] / STEPS
    assert 1.0 < arms["scape99"]["summary"]["bytes_sent_per_rank"] / dense_step < 1.1
    gap_target = next(t for t in report["targets"] if t["arm"] == "scape99")
    expected_gap = arms["scape99"]["summary"]["final_val_loss"] - arms["adams"]["summary"]["final_val_loss"]
    assert gap_target["value"] == pytest.approx(expected_gap, abs=1e-4)
    table = (out / "smoke.md").read_text()
    assert "| SCAPE-99 |" in table and "| B-SDP C=0.5, FLOP-matched |" in table
    assert (out / "smoke_val_loss.png").stat().st_size > 10_000

    # A second invocation reuses the finished arms (no training) and reports the same numbers.
    written = {name: (runs / "smoke" / name / "summary.json").stat().st_mtime for name in arms}
    assert study.main(argv) == 0
    again = json.loads((out / "smoke.json").read_text())["arms"]
    assert {n: (runs / "smoke" / n / "summary.json").stat().st_mtime for n in arms} == written
    assert again["scape99"]["summary"] == arms["scape99"]["summary"]


def test_composed_arms_follow_their_recipe_and_bad_names_are_refused(monkeypatch):
    arm = study.compose_arm("scape99+post+lrsum32+warm60+noclip")
    overrides = dict(item.split("=", 1) for item in arm.overrides)
    assert overrides["optimizer"] == "scape" and overrides["optimizer.sparsity"] == "0.99"
    assert overrides["optimizer.score_timing"] == "post_step"
    assert overrides["optimizer.stale_scale"] == "lr_sum" and overrides["optimizer.stale_scale_cap"] == "32"
    assert overrides["optimizer.sparsity_warmup_steps"] == "60" and overrides["optimizer.grad_clip"] == "0"
    spec = dict(item.split("=", 1) for item in study.compose_arm("scape90+lr6e-3").overrides)
    assert spec["optimizer.score_timing"] == "pre_send" and spec["optimizer.stale_scale_cap"] == "1"
    assert spec["optimizer.lr"] == "6e-3"
    # optimizer=sparse_avg as it ships, and a part overrides it
    assert study.ARMS["sma99t"].overrides == ("optimizer=sparse_avg",)
    assert study.compose_arm("sma99t+lr2e-3").overrides == ("optimizer=sparse_avg", "optimizer.lr=2e-3")
    table = dict(i.split("=", 1) for i in study.compose_arm("sma99t+emb8.94+bound13").overrides)
    assert table["optimizer.param_groups"] == "[{match:embedding,step_bound:8.94}]" and table["optimizer.step_bound"] == "13"
    # the table's parts make one parameter group; sparse averaging's at a raised table lr has its
    # bound and memory unless a part sets them, the dense arms' has the lr multiple only
    group = dict(i.split("=", 1) for i in study.compose_arm("sma99t+elr16+edbeta0.5").overrides)
    assert group["optimizer.param_groups"] == "[{match:embedding,step_bound:4.47,denominator_beta:0.5,lr_scale:16}]"
    dense = dict(i.split("=", 1) for i in study.compose_arm("adams+elr16").overrides)
    assert dense["optimizer.param_groups"] == "[{match:embedding,lr_scale:16}]"
    slope = dict(i.split("=", 1) for i in study.compose_arm("sma99t+lsp0.5").overrides)
    assert (slope["optimizer.local_step_scale"], slope["optimizer.local_step_scale_power"]) == ("0", "0.5")
    # the byte budget (budget1: the dense bytes a step, so density 1 throughout)
    budget = dict(i.split("=", 1) for i in study.compose_arm("sma99t+budget0.02+q0").overrides)
    assert budget["optimizer.byte_budget"] == "0.02" and budget["optimizer.value_bits"] == "0"
    assert study.compose_arm("sma99t+budget") is None
    # the parts of the rules that lost are gone (docs/JOURNAL.md)
    for gone in ("sma99t+cyc", "sma99t+om0.9", "sma99t+clipsh", "sma99t+own", "sma99t+ownfl2", "sma99t+dbeta0.5",
                 "scape99+clip", "sma99+warm20", "sma99t+lrpow0.5", "sma99t+minsp0.72", "sma99t+invlr0.8",
                 "sma99t+withlr"):
        assert study.compose_arm(gone) is None, gone
    # a part's name may end in e (the number is split off, not every trailing e, digit or dash)
    monkeypatch.setitem(study._PARTS, "wide", (["optimizer.step_bound=wide"], "wide"))
    assert "optimizer.step_bound=wide" in study.compose_arm("sma99t+wide+sp0.9").overrides
    assert study.compose_arm("sma99t+wide1") is None and study.compose_arm("sma99t+sp") is None
    for bad in ("scape99", "scape99+cap", "scape99+post7", "scape50+post", "bsdp50+post", "sma99t+sp0.9x"):
        assert study.compose_arm(bad) is None, bad
    with pytest.raises(SystemExit):
        study.parse_args(["--arms", "scape99+nonsense"])


def test_sweep_extends_a_winning_grid_end_and_runs_other_seeds_at_the_best_lr(tmp_path, monkeypatch):
    """run_sweep with a stand-in trainer whose loss is a parabola in log(lr), minimum at 8e-3."""
    ran = []

    def fake_run_arm(arm, args, study_runs, run_name, point):
        lr = float(point[0].split("=")[1])
        seed = int(point[1].split("=")[1])
        ran.append((arm.name, lr, seed))
        loss = (math.log(lr / (8e-3 if arm.name != "adams" else 2e-3))) ** 2 + 4.0 + 0.01 * seed
        run_dir = study_runs / run_name
        run_dir.mkdir(parents=True)
        (run_dir / "summary.json").write_text(json.dumps({
            "state": "completed", "final_val_loss": loss, "bytes_sent_per_rank": 1.0,
            "dense_bytes_per_rank": 10.0}))
        (run_dir / "metrics.jsonl").write_text(json.dumps({"step": 1, "val/loss": loss,
                                                           "comm/bytes_cumulative": 1.0}) + "\n")
        return {}

    monkeypatch.setattr(study, "run_arm", fake_run_arm)
    args = study.parse_args(["--arms", "adams,scape99", "--lrs", "1e-3,2e-3,4e-3", "--seeds", "1,2",
                             "--out", str(tmp_path / "out"), "--runs-dir", str(tmp_path / "runs")])
    arms = study.run_sweep(args, tmp_path / "runs")
    assert arms["adams"]["best_lr"] == pytest.approx(2e-3)  # inside the grid: no extension
    assert arms["scape99"]["best_lr"] == pytest.approx(8e-3)  # 4e-3 won, so 8e-3 was added
    assert ("scape99", 8e-3, 1) in ran and ("scape99", 1.6e-2, 1) in ran  # 8e-3 won too: one more
    assert [r for r in ran if r[2] == 2] == [("adams", 2e-3, 2), ("scape99", 8e-3, 2)]
    gaps = study.sweep_gaps(arms, 2e-3, 1)
    assert gaps["scape99"]["gap"] == pytest.approx(0.0, abs=1e-9)  # both at their own minimum
    assert gaps["scape99"]["shared_gap"] > 1.0  # at AdamS's lr SCAPE is far from its own best
    table = study.sweep_table(arms, gaps, args)
    assert "**4.0100**" in table and "| 0.008 |" in table


def test_presets_set_arms_lrs_and_seeds_and_every_arm_composes():
    for name, preset in study.PRESETS.items():
        args = study.parse_args(["--preset", name])
        assert args.lrs == [float(x) for x in preset["lrs"].split(",")] and args.seeds == [1337, 1], name
        for arm in preset["arms"].split(","):
            assert arm in study.ARMS or study.compose_arm(arm) is not None, (name, arm)
    table = study.parse_args(["--preset", "fair_table", "--arms", "adams+elr16", "--lrs", "2e-3"])
    assert table.lrs == [2e-3] and table.seeds == [1337, 1]  # given flags win over the preset's
    overrides = dict(i.split("=", 1) for i in study.compose_arm("sma99t+elr16").overrides)
    assert overrides == {"optimizer": "sparse_avg",
                         "optimizer.param_groups": "[{match:embedding,step_bound:4.47,denominator_beta:0.2,lr_scale:16}]"}
    args = study.parse_args(["--preset", "evaluation", "--corpus", "embedded"])
    for arm in args.arm_names:  # each arm's command line is built, a parameter group's braces kept
        command = study.arm_command(study.ARMS[arm], args, Path("runs") / arm)
        assert any("param_groups=[{match:embedding," in item for item in command), (arm, command)
    shipped = study.compose_arm("scape99t+elr16").overrides  # SCAPE as it ships, not the spec's rule
    assert "optimizer.sparsity=0.99" in shipped and not any("score_timing" in item for item in shipped)
    assert "optimizer.score_timing=pre_send" in study.compose_arm("scape99+elr16").overrides


def test_the_evaluation_preset_runs_one_study_per_evaluation_corpus(tmp_path, monkeypatch):
    monkeypatch.setattr(study, "EVAL_CORPORA_DIR", tmp_path)
    with pytest.raises(SystemExit, match="build_eval_corpora.py --install"):
        study.main(["--preset", "evaluation"])  # no corpora built: named, with the command that builds them
    for corpus in study.EVAL_CORPORA:
        (tmp_path / f"{corpus}.jsonl").write_text('{"text": "x"}\n')
    ran = []
    monkeypatch.setattr(study, "sweep_main", lambda args, runs, invocation: ran.append(
        (args.corpus, args.name, args.arm_names, args.lrs, args.seeds, invocation)) or 0)
    assert study.main(["--preset", "evaluation", "--name", "ev", "--steps", "7"]) == 0
    assert [(Path(c).name, n) for c, n, *_ in ran] == [(f"{c}.jsonl", f"ev_{c}") for c in study.EVAL_CORPORA]
    for _, name, arms, lrs, seeds, invocation in ran:
        assert arms == ["adams+elr16", "scape90t+elr16", "scape99t+elr16", "sma99t+elr16"]
        assert {2e-3, 3e-3} <= set(lrs) and seeds == [1337, 1]  # the shipped lrs, two seeds
        assert f"--name {name}" in invocation and "--steps 7" in invocation
    ran.clear()
    study.main(["--preset", "evaluation", "--corpus", str(tmp_path / "manpages.jsonl")])
    assert len(ran) == 1 and ran[0][1] == "quality"  # --corpus given: that corpus only


def test_gaps_are_to_adams_or_else_to_the_first_adams_arm_with_parts():
    def arm(losses):
        return {"seed_losses_at_best_lr": dict(zip((1337, 1), losses)), "lr_losses_first_seed": {"0.003": losses[0]}}

    assert study.reference_arm(["sma99e+elr16", "adams+elr16", "adams+elr8"]) == "adams+elr16"
    assert study.reference_arm(["adams+elr16", "adams"]) == "adams" and study.reference_arm(["sma99e"]) is None
    gaps = study.sweep_gaps({"adams+elr16": arm([4.0, 4.2]), "sma99e+elr16": arm([4.1, 4.2])}, 3e-3, 1337)
    assert gaps["sma99e+elr16"]["gap"] == pytest.approx(0.05) and gaps["sma99e+elr16"]["paired_gaps"] == \
        pytest.approx([0.1, 0.0]) and gaps["sma99e+elr16"]["shared_gap"] == pytest.approx(0.1)


def test_stdlib_source_corpus_is_the_library_outside_its_tests_written_once(tmp_path, monkeypatch):
    # on a library laid out by hand: which files are read, in which order
    fake = tmp_path / "lib"
    files = {"a.py": "A = 1\n", "pkg/b.py": "B = 2\n", "empty.py": "  \n", "test/t.py": "T = 3\n",
             "pkg/tests/u.py": "U = 4\n", "site-packages/x/y.py": "Y = 5\n", "notes.txt": "N\n"}
    for name, text in files.items():
        (fake / name).parent.mkdir(parents=True, exist_ok=True)
        (fake / name).write_text(text)
    monkeypatch.setattr(study.sysconfig, "get_paths", lambda: {"stdlib": str(fake)})
    out = tmp_path / "corpora" / "stdlib_source.jsonl"
    corpus = study.stdlib_source_corpus(out)
    assert [json.loads(line)["text"] for line in corpus.read_text().splitlines()] == ["A = 1\n", "B = 2\n"]
    assert not list(tmp_path.rglob("*.partial"))
    # written once: a second call reads the file back and does not rewrite it
    stamp = corpus.stat().st_mtime_ns
    monkeypatch.setattr(study.sysconfig, "get_paths", lambda: pytest.fail("the corpus was rebuilt"))
    assert study.stdlib_source_corpus(out) == out and out.stat().st_mtime_ns == stamp
    # the study's overrides point data=local at it, named after corpus and vocabulary
    args = study.parse_args(["--corpus", "stdlib-source", "--cache-dir", str(tmp_path / "data")])
    overrides = study.data_overrides(args)
    assert "data=local" in overrides and f"data.paths=[{out}]" in overrides
    assert "data.name=stdlib_source_v2048" in overrides
    # and this CPython's real library gives a corpus of its modules
    monkeypatch.undo()
    real = study.stdlib_source_corpus(tmp_path / "real.jsonl")
    documents = [json.loads(line)["text"] for line in real.read_text(encoding="utf-8").splitlines()]
    assert len(documents) > 300 and any("def dumps(" in text for text in documents)  # json/__init__.py


def test_val_curve_carries_the_mean_training_loss_of_each_validation_interval(tmp_path):
    lines = [{"step": 5, "train/loss": 6.0, "comm/bytes_cumulative": 50.0},
             {"step": 10, "train/loss": 5.0, "comm/bytes_cumulative": 100.0},
             {"step": 10, "val/loss": 5.5},
             {"step": 15, "train/loss": 4.0, "comm/bytes_cumulative": 150.0},
             {"step": 20, "train/loss": 3.0, "comm/bytes_cumulative": 200.0},
             {"step": 20, "val/loss": 4.5}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    curve = study.val_curve(tmp_path)
    assert curve["step"] == [10, 20] and curve["val_loss"] == [5.5, 4.5]
    assert curve["train_loss"] == [pytest.approx(5.5), pytest.approx(3.5)]  # steps 1-10, then 11-20
    arm = {"curve": curve}
    assert study._last_train_loss(arm) == pytest.approx(3.5)
    assert study._last_train_loss({"curve": {"train_loss": [math.nan]}}) is None
