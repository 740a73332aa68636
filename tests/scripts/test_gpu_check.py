"""scripts/gpu_check.sh: valid bash, a clean refusal without CUDA, every part run on the CPU (--dry) so a
typo cannot waste a GPU session, and checks that fail when what they compare is wrong."""
from __future__ import annotations

import json
import math
import os
import subprocess

import pytest
import torch

from tests.train_helpers import REPO

SCRIPT = REPO / "scripts" / "gpu_check.sh"
ENV = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", WANDB_MODE="disabled")


def test_gpu_check_is_valid_bash_and_lists_every_part_with_a_timeout():
    from scripts import gpu_check

    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
    listed = subprocess.run(["python", "-m", "scripts.gpu_check", "parts"], cwd=REPO, env=ENV, check=True,
                            capture_output=True, text=True).stdout.split("\n")
    rows = [line.split() for line in listed if line]
    assert [name for name, _ in rows] == list(gpu_check.PARTS)
    assert sum(int(t) for _, t in rows) > 0 and all(int(t) <= 600 for _, t in rows)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_gpu_check_refuses_cleanly_without_cuda(tmp_path):
    out = tmp_path / "result.json"
    proc = subprocess.run(["bash", str(SCRIPT), "--out", str(out)], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120, env=ENV)
    assert proc.returncode == 2
    assert "CUDA is not available" in proc.stderr and torch.__version__ in proc.stderr and "--dry" in proc.stderr
    assert "===" not in proc.stdout and not out.exists()  # no part started, nothing written
    bad = subprocess.run(["bash", str(SCRIPT), "--dyr"], capture_output=True, text=True, timeout=60, env=ENV)
    assert bad.returncode == 2 and "unknown argument '--dyr'" in bad.stderr


def test_every_part_runs_dry_on_the_cpu_and_the_results_are_one_json(tmp_path):
    from scripts import gpu_check

    out = tmp_path / "gpu_check.json"
    proc = subprocess.run(["bash", str(SCRIPT), "--dry", "--out", str(out)], cwd=REPO, capture_output=True,
                          text=True, timeout=1500, env=ENV)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-6000:]
    result = json.loads(out.read_text())
    assert result["ok"] and result["dry"] and set(result["parts"]) == set(gpu_check.PARTS)
    for name, part in result["parts"].items():
        measured = [c for c in part["checks"] if "skipped" not in c]
        assert part["ok"] and measured, name  # every part compares something on the CPU too


def test_a_part_that_fails_or_leaves_no_result_fails_the_report(tmp_path):
    from scripts import gpu_check

    parts = tmp_path / "parts"
    parts.mkdir()
    for name in gpu_check.PARTS:
        (parts / f"{name}.json").write_text(json.dumps({"part": name, "ok": True, "checks": [{"name": "x", "ok": True}]}))
    out = tmp_path / "report.json"
    assert gpu_check.main(["report", "--out", str(out), "--parts-dir", str(parts), "--wall-s", "100"]) == 0
    assert gpu_check.main(["report", "--out", str(out), "--parts-dir", str(parts), "--wall-s", "700"]) == 1
    assert not json.loads(out.read_text())["within_time_budget"]
    (parts / "offload.json").unlink()
    (parts / "offload.rc").write_text("124\n")
    assert gpu_check.main(["report", "--out", str(out), "--parts-dir", str(parts), "--wall-s", "100"]) == 1
    assert "exit status 124" in json.loads(out.read_text())["parts"]["offload"]["error"]


def test_a_part_that_raises_is_a_miss_with_its_traceback(monkeypatch):
    from scripts import gpu_check

    def broken(ctx, checks):
        checks.expect("fine so far", True)
        raise KeyError("typo")

    monkeypatch.setitem(gpu_check.PARTS, "attention", (broken, 1))
    result = gpu_check.run_part("attention", dry=True)
    assert not result["ok"] and "KeyError: 'typo'" in result["error"]


def test_the_comparisons_catch_wrong_values_and_lost_nans():
    from scripts import gpu_check

    torch.manual_seed(0)
    q, k, v = torch.randn(1, 16, 4, 8, dtype=torch.float64), *torch.randn(2, 1, 16, 2, 8, dtype=torch.float64)
    causal = gpu_check.attention_reference(q, k, v)
    sdpa = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True).transpose(1, 2)
    assert gpu_check.relative_error(sdpa, causal) < 1e-12
    assert gpu_check.relative_error(gpu_check.attention_reference(q, k, v, causal=False), causal) > 0.1
    assert gpu_check.relative_error(torch.full_like(causal, math.nan), causal) == math.inf

    values, specials = gpu_check._with_specials(4099, torch.device("cpu"), 0)
    bits = values.view(torch.int32)[specials[:4]].tolist()
    assert bits == [0x7FFFFFFF, -1, 0x7FC00000, -0x400000]  # CUDA's NaNs among them
    checks = gpu_check.Checks()
    zeroed = torch.where(torch.isnan(values), 0.0, values)  # what the bf16 rounding bug did to a NaN
    gpu_check._same_specials(checks, "a kernel that loses its NaNs", zeroed, values, specials)
    gpu_check._same_specials(checks, "a kernel that keeps them", values.clone(), values, specials)
    assert [c["ok"] for c in checks.items] == [False, True]
