import math

import pytest

from trainer.config import ConfigError, accumulation_steps
from core.schedule import lr_at


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


def test_wsd_holds_the_rate_then_decays_linearly_over_the_last_fraction():
    # 10 warm-up steps, 100 in all, the last 20% (steps 81..100) decay linearly to the floor.
    lrs = {s: lr_at(s, 1.0, 10, 100, 0.1, "wsd", 0.2) for s in range(1, 101)}
    assert lrs[5] == pytest.approx(0.5) and lrs[10] == pytest.approx(1.0)
    assert all(lrs[s] == 1.0 for s in range(10, 81)), "stable phase at the full rate"
    assert lrs[90] == pytest.approx(1.0 - 0.9 * 10 / 20)
    assert all(lrs[s] > lrs[s + 1] for s in range(80, 100)), "strictly decaying"
    assert lrs[100] == pytest.approx(0.1)
    # The decay never reaches into the warm-up, even when the fraction asks for it.
    assert lr_at(10, 1.0, 10, 20, 0.0, "wsd", 0.9) == pytest.approx(1.0)
    assert lr_at(15, 1.0, 10, 20, 0.0, "wsd", 0.9) == pytest.approx(0.5)


def test_cosine_is_unchanged_by_the_wsd_keys():
    assert lr_at(60, 1.0, 10, 110, 0.1, "cosine", 0.5) == lr_at(60, 1.0, 10, 110, 0.1)


def test_schedule_keys_are_checked_at_start_up():
    from hydra import compose, initialize_config_dir

    from tests.conftest import REPO
    from trainer.config import register_configs, to_config

    register_configs()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = to_config(compose(config_name="config", overrides=["optimizer.lr_schedule=wsd",
                                                                 "optimizer.decay_fraction=0.1"]))
        assert (cfg.optimizer.lr_schedule, cfg.optimizer.decay_fraction) == ("wsd", 0.1)
        with pytest.raises(ValueError, match="optimizer.lr_schedule must be cosine or wsd"):
            to_config(compose(config_name="config", overrides=["optimizer.lr_schedule=linear"]))
        with pytest.raises(ValueError, match=r"optimizer.decay_fraction must lie in \(0, 1\]"):
            to_config(compose(config_name="config", overrides=["optimizer.decay_fraction=0"]))
