"""Injected faults: killed ranks, a kill during a checkpoint write, corrupted checkpoints,
non-finite steps, a hung collective, and fuzzed invalid config values. Nothing may be lost."""
from __future__ import annotations

import datetime
import json
import math
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.dist_helpers import run_distributed
from tests.train_helpers import REPO, TINY, check, read_metrics, train_cli, train_losses

OPTIMIZER_ARMS = {
    "adamw": ["optimizer=adamw"],
    "adams": ["optimizer=adams"],
    "scape": ["optimizer=scape", "optimizer.sparsity=0.9"],
    "sdp": ["optimizer=adams", "sdp=block", "sdp.coverage=0.5"],
}


def _args(tmp_path, cache, *extra):
    return [*TINY, f"out_dir={tmp_path}", f"data.cache_dir={cache}", *extra]


# ---------------------------------------------------------------- killed ranks (torchrun, slow)

def _worker_pid(agent_pid: int, rank: int) -> int:
    """PID of torchrun's worker with RANK=rank (the agent's children carry it in their environment)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            environ = (entry / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if ppid == agent_pid and f"RANK={rank}".encode() in environ:
            return int(entry.name)
    raise AssertionError(f"no worker with RANK={rank} under torchrun {agent_pid}")


def _launch(args, max_restarts: int = 0) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           f"--max-restarts={max_restarts}", "train.py", *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled")
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _kill_rank_after(proc: subprocess.Popen, run_dir: Path, step: int, rank: int = 1) -> None:
    deadline = time.time() + 240
    while time.time() < deadline:
        assert proc.poll() is None, f"run ended before step {step}:\n{proc.stdout.read()[-3000:]}"
        metrics = run_dir / "metrics.jsonl"
        if metrics.is_file() and any(json.loads(l)["step"] >= step for l in metrics.read_text().splitlines() if l):
            os.kill(_worker_pid(proc.pid, rank), signal.SIGKILL)
            return
        time.sleep(0.02)
    raise AssertionError("the run did not reach the kill step in time")


@pytest.mark.slow
@pytest.mark.parametrize("arm", sorted(OPTIMIZER_ARMS))
def test_killed_rank_then_resume_auto_equals_uninterrupted(tmp_path, prepared_cache, arm):
    common = _args(tmp_path, prepared_cache, *OPTIMIZER_ARMS[arm], "train.steps=40", "train.ckpt_every=5")
    check(train_cli([*common, "run_name=straight"], nproc=2))
    proc = _launch([*common, "run_name=killed"])
    _kill_rank_after(proc, tmp_path / "killed", step=12)
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode != 0, "torchrun must end the job when a rank dies"
    assert json.loads((tmp_path / "killed" / "status.json").read_text())["state"] == "running", out[-2000:]
    check(train_cli([*common, "run_name=killed", "resume=auto"], nproc=2))
    straight, resumed = train_losses(tmp_path / "straight"), train_losses(tmp_path / "killed")
    assert sorted(resumed) == list(range(1, 41))
    assert max(abs(straight[s] - resumed[s]) for s in straight) <= 1e-6


@pytest.mark.slow
def test_torchrun_max_restarts_recovers_without_a_human(tmp_path, prepared_cache):
    common = _args(tmp_path, prepared_cache, "optimizer=adams", "train.steps=40", "train.ckpt_every=5")
    check(train_cli([*common, "run_name=straight"], nproc=2))
    proc = _launch([*common, "run_name=auto", "resume=auto"], max_restarts=1)
    _kill_rank_after(proc, tmp_path / "auto", step=12)
    out = proc.communicate(timeout=300)[0]
    assert proc.returncode == 0, out[-3000:]
    assert "resuming from" in out
    straight, restarted = train_losses(tmp_path / "straight"), train_losses(tmp_path / "auto")
    assert sorted(restarted) == list(range(1, 41))
    assert max(abs(straight[s] - restarted[s]) for s in straight) <= 1e-6


# ------------------------------------------------------- a kill during a checkpoint write

_SAVE_SCRIPT = r"""
import sys, time
from pathlib import Path
import torch
import trainer.checkpoint as ckpt
from core.distributed import DistEnv
from core.sync import DenseAllReduce

