import math

import pytest

from trainer.config import ConfigError, accumulation_steps
from trainer.schedule import lr_at


def test_warmup_then_cosine_to_floor():
    lrs = [lr_at(s, 1.0, 10, 110, 0.1) for s in range(1, 111)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:])), "monotone decay after warm-up"
    assert lrs[-1] == pytest.approx(0.1)
    assert lr_at(60, 1.0, 10, 110, 0.1) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))


def test_accumulation_from_token_budget():
    assert accumulation_steps(8192, 4, 256, 2) == 4
    with pytest.raises(ConfigError, match="global_batch_tokens=1000"):
        accumulation_steps(1000, 4, 64, 2)
