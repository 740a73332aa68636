"""End to end through train.py on 2 gloo processes: learning, exact resume, bad input."""
import json

import pytest
import torch
from safetensors.torch import load_file

from tests.scripts.tiny_checkpoint import write_choice_task
from tests.train_helpers import TINY, check, read_metrics, train_cli, train_losses


def _args(tmp_path, cache, *extra):
    return [*TINY, f"out_dir={tmp_path}", f"data.cache_dir={cache}", *extra]


def test_two_process_run_learns_logs_and_checkpoints(tmp_path, prepared_cache):
    proc = check(train_cli(_args(tmp_path, prepared_cache, "run_name=learn", "train.steps=30",
                                 "train.ckpt_every=10", "train.keep_last=2", "train.eval_every=15"), nproc=2))
    run = tmp_path / "learn"
    losses = train_losses(run)
    assert sorted(losses) == list(range(1, 31))
    first, last = losses[1], sum(losses[s] for s in range(26, 31)) / 5
    assert last < first - 1.0, f"loss did not fall: {first:.3f} -> {last:.3f}"
    records = read_metrics(run)
    step_records = [r for r in records if "train/loss" in r]
    for key in ("train/lr", "train/grad_norm", "perf/tokens_per_s", "perf/tflops_per_device", "mem/peak_gib",
                "perf/time_data_s", "perf/time_fwd_bwd_s", "perf/time_comm_s", "perf/time_opt_s",
                "comm/bytes_grad_allreduce", "comm/compression"):
        assert all(key in r for r in step_records), key
    assert [r["step"] for r in records if "val/loss" in r] == [15, 30]
    # keep_last=2: steps 20 and 30 stay, 10 was pruned; no temporary folder is left.
    assert sorted(p.name for p in run.iterdir() if p.name.startswith(("step-", ".step-"))) == ["step-20", "step-30"]
    meta = json.loads((run / "step-30" / "meta.json").read_text())
    assert meta["step"] == 30 and meta["world_size"] == 2 and meta["config"]["model"]["d_model"] == 64
    assert set(meta["files"]) == {"model.safetensors", "optimizer.pt", "rank-0.pt", "rank-1.pt"}
    weights = load_file(str(run / "step-30" / "model.safetensors"))
    assert all(torch.isfinite(w).all() for w in weights.values())
    summary = json.loads((run / "summary.json").read_text())
    assert summary["state"] == "completed" and summary["final_val_loss"] < first
    assert "validation loss" in proc.stdout and str(run) in proc.stdout


@pytest.mark.parametrize("optimizer", ["adamw", "adams", "adams optimizer.param_groups=[{match:embedding,lr_scale:4}]",
                                       "sparse_avg optimizer.param_groups=[{match:embedding,lr_scale:4,step_bound:4.47,"
                                       "denominator_beta:0.2}]"])
def test_resume_auto_reproduces_the_uninterrupted_losses(tmp_path, prepared_cache, optimizer):
    name, *options = optimizer.split()
    common = _args(tmp_path, prepared_cache, f"optimizer={name}", *options, "train.steps=10", "train.ckpt_every=0")
    check(train_cli([*common, "run_name=straight"], nproc=2))
    check(train_cli([*common, "run_name=split", "train.stop_after_steps=4"], nproc=2))
    assert json.loads((tmp_path / "split" / "status.json").read_text()) == {"state": "stopped", "step": 4}
    check(train_cli([*common, "run_name=split", "resume=auto"], nproc=2))
    straight, split = train_losses(tmp_path / "straight"), train_losses(tmp_path / "split")
    assert sorted(split) == list(range(1, 11)), "every step logged exactly once across the two jobs"
    for step in range(1, 11):
        assert abs(straight[step] - split[step]) <= 1e-6, (step, straight[step], split[step])


def test_bad_batch_and_missing_resume_fail_clearly(tmp_path, prepared_cache):
    proc = train_cli(_args(tmp_path, prepared_cache, "train.global_batch_tokens=1000"), timeout=120)
    assert proc.returncode == 2 and "train.global_batch_tokens=1000 is not a multiple" in proc.stderr
    proc = train_cli(_args(tmp_path, prepared_cache, f"resume={tmp_path}/nope/step-5"), timeout=120)
    assert proc.returncode == 2 and "no such checkpoint" in proc.stderr
    assert not any(tmp_path.iterdir())


def test_existing_run_is_not_overwritten(tmp_path, prepared_cache):
    check(train_cli(_args(tmp_path, prepared_cache, "run_name=r", "train.steps=2")))
    before = (tmp_path / "r" / "metrics.jsonl").read_text()
    proc = train_cli(_args(tmp_path, prepared_cache, "run_name=r", "train.steps=2"))
    assert proc.returncode == 2 and "resume=auto" in proc.stderr
    assert (tmp_path / "r" / "metrics.jsonl").read_text() == before


def test_activation_checkpointing_gives_the_same_losses(tmp_path, prepared_cache):
    common = _args(tmp_path, prepared_cache, "train.steps=3")
    check(train_cli([*common, "run_name=plain"]))
    check(train_cli([*common, "run_name=ckpt", "train.activation_checkpointing=true"]))
    plain, recomputed = train_losses(tmp_path / "plain"), train_losses(tmp_path / "ckpt")
    assert plain.keys() == recomputed.keys() == {1, 2, 3}
    assert all(abs(plain[s] - recomputed[s]) <= 1e-6 for s in plain)


def test_in_loop_downstream_evaluation_logs_lm_eval_scores(tmp_path, prepared_cache):
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    docs = [{"question": "for x in range(3):", "choices": [" print(x)", " banana split"], "label": 0},
            {"question": "The return statement", "choices": [" leaves the function", " qwzx"], "label": 0}]
    (tasks / "choice.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    write_choice_task(tasks, "loop_choice", f"dataset_path: json\ndataset_kwargs:\n  data_files:\n"
                                            f"    test: {tasks / 'choice.jsonl'}\ntest_split: test\n")
    offline = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_DATASETS_CACHE": str(tmp_path / "hf")}
    check(train_cli(_args(tmp_path, prepared_cache, "run_name=ds", "train.steps=2", "train.downstream_every=2",
                          "train.downstream_tasks=loop_choice", f"train.downstream_include_path={tasks}"),
                    env=offline, timeout=400))
    scores = [r for r in read_metrics(tmp_path / "ds") if "eval/loop_choice/acc" in r]
    assert [r["step"] for r in scores] == [2] and 0.0 <= scores[0]["eval/loop_choice/acc"] <= 1.0
