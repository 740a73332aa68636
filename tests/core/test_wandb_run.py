"""core/wandb_run.py: the run folder's wandb id, the rewind point, grouping and provenance."""
import subprocess
from pathlib import Path

import pytest

from core.wandb_run import (RUN_ID_FILE, ensure_run_id, grouping, provenance, read_run_id, rewind_point,
                            run_id_for)


def test_the_id_is_drawn_once_per_run_folder_and_kept(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    assert read_run_id(a) is None
    first = ensure_run_id(a)
    assert ensure_run_id(a) == first == read_run_id(a) == (a / RUN_ID_FILE).read_text().strip()
    assert ensure_run_id(b) != first, "two folders, two wandb runs"
    assert run_id_for(a, "llama500m/scape99") == first
    assert run_id_for(b.parent / "old", "llama500m/scape99") == "llama500m-scape99", "older runs: the run name"
    (b / RUN_ID_FILE).write_text("not an id!\n")
    with pytest.raises(ValueError, match="not a wandb run id; delete the file"):
        read_run_id(b)


def test_rewind_only_when_steps_are_logged_again():
    assert rewind_point("abc", start_step=4, logged_through=4) is None  # a clean stop at the checkpoint
    assert rewind_point("abc", start_step=4, logged_through=0) is None
    assert rewind_point("abc", start_step=4, logged_through=6) == "abc?_step=4"


def test_group_and_tags_follow_the_values_not_the_experiment_name():
    config = {"model": {"name": "llama500m"}, "optimizer": {"name": "scape", "sparsity": 0.9},
              "sdp": {"kind": "none"}, "logger": {"group": None}}
    group, tags = grouping(config)
    assert group == "llama500m_scape90" and "sparsity:0.9" in tags and "optimizer:scape" in tags
    config["sdp"] = {"kind": "block", "coverage": 0.5}
    config["optimizer"] = {"name": "adams", "sparsity": 0.99}
    group, tags = grouping(config)
    assert group == "llama500m_adams_bsdp50" and {"sdp:block", "sdp_coverage:0.5"} <= set(tags)
    assert not any(t.startswith("sparsity:") for t in tags), "a dense optimizer has no sparsity tag"
    config["logger"] = {"group": "my-study", "tags": ["lr-sweep"]}
    group, tags = grouping(config)
    assert group == "my-study" and tags[-1] == "lr-sweep" and "optimizer:adams" in tags


def test_provenance_names_code_libraries_and_job(monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    info = provenance()
    assert info["slurm_job_id"] == "4242" and info["slurm_restart_count"] == 1
    assert info["torch"]
    repo = Path(__file__).resolve().parents[2]
    if not (repo / ".git").exists():
        pytest.skip("not a git checkout: there is no commit to record")
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True, check=True)
    assert info["git_commit"] == head.stdout.strip()  # the commit the code ran at, never None in a checkout
    assert isinstance(info["git_dirty"], bool)