run, marker = Path(sys.argv[1]), Path(sys.argv[2])
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
sync = DenseAllReduce(model, lambda ps: torch.optim.AdamW(ps, lr=1e-3))
env = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
run.mkdir(parents=True, exist_ok=True)
ckpt.save_checkpoint(run, 1, sync, env, {"note": "complete"}, keep_last=5)
real_save = torch.save
def save_then_hang(obj, f, *args, **kwargs):
    real_save(obj, f, *args, **kwargs)
    marker.touch()
    time.sleep(600)
torch.save = save_then_hang
with torch.no_grad():
    for p in model.parameters():
        p.add_(1.0)
ckpt.save_checkpoint(run, 2, sync, env, {"note": "killed"}, keep_last=5)
"""


def test_kill_during_checkpoint_write_keeps_the_previous_one(tmp_path):
    run, marker = tmp_path / "run", tmp_path / "writing"
    proc = subprocess.Popen([sys.executable, "-c", _SAVE_SCRIPT, str(run), str(marker)], cwd=REPO)
    deadline = time.time() + 120
    while not marker.exists():
        assert proc.poll() is None and time.time() < deadline, "the save script ended early"
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    from trainer.checkpoint import latest_checkpoint, list_checkpoints, read_meta, verify_checkpoint

    assert (run / ".step-2.tmp").is_dir(), "the kill must have hit the write"
    assert [p.name for p in list_checkpoints(run)] == ["step-1"]
    latest = latest_checkpoint(run)
    meta = read_meta(latest)
    verify_checkpoint(latest, meta, ["model.safetensors", "optimizer.pt", "rank-0.pt"])
    assert meta["note"] == "complete"


# ------------------------------------------------------------- corrupted checkpoints

@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_corrupted_checkpoint_is_refused_with_a_clear_message(tmp_path, prepared_cache, damage):
    args = _args(tmp_path, prepared_cache, "run_name=r", "train.steps=3", "train.ckpt_every=0")
    check(train_cli(args))
    target = tmp_path / "r" / "step-3" / ("model.safetensors" if damage == "truncate" else "optimizer.pt")
    data = bytearray(target.read_bytes())
    if damage == "truncate":
        data = data[: len(data) // 2]
    else:
        data[len(data) // 2] ^= 0x01
    target.write_bytes(bytes(data))
    proc = train_cli([*args, "train.steps=6", "resume=auto"])
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "corrupted" in proc.stderr and target.name in proc.stderr
    assert not (tmp_path / "r" / "step-6").exists()


# ---------------------------------------------------------------- non-finite steps

def _nan_body(rank, world, cache, out_dir, arm, nan_steps, max_nonfinite, expect_failure):
    from hydra import compose, initialize_config_dir

    from core.distributed import init_distributed
    from trainer.config import register_configs, to_config
    from trainer.trainer import Trainer

    register_configs()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[
            *TINY, *OPTIMIZER_ARMS[arm], f"data.cache_dir={cache}", f"out_dir={out_dir}", "run_name=nan",
            "train.steps=8", "train.ckpt_every=2", f"train.max_nonfinite_steps={max_nonfinite}"])
    cfg = to_config(cfg)
    trainer = Trainer(cfg, init_distributed(cfg.train.device, cfg.train.dist_timeout_s)).build()
    calls = {"n": 0}

    def poison(module, inputs, output):  # rank 1 only: the ranks must agree to skip
        if not module.training:
            return output
        calls["n"] += 1  # one forward per step (one micro-batch per rank)
        return output * float("nan") if rank == 1 and calls["n"] in nan_steps else output

    trainer.model.register_forward_hook(poison)
    if expect_failure:
        with pytest.raises(RuntimeError, match="non-finite steps in a row"):
            trainer.train()
        return
    summary = trainer.train()
    assert summary["skipped_steps"] == len(nan_steps) and summary["state"] == "completed"
    assert math.isfinite(summary["final_val_loss"])


@pytest.mark.parametrize("arm", sorted(OPTIMIZER_ARMS))
def test_nonfinite_step_is_skipped_and_counted(tmp_path, prepared_cache, arm):
    run_distributed(_nan_body, 2, (str(prepared_cache), str(tmp_path), arm, {3}, 3, False))
    records = read_metrics(tmp_path / "nan")
    assert [r["train/skipped_steps"] for r in records if "train/skipped_steps" in r][-1] == 1
    assert all(math.isfinite(r["train/loss"]) for r in records if "train/loss" in r and r["step"] != 3)


def test_too_many_nonfinite_steps_stop_the_run_keeping_the_last_good_checkpoint(tmp_path, prepared_cache):
    run_distributed(_nan_body, 2, (str(prepared_cache), str(tmp_path), "adams", {5, 6, 7, 8}, 3, True))
    run = tmp_path / "nan"
    assert json.loads((run / "status.json").read_text()) == {"state": "failed", "step": 6}
    assert sorted(p.name for p in run.iterdir() if p.name.startswith("step-")) == ["step-2", "step-4"]


# ---------------------------------------------------------------- a hung collective

def _hang_body(rank, world):
    from core.comm import CollectiveError, Collectives

    group = dist.new_group(ranks=[0, 1], timeout=datetime.timedelta(seconds=3), backend="gloo")
    if rank == 1:
        time.sleep(8)  # a peer that hangs: never joins the collective
        return
    start = time.time()
    with pytest.raises(CollectiveError) as info:
        Collectives().all_reduce(torch.ones(4), kind="grad_allreduce", group=group)
    assert time.time() - start < 7, "the timeout must bound the wait"
    message = str(info.value)
    assert "rank 0" in message and "all_reduce" in message and "grad_allreduce" in message


def test_hung_collective_fails_with_rank_and_operation():
    run_distributed(_hang_body, 2)


# ---------------------------------------------------------------- config fuzz

def _invalid_values(rng: random.Random):
    """Random invalid values for every numeric key a user sets, with the text the error must name."""
    pos = lambda: rng.uniform(1.0, 1e3)  # noqa: E731
    cases = []
    for _ in range(2):
        cases += [
            (["optimizer=scape", f"optimizer.sparsity={rng.choice([-1, 1]) * pos() if rng.random() < 0.5 else 1.0}"], "sparsity"),
            (["sdp=block", f"sdp.coverage={rng.choice([-pos(), 1.0 + pos(), 0.0])}"], "coverage"),
            ([f"train.global_batch_tokens={rng.choice([0, -512, 512 * rng.randint(1, 9) + rng.randint(1, 511)])}"], "global_batch_tokens"),
            ([f"train.micro_batch_size={rng.choice([0, -rng.randint(1, 64)])}"], "micro_batch_size"),
            ([f"optimizer.lr={rng.choice([0.0, -pos(), 'nan', 'inf'])}"], "optimizer.lr"),
            ([f"train.steps={rng.choice([0, -rng.randint(1, 10**6)])}"], "train.steps"),
            ([f"optimizer.warmup_steps={-rng.randint(1, 1000)}"], "warmup_steps"),
            ([f"train.eval_batches={rng.choice([0, -rng.randint(1, 9)])}"], "eval_batches"),
        ]
    return cases


def test_config_fuzz_every_invalid_value_fails_clearly_with_no_run_dir(tmp_path, prepared_cache):
    from hydra import compose, initialize_config_dir

    from trainer.config import register_configs
    from trainer.trainer import run

    register_configs()
    failures = []
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        for overrides, needle in _invalid_values(random.Random(20261129)):
            cfg = compose(config_name="config", overrides=[
                *TINY, f"data.cache_dir={prepared_cache}", f"out_dir={tmp_path}", "run_name=fuzz", *overrides])
            try:
                run(cfg)
                failures.append(f"{overrides}: accepted")
            except (ValueError, RuntimeError) as exc:
                if needle not in str(exc):
                    failures.append(f"{overrides}: message {str(exc)!r} does not name {needle}")
            if (tmp_path / "fuzz").exists():
                failures.append(f"{overrides}: left a run directory")
    assert not failures, "\n".join(failures)


def test_world_size_against_the_sdp_plan_fails_clearly(tmp_path, prepared_cache):
    proc = train_cli(_args(tmp_path, prepared_cache, "sdp=block", "sdp.coverage=0.5", "sdp.workers=4"),
                     nproc=2, timeout=180)
    assert proc.returncode != 0
    assert "sdp.workers" in proc.stderr + proc.stdout
    assert not any(tmp_path.iterdir())
