"""Bytes sent outside the optimizer steps are counted apart, not lost.

Sparse averaging averages its copies for every validation and checkpoint (one dense all-reduce
of the flat parameters each, kind ``average``). The per-step counters leave that out so that
bytes per step compare across optimizers; ``comm/bytes_outside_steps`` and the summary's
``bytes_outside_steps_per_rank`` keep it, so a run's total is what crossed the network (the wire
check in scripts/bench_network.py measures both). A dense arm sends only scalars outside its
steps (the validation loss's mean, the checkpoint's agreement that every rank wrote).
"""
from __future__ import annotations

import json

import pytest

from tests.train_helpers import TINY, check, read_metrics, train_cli

STEPS = 4


@pytest.mark.parametrize("optimizer", ["adams", "sparse_avg"])
def test_validation_and_checkpoint_traffic_is_counted_outside_the_steps(optimizer, tmp_path, prepared_cache):
    common = [*TINY, f"out_dir={tmp_path}", f"data.cache_dir={prepared_cache}", f"optimizer={optimizer}",
              f"train.steps={STEPS}", "train.eval_every=2", "train.ckpt_every=2", "run_name=r"]
    check(train_cli(common, nproc=2))
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    outside = summary["bytes_outside_steps_per_rank"]
    logged = [m["comm/bytes_outside_steps"] for m in read_metrics(tmp_path / "r") if "comm/bytes_outside_steps" in m]
    assert logged == sorted(logged) and logged[-1] <= outside  # cumulative, the summary's the last word
    if optimizer == "adams":
        assert 0 < outside < 1024, outside
        return
    # one average = one dense all-reduce of the parameters, the bytes of a dense step
    dense_step = summary["dense_bytes_per_rank"] / STEPS
    averages = outside / dense_step
    assert averages == pytest.approx(round(averages), abs=0.02) and round(averages) >= 2, averages
    # the step counters are unchanged by it: the run's bytes per step are the steps' alone
    steps_only = [m["comm/bytes_total"] for m in read_metrics(tmp_path / "r") if "comm/bytes_total" in m]
    assert sum(steps_only) == pytest.approx(summary["bytes_sent_per_rank"])
