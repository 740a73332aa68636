"""The dashboard builds offline, and every panel's metric is one that real runs write."""
import re

import pytest

from tests.train_helpers import TINY, check, read_metrics, train_cli

# One run per synchroniser family whose metrics the dashboard shows: SCAPE (scape/*) and B-SDP
# (sdp/*), each on 2 gloo processes so bytes cross ranks; peak_tflops gives CPU runs an MFU. SCAPE's
# run takes 2 micro-batches a step, which the noise scale needs.
RUNS = {"scape": ["optimizer=scape", "optimizer.sparsity_warmup_steps=0", "train.global_batch_tokens=1024"],
        "sdp": ["sdp=block", "sdp.coverage=0.5"]}


@pytest.fixture(scope="module")
def logged_metrics(tmp_path_factory, prepared_cache):
    out = tmp_path_factory.mktemp("dashboard_runs")
    keys = set()
    for name, extra in RUNS.items():
        check(train_cli([*TINY, f"out_dir={out}", f"data.cache_dir={prepared_cache}", f"run_name={name}",
                         "train.steps=4", "train.eval_every=2", "train.log_every=2", "train.peak_tflops=1",
                         *extra], nproc=2))
        keys |= {k for record in read_metrics(out / name) for k in record if k != "step"}
    return keys


def test_every_panel_metric_is_logged_by_a_real_run(logged_metrics):
    from scripts.dashboard import build_workspace, panel_metrics

    workspace = build_workspace("offline-entity", "offline-project")
    workspace._to_model()  # the view wandb would receive: builds without network
    panels = list(panel_metrics(workspace))
    assert {section for section, *_ in panels} == {"val", "train", "perf", "comm", "scape", "sdp", "mem"}
    for section, title, x, y, regex in panels:
        assert y or regex, f"{title}: no metric"
        for metric in [*y, *([x] if x else [])]:
            assert metric in logged_metrics, f"{section}/{title}: {metric} is in no run's metrics.jsonl"
        if regex:
            matched = sorted(k for k in logged_metrics if re.search(regex, k))
            assert matched, f"{title}: {regex} matches no logged metric"
            assert "comm/bytes_total" not in matched and "comm/bytes_scape_values" in matched
    shown = {m for *_, x, y, _ in panels for m in [*y, *([x] if x else [])]}
    assert {"val/loss", "train/tokens", "comm/bytes_cumulative", "perf/mfu", "scape/mask_overlap",
            "scape/residual_norm", "sdp/params_held_fraction", "mem/peak_gib"} <= shown
    assert [str(g.name) for g in workspace.runset_settings.groupby] == ["optimizer.name"]


def test_every_logged_metric_is_in_the_one_list(logged_metrics):
    from trainer.metrics import is_known_metric

    unknown = sorted(k for k in logged_metrics if not is_known_metric(k))
    assert not unknown, f"logged but not in trainer/metrics.py's METRICS / METRIC_FAMILIES: {unknown}"


def test_a_panel_on_an_unknown_metric_is_refused():
    from scripts.dashboard import _plot

    with pytest.raises(KeyError, match="val/los is not in trainer/metrics.py's METRICS"):
        _plot("typo", ["val/los"])


def test_dry_run_prints_the_panels(capsys):
    from scripts.dashboard import main

    assert main(["--entity", "e", "--project", "p", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "validation loss against bytes sent per rank" in out and "grouped by optimizer.name" in out
