"""train.init_from=DIR: a run starts from a folder's weights (an HF import), fresh optimizer, step 0."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from core.checkpoint import CheckpointError, read_weights
from core.distributed import init_distributed
from models import build_model
from models.config import ModelConfig
from models.hf import main as hf_main
from models.hf import write_checkpoint
from tests.train_helpers import TINY, compose_config, read_metrics
from trainer.config import ConfigError, to_config
from trainer.trainer import Trainer


def _config(tmp_path, cache, *extra):
    return to_config(compose_config([*TINY, f"data.cache_dir={cache}", f"out_dir={tmp_path}", "train.steps=2", *extra]))


def _imported_folder(tmp_path, cfg: ModelConfig):
    """Weights unlike a fresh model's, exported to HF and imported back: the folder HF import writes."""
    torch.manual_seed(123)
    model = build_model(cfg)
    write_checkpoint(model.state_dict(), cfg, str(tmp_path / "source"))
    hf_main(["export", "--checkpoint", str(tmp_path / "source"), "--out", str(tmp_path / "hf")])
    hf_main(["import", "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "init")])
    return tmp_path / "init", model.state_dict()


def test_a_run_starts_from_an_hf_import_with_a_fresh_optimizer_at_step_0(tmp_path, prepared_cache):
    probe = _config(tmp_path / "runs", prepared_cache, "run_name=probe")
    folder, weights = _imported_folder(tmp_path, probe.model)
    cfg = _config(tmp_path / "runs", prepared_cache, "run_name=init", f"train.init_from={folder}")
    trainer = Trainer(cfg, init_distributed("cpu")).build()
    try:
        assert trainer.start_step == 0 and not trainer.sync.optimizer.state
        state = trainer.model.state_dict()
        assert all(torch.equal(state[name], tensor) for name, tensor in weights.items())
        summary = trainer.train()
    finally:
        trainer.close()
    assert summary["state"] == "completed" and summary["step"] == 2
    assert [r["step"] for r in read_metrics(tmp_path / "runs" / "init") if "train/loss" in r] == [1, 2]
    _, meta = read_weights(tmp_path / "runs" / "init" / "step-2")
    assert meta["config"]["train"]["init_from"] == str(folder)


def test_init_from_refuses_a_missing_or_damaged_folder(tmp_path, prepared_cache):
    with pytest.raises(ConfigError, match="train.init_from=.*no such folder"):
        _config(tmp_path / "runs", prepared_cache, f"train.init_from={tmp_path / 'nope'}")
    probe = _config(tmp_path / "runs", prepared_cache, "run_name=probe")
    write_checkpoint(build_model(probe.model).state_dict(), dataclasses.replace(probe.model), str(tmp_path / "w"))
    with open(tmp_path / "w" / "model.safetensors", "r+b") as f:
        f.seek(-8, 2)
        f.write(b"\x00" * 8)
    cfg = _config(tmp_path / "runs", prepared_cache, "run_name=bad", f"train.init_from={tmp_path / 'w'}")
    trainer = Trainer(cfg, init_distributed("cpu"))
    with pytest.raises(CheckpointError, match="corrupted"):
        trainer.build()
    trainer.close()
