"""Run train.py as a user does (python or torchrun) with a debug-size model, and read its logs;
load a script of scripts/ as a module."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Sequence

REPO = Path(__file__).resolve().parents[1]


def load_script(name: str):
    """scripts/NAME.py as a module (scripts/ is not a package: users run the files)."""
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module

# The embedded corpus without the stdlib docstrings: a quarter of the text, tokenized in seconds.
TINY_DATA = ["data.embedded_docstrings=false"]

# A debug-size Llama (torchtitan's habit): 2 blocks of width 64, 64-token windows, 512-token steps.
TINY = ["model.n_layer=2", "model.d_model=64", "model.n_head=4", "model.n_kv_head=2",
        "model.ffn_hidden=192", "model.seq_len=64", "train.micro_batch_size=4",
        "train.global_batch_tokens=512", "logger=console", "train.log_every=1", "train.eval_every=0",
        "train.eval_batches=2", "optimizer.warmup_steps=2", "optimizer.lr=3e-3", *TINY_DATA]


def compose_config(overrides: Sequence[str]):
    """conf/config.yaml with ``overrides`` as train.py composes it (Hydra's DictConfig, unresolved)."""
    from hydra import compose, initialize_config_dir

    from trainer.config import register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def train_cli(overrides: Sequence[str], nproc: int = 1, timeout: int = 300,
              env: Dict[str, str] | None = None) -> subprocess.CompletedProcess:
    if nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               "train.py", *overrides]
    else:
        cmd = [sys.executable, "train.py", *overrides]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled", **(env or {})}
    return subprocess.run(cmd, cwd=REPO, env=full_env, capture_output=True, text=True, timeout=timeout)


def check(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, f"exit {proc.returncode}\nSTDOUT:\n{proc.stdout[-4000:]}\nSTDERR:\n{proc.stderr[-6000:]}"
    return proc


def read_metrics(run_dir: Path) -> List[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def train_losses(run_dir: Path) -> Dict[int, float]:
    return {r["step"]: r["train/loss"] for r in read_metrics(run_dir) if "train/loss" in r}
