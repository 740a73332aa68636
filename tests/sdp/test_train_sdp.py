"""End to end through train.py on 2 gloo processes with B-SDP: the trainer's view of SDP
(flop-matched steps, sdp/ metrics, full-model validation, full-model checkpoint, HF export)."""
import json

import pytest
import torch
from safetensors.torch import load_file

from tests.train_helpers import TINY, check, read_metrics, train_cli, train_losses


@pytest.mark.slow  # two train.py ranks plus transformers: minutes on a busy 2-core CPU
def test_train_py_runs_bsdp_with_full_model_validation_and_checkpoints(tmp_path, prepared_cache):
    proc = check(train_cli([*TINY, f"out_dir={tmp_path}", f"data.cache_dir={prepared_cache}", "run_name=bsdp",
                            "sdp=block", "sdp.coverage=0.5", "sdp.flop_matched=true", "train.steps=3",
                            "train.eval_every=3", "train.ckpt_every=0"], nproc=2))
    run = tmp_path / "bsdp"
    assert sorted(train_losses(run)) == list(range(1, 7)), "flop_matched at C = 0.5 doubles the steps"
    records = read_metrics(run)
    steps = [r for r in records if "train/loss" in r]
    assert all(r["sdp/params_held_fraction"] < 1.0 and r["comm/bytes_sdp_grad"] > 0 for r in steps)
    assert [r["step"] for r in records if "val/loss" in r] == [3, 6]
    assert "sdp: block cyclic C=0.5" in proc.stdout
    # the checkpoint holds the full model (both blocks), whichever worker held what
    weights = load_file(str(run / "step-6" / "model.safetensors"))
    assert {"blocks.0.attn.q_proj.weight", "blocks.1.attn.q_proj.weight"} <= set(weights)
    assert all(torch.isfinite(w).all() for w in weights.values())
    summary = json.loads((run / "summary.json").read_text())
    assert summary["state"] == "completed"
    # HF export of an SDP checkpoint works as for dense runs: transformers computes our logits
    from transformers import AutoModelForCausalLM

    from models import build_model
    from models.config import ModelConfig
    from models.hf import export_checkpoint

    export_checkpoint(str(run / "step-6"), str(tmp_path / "hf"))
    hf_model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    meta = json.loads((run / "step-6" / "meta.json").read_text())
    ours = build_model(ModelConfig(**meta["config"]["model"])).eval()
    ours.load_state_dict(weights)
    tokens = torch.randint(0, 512, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.allclose(hf_model(tokens).logits, ours(tokens), atol=1e-4)
