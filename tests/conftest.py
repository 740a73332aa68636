import os
import sys
from pathlib import Path

import pytest

# Triton reads TRITON_INTERPRET when it is first imported: its own library functions (tl.sum, ...)
# are decorated then, and a test module that imports torch._inductor during collection imports
# Triton long before tests/scape/test_kernels.py could set it. The CPU test suite runs every
# Triton kernel in the interpreter (Inductor's CPU backend does not use Triton).
os.environ.setdefault("TRITON_INTERPRET", "1")

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


@pytest.fixture(scope="session")
def prepared_cache(tmp_path_factory) -> Path:
    """The embedded corpus tokenized once per test session; pass as data.cache_dir=..."""
    from hydra import compose, initialize_config_dir

    from data import prepare
    from tests.train_helpers import TINY_DATA
    from trainer.config import register_configs

    cache = tmp_path_factory.mktemp("data_cache")
    register_configs()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[*TINY_DATA, f"data.cache_dir={cache}"])
    prepare(cfg.data, cfg.tokenizer)
    return cache
