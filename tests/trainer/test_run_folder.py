"""A run owns its folder (trainer/run_folder.py): the lock and its staleness rule, a second writer
refused, a start that never ended recorded as killed, each start's config kept, and a resume of
another run refused naming the keys. The train.py tests run the refused start on 2 gloo ranks:
only rank 0 takes the lock, and every rank must end with its message (no hang)."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.train_helpers import REPO, TINY, check, read_metrics, train_cli
from trainer import run_folder
from trainer.run_folder import (LOCK_FILE, STARTS_FILE, RunFolder, RunFolderError, RunLock, defining_differences,
                                holder_record, holds_a_run, stale_reason)


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


@pytest.fixture
def sleeper():
    """A live process on this host that is not this one (a holder that is still running)."""
    proc = subprocess.Popen(["sleep", "600"])
    yield proc
    proc.kill()
    proc.wait()


def _write_lock(run_dir: Path, holder: dict, age_s: float = 0.0) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOCK_FILE
    path.write_text(json.dumps(holder))
    os.utime(path, (time.time() - age_s, time.time() - age_s))
    return path


def test_the_staleness_rule(sleeper):
    me = holder_record()
    here = {"host": me["host"], "started_at": "2026-01-01T00:00:00+00:00"}
    assert stale_reason({**here, "pid": _dead_pid()}, 0.0, me).endswith("is gone")
    assert stale_reason({**here, "pid": sleeper.pid}, 10_000.0, me) is None, "alive here: held however silent"
    reused = {**here, "pid": sleeper.pid, "pid_start": "1"}  # the pid now names a process started later
    assert "another process" in stale_reason(reused, 0.0, me)
    assert "this process" in stale_reason({**here, "pid": os.getpid()}, 0.0, me)
    away = {"host": "some-other-node", "pid": 1}
    assert stale_reason(away, run_folder.STALE_AFTER_S - 5, me) is None
    assert "heartbeat" in stale_reason(away, run_folder.STALE_AFTER_S + 5, me)


def test_a_live_holder_is_refused_by_name_and_a_dead_one_is_taken_over(tmp_path, sleeper, monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    run = tmp_path / "run"
    live = {"host": socket.gethostname(), "pid": sleeper.pid, "job_id": "4242", "started_at": "then"}
    path = _write_lock(run, live)
    with pytest.raises(RunFolderError) as refused:
        RunLock(run).acquire()
    message = str(refused.value)
    assert f"pid {sleeper.pid}" in message and "Slurm job 4242" in message and socket.gethostname() in message
    assert f"delete {path}" in message and json.loads(path.read_text()) == live, "the holder's lock is untouched"
    away = {"host": "gone-node", "pid": 7, "job_id": None, "started_at": "then"}
    _write_lock(run, away, age_s=run_folder.STALE_AFTER_S + 60)
    lock = RunLock(run).acquire()
    assert "gone-node" in lock.taken_over and "heartbeat" in lock.taken_over
    assert json.loads(path.read_text())["pid"] == os.getpid() and lock.held()
    other = subprocess.run([sys.executable, "-c", f"from trainer.run_folder import RunLock; RunLock({str(run)!r}).acquire()"],
                           cwd=REPO, capture_output=True, text=True)  # another process: refused, naming this one
    assert other.returncode != 0 and f"pid {os.getpid()}" in other.stderr and "is in use by" in other.stderr
    lock.release()
    assert not path.exists() and not holds_a_run(run)


def test_a_requeued_job_waits_for_its_previous_allocation(tmp_path, sleeper, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "777")
    monkeypatch.setattr(run_folder, "REQUEUE_WAIT_S", 30.0)
    run = tmp_path / "run"
    path = _write_lock(run, {"host": socket.gethostname(), "pid": sleeper.pid, "job_id": "777", "started_at": "x"})
    started = time.time()
    releaser = subprocess.Popen(["sh", "-c", f"sleep 3; rm {path}"])  # the old allocation's epilogue ends
    lock = RunLock(run).acquire()
    assert 2.5 < time.time() - started < 30 and lock.held()
    lock.release()
    releaser.wait()


def test_only_keys_that_define_the_run_refuse_a_resume():
    first = {"model": {"name": "llama500m", "seq_len": 1024, "kernels": "triton"},
             "optimizer": {"name": "scape", "lr": 1e-3, "shard": True},
             "data": {"name": "fineweb", "cache_dir": "/a", "prefetch": 4},
             "train": {"global_batch_tokens": 8192, "steps": 100, "micro_batch_size": 8},
             "sdp": {"kind": "none"}, "seed": 1}
    same = json.loads(json.dumps(first))
    same["optimizer"]["lr"], same["data"]["cache_dir"], same["model"]["kernels"] = 3e-4, "/b", "torch"
    same["train"]["steps"], same["train"]["micro_batch_size"], same["data"]["prefetch"] = 900, 4, 0
    assert defining_differences(first, same) == []
    other = json.loads(json.dumps(same))
    other["model"]["seq_len"], other["train"]["global_batch_tokens"], other["sdp"]["kind"] = 2048, 4096, "block"
    other["optimizer"]["shard"], other["tokenizer"] = False, {"vocab_size": 8192}  # a key the first lacks
    assert [k for k, _, _ in defining_differences(first, other)] == [
        "model.seq_len", "optimizer.shard", "sdp.kind", "train.global_batch_tokens"]


def test_every_start_keeps_its_config_and_config_yaml_is_never_rewritten(tmp_path):
    run = tmp_path / "run"
    for n, lr in enumerate((1e-3, 5e-4, 2e-4), start=1):
        folder = RunFolder(run, is_main=True)
        folder.claim({"optimizer": {"lr": lr}}, "none" if n == 1 else "auto")
        name = folder.record_start({"optimizer": {"lr": lr}}, None)
        folder.status("completed", n)
        folder.release()
        assert name == ("config.yaml" if n == 1 else f"config-{n}.yaml") and folder.start == n
    assert "lr: 0.001" in (run / "config.yaml").read_text() and "lr: 0.0002" in (run / "config-3.yaml").read_text()
    records = [json.loads(line) for line in (run / STARTS_FILE).read_text().splitlines()]
    assert [(r.get("start"), r.get("config"), r.get("ended")) for r in records] == [
        (1, "config.yaml", None), (1, None, "completed"), (2, "config-2.yaml", None), (2, None, "completed"),
        (3, "config-3.yaml", None), (3, None, "completed")]
    assert records[0]["pid"] == os.getpid() and records[0]["host"] == socket.gethostname()


# ------------------------------------------------------------------------ through train.py

def _args(tmp_path, cache, *extra):
    return [*TINY, f"out_dir={tmp_path}", f"data.cache_dir={cache}", "train.ckpt_every=0", *extra]


def _start(args) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled")
    return subprocess.Popen([sys.executable, "train.py", *args], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _wait_for_steps(proc: subprocess.Popen, run: Path, steps: int = 2) -> None:
    deadline = time.time() + 240
    while time.time() < deadline:
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        if (run / "metrics.jsonl").is_file() and len(read_metrics(run)) >= steps:
            return
        time.sleep(0.1)
    raise AssertionError("the run did not start in time")


def _snapshot(run: Path) -> dict:
    return {p.name: p.read_bytes() for p in sorted(run.iterdir()) if p.is_file() and p.name != LOCK_FILE}


def test_a_second_writer_is_refused_on_two_ranks_naming_the_holder(tmp_path, prepared_cache):
    run = tmp_path / "busy"
    first = _start(_args(tmp_path, prepared_cache, "run_name=busy", "train.steps=100000"))
    try:
        _wait_for_steps(first, run)
        config = (run / "config.yaml").read_bytes()
        second = train_cli(_args(tmp_path, prepared_cache, "run_name=busy", "resume=auto"), nproc=2, timeout=240)
        assert second.returncode != 0 and "is in use by" in second.stderr, second.stderr[-3000:]
        assert f"pid {first.pid}" in second.stderr and socket.gethostname() in second.stderr
        assert f"delete {run / LOCK_FILE}" in second.stderr
        assert first.poll() is None, "the holder keeps running"
        assert (run / "config.yaml").read_bytes() == config and not (run / "config-2.yaml").exists()
        assert json.loads((run / LOCK_FILE).read_text())["pid"] == first.pid
    finally:
        first.send_signal(signal.SIGTERM)  # a clean stop at the next step, with a checkpoint
        out = first.communicate(timeout=240)[0]
    assert first.returncode == 0, out[-3000:]
    assert json.loads((run / "status.json").read_text())["state"] == "preempted"
    assert not (run / LOCK_FILE).exists(), "the lock is let go at exit"
    starts = [json.loads(line) for line in (run / STARTS_FILE).read_text().splitlines()]
    assert [(r["start"], r.get("ended")) for r in starts] == [(1, None), (1, "preempted")], "the refused start left no trace"


def test_a_killed_start_is_recorded_and_a_resume_of_another_model_refused(tmp_path, prepared_cache):
    """The issue's case: a run killed without a word (status "running" forever), then resume=auto
    with another model: refused, naming the keys, with or without a checkpoint; config.yaml kept."""
    run = tmp_path / "big"
    killed = _start(_args(tmp_path, prepared_cache, "run_name=big", "train.steps=100000"))
    _wait_for_steps(killed, run)
    killed.send_signal(signal.SIGKILL)
    killed.communicate(timeout=60)
    assert json.loads((run / "status.json").read_text())["state"] == "running"
    assert json.loads((run / LOCK_FILE).read_text())["pid"] == killed.pid, "a SIGKILL leaves the lock"
    config, wandb_id = (run / "config.yaml").read_bytes(), (run / "wandb_id").read_text()

    other_model = _args(tmp_path, prepared_cache, "run_name=big", "resume=auto", "model.d_model=32",
                        "model.n_head=2", "model.n_kv_head=1")
    proc = train_cli(other_model, nproc=2, timeout=240)
    assert proc.returncode != 0, proc.stderr[-3000:]  # torchrun: 1 when a rank failed
    assert "model.d_model=64" in proc.stderr and "model.d_model=32" in proc.stderr and "model.n_head" in proc.stderr
    assert "another run_name" in proc.stderr and str(run / "config.yaml") in proc.stderr
    assert "never ended" in proc.stdout, "the killed start is noted even by a refused start"
    after_refusal = _snapshot(run)
    assert after_refusal["config.yaml"] == config and (run / "wandb_id").read_text() == wandb_id
    assert not (run / LOCK_FILE).exists() and not (run / "config-2.yaml").exists()
    assert json.loads((run / "status.json").read_text())["state"] == "killed"
    ends = [json.loads(line) for line in (run / STARTS_FILE).read_text().splitlines()]
    assert ends[-1]["start"] == 1 and ends[-1]["ended"] == "killed" and "without a word" in ends[-1]["reason"]

    # the same run continues (from scratch: no checkpoint), a new config file for the new start
    proc = check(train_cli(_args(tmp_path, prepared_cache, "run_name=big", "resume=auto", "train.steps=3"), nproc=2))
    assert (run / "config.yaml").read_bytes() == config and "steps: 3" in (run / "config-2.yaml").read_text()
    assert (run / "wandb_id").read_text() == wandb_id
    # with a checkpoint now (the end of that start): another optimizer is refused as well
    assert (run / "step-3" / "meta.json").is_file()
    before = _snapshot(run)
    proc = train_cli(_args(tmp_path, prepared_cache, "run_name=big", "resume=auto", "optimizer=adams"), nproc=2)
    assert proc.returncode != 0 and "optimizer.name=adamw" in proc.stderr and "optimizer.name=adams" in proc.stderr
    assert _snapshot(run) == before and not (run / "config-3.yaml").exists(), "the refusal wrote nothing"
