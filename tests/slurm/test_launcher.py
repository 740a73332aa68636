"""The Slurm launcher's GPU mode, with srun and scontrol stubbed: train.device=cuda and NCCL's
diagnostics reach the node task; CPU mode passes train.device=cpu and no NCCL settings."""
from __future__ import annotations

import os
import subprocess

import pytest

from tests.train_helpers import REPO

SCRIPT = """
set -euo pipefail
source slurm/launch_common.sh
scontrol() { echo node1; }
srun() { printf '%s\\n' "$@" > "$OUT/args"; env | grep -E '^(TORCH_NCCL|NCCL)_' | sort > "$OUT/env" || true; }
scape_launch +experiment=tiny_adamw logger=console
"""


def _launch(tmp_path, **env):
    full = dict(os.environ, SCAPE_ROOT=str(REPO), SLURM_JOB_ID="4242", SLURM_JOB_NODELIST="node1",
                SLURM_JOB_NUM_NODES="1", SCAPE_OUT_DIR=str(tmp_path / "runs"), OUT=str(tmp_path), **env)
    for key in [k for k in full if k.startswith(("NCCL_", "TORCH_NCCL_"))]:
        del full[key]
    proc = subprocess.run(["bash", "-c", SCRIPT], cwd=REPO, env=full, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    args = (tmp_path / "args").read_text().splitlines()
    nccl = dict(line.split("=", 1) for line in (tmp_path / "env").read_text().splitlines())
    return args, nccl


def test_gpu_mode_passes_device_cuda_and_nccl_diagnostics(tmp_path):
    args, nccl = _launch(tmp_path, SCAPE_GPUS_PER_NODE="1")
    assert "train.device=cuda" in args and "train.device=cpu" not in args
    assert nccl["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1" and nccl["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert int(nccl["TORCH_NCCL_TRACE_BUFFER_SIZE"]) > 0
    assert nccl["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"].startswith(str(tmp_path / "runs"))


def test_cpu_mode_passes_device_cpu_and_no_nccl_settings(tmp_path):
    args, nccl = _launch(tmp_path, SCAPE_CPU="1")
    assert "train.device=cpu" in args and "train.device=cuda" not in args
    assert nccl == {}


@pytest.mark.parametrize("override", ["train.device=cpu"])
def test_a_users_device_override_wins(tmp_path, override):
    full_script = SCRIPT.replace("logger=console", f"logger=console {override}")
    env = dict(os.environ, SCAPE_ROOT=str(REPO), SLURM_JOB_ID="4243", SLURM_JOB_NODELIST="node1",
               SLURM_JOB_NUM_NODES="1", SCAPE_OUT_DIR=str(tmp_path / "runs"), OUT=str(tmp_path),
               SCAPE_GPUS_PER_NODE="1")
    proc = subprocess.run(["bash", "-c", full_script], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    args = (tmp_path / "args").read_text().splitlines()
    assert args.count(override) == 1 and "train.device=cuda" not in args
