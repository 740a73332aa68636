"""Hydra multirun: a run per sweep point, named by the swept values; the Vista launcher config."""
import json
import os
import subprocess

from tests.train_helpers import REPO, TINY, check, train_cli
from trainer.sweep import point_name, swept_keys


def test_point_names_carry_the_swept_values_and_the_job():
    overrides = ["+experiment=tiny_adamw", "train.steps=3", "optimizer.lr=0.001", "out_dir=/x"]
    assert point_name("tiny_adamw", overrides, swept={"optimizer.lr"}) == "tiny_adamw-lr0.001"
    assert point_name("tiny_adamw", overrides, "4242", {"optimizer.lr"}) == "tiny_adamw-lr0.001-4242"
    assert point_name("r", ["optimizer.lr=0.001", "sdp=block"]) == "r-lr0.001-sdpblock"  # no multirun.yaml
    long = [f"model.k{i}=value{i}" for i in range(12)]
    name = point_name("r", long)
    assert name.startswith("r-p") and len(name) < 20 and name != point_name("r", long[:-1])


def test_local_multirun_runs_the_points_one_after_another(tmp_path, prepared_cache):
    proc = check(train_cli(["-m", *TINY, f"out_dir={tmp_path}", f"data.cache_dir={prepared_cache}",
                            f"hydra.sweep.dir={tmp_path}/sweep", "train.steps=3", "optimizer.lr=1e-3,3e-3"]))
    assert swept_keys(tmp_path / "sweep") == {"optimizer.lr"}
    runs = [tmp_path / "tiny_llama-adamw-lr0.001", tmp_path / "tiny_llama-adamw-lr0.003"]
    for run, lr in zip(runs, (0.001, 0.003)):
        assert json.loads((run / "status.json").read_text()) == {"state": "completed", "step": 3}
        assert f"lr: {lr}" in (run / "config.yaml").read_text()
    assert (runs[0] / "wandb_id").read_text() != (runs[1] / "wandb_id").read_text()
    # One after another: the second point starts once the first has finished.
    assert os.path.getmtime(runs[0] / "summary.json") <= os.path.getmtime(runs[1] / "config.yaml")
    assert proc.stdout.index(f"run files in {runs[0]}") < proc.stdout.index(f"run {runs[1].name}:")


def test_vista_launcher_composes_with_the_vista_environment(tmp_path):
    from hydra import compose, initialize_config_dir

    from trainer.config import register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=["hydra/launcher=vista"], return_hydra_config=True)
    launcher = cfg.hydra.launcher
    assert launcher._target_.endswith("SlurmLauncher") and launcher.partition == "gh"
    assert launcher.tasks_per_node == 1 and launcher.signal_delay_s == 300
    assert launcher.additional_parameters.requeue is True
    assert launcher.gpus_per_node is None and launcher.mem_gb is None and launcher.gres is None
    # The setup lines run in the batch script: CPU mode loads no modules and pins one thread;
    # on TACC the run folders and the HF cache go to $SCRATCH.
    script = "\n".join([*launcher.setup, "echo OUT=$SCAPE_OUT_DIR HF=$HF_HOME OMP=$OMP_NUM_THREADS"])
    env = {k: v for k, v in os.environ.items() if k not in ("SCAPE_OUT_DIR", "HF_HOME", "OMP_NUM_THREADS")}
    out = subprocess.run(["bash", "-ec", script], env={**env, "SCAPE_CPU": "1", "SCRATCH": str(tmp_path)},
                         capture_output=True, text=True, check=True).stdout
    assert f"OUT={tmp_path}/scape-sdp/runs HF={tmp_path}/hf_home OMP=1" in out
    gpu = subprocess.run(["bash", "-ec", script], env={**env, "SCAPE_CPU": "0"}, capture_output=True, text=True)
    assert "module" in gpu.stderr  # GPU mode asks Lmod for the modules (absent here)


def test_the_time_limit_signal_checkpoints_and_requeues_the_point(monkeypatch):
    import signal
    import time

    from trainer import sweep
    from trainer.trainer import StopSignal

    saved = {s: signal.getsignal(s) for s in (signal.SIGUSR1, signal.SIGTERM, signal.SIGUSR2)}
    try:
        stop = StopSignal()
        signal.signal(signal.SIGUSR2, sweep._forward_to_stop_signal)  # what prepare_point installs
        os.kill(os.getpid(), signal.SIGUSR2)
        time.sleep(0.05)
        assert stop.requested, "submitit's USR2 must reach the Trainer's stop flag"
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)
    calls = []
    monkeypatch.setattr(sweep.subprocess, "run", lambda cmd, **kw: calls.append(cmd) or
                        subprocess.CompletedProcess(cmd, 0))
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("RANK", "0")
    sweep.finish_point({"state": "completed", "step": 9}, submitit_job=True)
    sweep.finish_point({"state": "preempted", "step": 5}, submitit_job=False)
    assert calls == []
    sweep.finish_point({"state": "preempted", "step": 5}, submitit_job=True)
    assert calls == [["scontrol", "requeue", "77"]]
    monkeypatch.setenv("SLURM_RESTART_COUNT", "50")
    sweep.finish_point({"state": "preempted", "step": 6}, submitit_job=True)
    assert len(calls) == 1, "SCAPE_MAX_RESTARTS (50) bounds the requeues"
