"""Device selection: CUDA asked for and missing, and more local ranks than GPUs, fail clearly."""
from __future__ import annotations

import pytest
import torch

from core.distributed import cuda_device_for, init_distributed, runtime_summary
from tests.train_helpers import TINY, train_cli


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_requested_without_cuda_names_the_torch_build_and_the_fix():
    with pytest.raises(RuntimeError) as info:
        init_distributed("cuda")
    message = str(info.value)
    assert torch.__version__ in message and "train.device=cpu" in message and "docs/CLUSTER.md" in message


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_train_py_with_device_cuda_fails_before_training(tmp_path):
    proc = train_cli([*TINY, "train.device=cuda", f"out_dir={tmp_path}", "run_name=r"])
    assert proc.returncode != 0
    assert "CUDA is not available" in proc.stderr and torch.__version__ in proc.stderr
    assert not (tmp_path / "r").exists()


def test_two_local_ranks_on_one_gpu_are_refused():
    with pytest.raises(RuntimeError, match="2 local ranks but 1 GPU.*--nproc_per_node=1.*train.device=cpu"):
        cuda_device_for(1, 2, 1)
    assert cuda_device_for(1, 2, 2) == torch.device("cuda", 1)


def test_runtime_summary_says_why_it_runs_on_the_cpu():
    line = runtime_summary(init_distributed("cpu"), "cpu")
    assert line.startswith(f"runtime: torch {torch.__version__}") and "train.device=cpu" in line
