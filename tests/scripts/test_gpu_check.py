"""scripts/gpu_check.sh parses, and refuses at once without CUDA (it runs for real on a GPU machine)."""
from __future__ import annotations

import os
import subprocess

import pytest
import torch

from tests.train_helpers import REPO

SCRIPT = REPO / "scripts" / "gpu_check.sh"


def test_gpu_check_is_valid_bash_and_its_python_parses():
    import ast
    import re

    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
    blocks = re.findall(r"<<'PY'[^\n]*\n(.*?)\nPY\n", SCRIPT.read_text(), re.S)
    assert len(blocks) == 4
    for block in blocks:
        ast.parse(block)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_gpu_check_refuses_cleanly_without_cuda():
    proc = subprocess.run(["bash", str(SCRIPT)], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert proc.returncode == 2
    assert "CUDA is not available" in proc.stderr and torch.__version__ in proc.stderr
    assert "===" not in proc.stdout  # no section started
