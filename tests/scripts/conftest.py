"""Fixtures shared by the evaluation and sampling tests."""
from pathlib import Path

import pytest
import torch

from tests.scripts.tiny_checkpoint import make_tiny_checkpoint


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """Tiny matmuls on a shared 2-core machine: extra threads only spin (10x the CPU time)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def checkpoint(one_torch_thread, tmp_path_factory) -> Path:
    """A real tiny checkpoint (trained briefly), one per test module."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt"))
