"""Trainer checkpoint -> `python -m models.hf export` -> transformers loads it -> import returns it."""
from __future__ import annotations

import dataclasses
import os

import pytest
import torch
from core.checkpoint import read_weights, write_model_folder
from models import build_model, load_model_config
from models.hf import import_hf, main


def _fake_checkpoint(run_dir: str, family: str, tokenizer_path: str | None) -> tuple:
    cfg = load_model_config(f"tiny_{family}")
    cfg.n_layer, cfg.d_model, cfg.ffn_hidden, cfg.vocab_size, cfg.seq_len = 2, 64, 192, 300, 32
    torch.manual_seed(0)
    model = build_model(cfg)
    step_dir = os.path.join(run_dir, "step-10")
    meta = {"step": 10, "config": {"model": dataclasses.asdict(cfg), "optimizer": {"name": "adamw"}}}
    if tokenizer_path:
        meta["tokenizer_path"] = tokenizer_path
    write_model_folder(step_dir, model.state_dict(), meta)
    return cfg, model, step_dir


def _tiny_tokenizer(path: str) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "hello": 1, "world": 2, "<|endoftext|>": 3}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(path)


@pytest.mark.parametrize("family", ["llama", "gpt"])
def test_export_load_import_round_trip(tmp_path, family: str) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer_file = str(tmp_path / "tokenizer.json")
    _tiny_tokenizer(tokenizer_file)
    cfg, model, step_dir = _fake_checkpoint(str(tmp_path / "run"), family, tokenizer_file)
    out_dir = str(tmp_path / "hf")
    main(["export", "--checkpoint", step_dir, "--out", out_dir])

    hf_model = AutoModelForCausalLM.from_pretrained(out_dir)
    assert type(hf_model).__name__ == ("LlamaForCausalLM" if family == "llama" else "GPT2LMHeadModel")
    idx = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len))
    with torch.no_grad():
        torch.testing.assert_close(hf_model(input_ids=idx).logits, model(idx), atol=1e-5, rtol=0)
    tokenizer = AutoTokenizer.from_pretrained(out_dir)
    assert tokenizer("hello world")["input_ids"] == [1, 2]
    assert tokenizer.eos_token == "<|endoftext|>" and hf_model.config.eos_token_id == 3

    imported, imported_cfg = import_hf(out_dir)
    assert (imported_cfg.family, imported_cfg.n_layer, imported_cfg.d_model) == (family, 2, 64)
    original = model.state_dict()
    assert set(imported.state_dict()) == set(original)
    for name, tensor in imported.state_dict().items():
        assert torch.equal(tensor, original[name]), name


def test_import_cli_writes_a_trainer_checkpoint(tmp_path) -> None:
    cfg, model, step_dir = _fake_checkpoint(str(tmp_path / "run"), "llama", None)
    main(["export", "--checkpoint", step_dir, "--out", str(tmp_path / "hf"), "--dtype", "bf16"])
    main(["import", "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "back" / "step-0")])
    back, meta = read_weights(tmp_path / "back" / "step-0")  # checksummed like a trainer checkpoint
    assert meta["config"]["model"]["n_kv_head"] == cfg.n_kv_head and meta["step"] == 0
    for name, tensor in model.state_dict().items():
        assert back[name].dtype == torch.bfloat16
        assert torch.equal(back[name], tensor.to(torch.bfloat16)), name
