"""The trainer's wandb run, checked offline against the files wandb writes (what `wandb sync` sends)."""
import json
import shutil

from tests.train_helpers import TINY, check, read_metrics, train_cli
from tests.wandb_files import offline_runs, server_curve

OFFLINE = {"WANDB_MODE": "offline", "WANDB_SILENT": "true"}


def _args(tmp_path, cache, *extra):
    return [*TINY, f"data.cache_dir={cache}", "logger.wandb=offline", "logger.console=true", *extra]


def test_same_experiment_twice_gets_two_wandb_runs_and_a_crash_resume_rewinds(tmp_path, prepared_cache):
    common = _args(tmp_path, prepared_cache, "run_name=same", "train.steps=8", "train.ckpt_every=4")
    check(train_cli([*common, f"out_dir={tmp_path}/a", "train.stop_after_steps=6"], env=OFFLINE))
    check(train_cli([*common, f"out_dir={tmp_path}/b", "train.steps=2"], env=OFFLINE))
    run_a, run_b = tmp_path / "a" / "same", tmp_path / "b" / "same"
    id_a, id_b = (run_a / "wandb_id").read_text().strip(), (run_b / "wandb_id").read_text().strip()
    assert id_a != id_b, "the same experiment and overrides must not share a wandb run"
    (first,) = offline_runs(run_a)
    assert first.run_id == id_a and first.steps == list(range(1, 7)) and first.branch_point is None
    assert first.job_type == "train" and first.group == "tiny_llama_adamw"
    assert {"model:tiny_llama", "optimizer:adamw"} <= set(first.tags)
    prov = first.config["provenance"]
    assert prov["torch"] and "git_commit" in prov and "slurm_job_id" in prov and "cuda" in prov
    assert first.config["model"]["d_model"] == 64

    # A crash after step 6 whose last checkpoint is step 4: wandb has steps 5 and 6 already.
    shutil.rmtree(run_a / "step-6")
    proc = check(train_cli([*common, f"out_dir={tmp_path}/a", "resume=auto"], env=OFFLINE))
    assert "resuming from" in proc.stdout and "step-4" in proc.stdout
    first, second = offline_runs(run_a)
    assert second.run_id == id_a, "a resumed run keeps its wandb id"
    assert second.branch_point == (id_a, "_step", 4.0), "the resume rewinds wandb to the checkpoint's step"
    assert second.steps == [5, 6, 7, 8]
    # What the server holds after syncing both: every step once, each from the run that
    # metrics.jsonl (the true record) kept: the re-logged steps replace the crashed run's.
    truth = {r["step"]: r["perf/step_time_s"] for r in read_metrics(run_a) if "train/loss" in r}
    assert sorted(truth) == list(range(1, 9))
    assert server_curve([first, second], "perf/step_time_s") == truth
    # Without the rewind wandb would have kept the crashed run's steps 5 and 6.
    second.branch_point = None
    assert server_curve([first, second], "perf/step_time_s") != truth
    summary = json.loads((run_a / "summary.json").read_text())
    assert summary["state"] == "completed" and summary["step"] == 8
    assert "wandb" in proc.stdout and id_a in proc.stdout  # the summary table names the run


def test_clean_stop_resumes_without_rewinding(tmp_path, prepared_cache):
    common = _args(tmp_path, prepared_cache, "run_name=clean", f"out_dir={tmp_path}", "train.steps=4",
                   "train.ckpt_every=0")
    check(train_cli([*common, "train.stop_after_steps=2"], env=OFFLINE))
    check(train_cli([*common, "resume=auto"], env=OFFLINE))
    first, second = offline_runs(tmp_path / "clean")
    assert first.run_id == second.run_id and second.branch_point is None
    assert first.steps + second.steps == [1, 2, 3, 4]
