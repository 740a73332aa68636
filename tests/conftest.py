import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


@pytest.fixture(scope="session")
def prepared_cache(tmp_path_factory) -> Path:
    """The embedded corpus tokenized once per test session; pass as data.cache_dir=..."""
    from data import prepare
    from data.config import DataConfig, TokenizerConfig

    cache = tmp_path_factory.mktemp("data_cache")
    prepare(DataConfig(cache_dir=str(cache)), TokenizerConfig())
    return cache
