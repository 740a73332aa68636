"""The contract the trainer codes against: shapes, loss, determinism, checkpointing, FLOPs."""
from __future__ import annotations

import math

import pytest
import torch

from models import build_model, count_parameters, flops_per_token, load_model_config
from models.config import ModelConfig


def _small(family: str) -> ModelConfig:
    cfg = load_model_config(f"tiny_{family}")
    cfg.n_layer, cfg.d_model, cfg.ffn_hidden, cfg.vocab_size, cfg.seq_len = 2, 64, 128, 512, 32
    return cfg


@pytest.mark.parametrize("family", ["llama", "gpt"])
def test_logits_loss_and_grad(family: str) -> None:
    cfg = _small(family)
    torch.manual_seed(0)
    model = build_model(cfg)
    idx = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len))
    logits = model(idx)
    assert logits.shape == (2, cfg.seq_len, cfg.vocab_size)
    targets = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len))
    targets[0, :5] = -1
    loss = model(idx, targets)
    assert loss.dim() == 0 and loss.dtype == torch.float32
    expected = torch.nn.functional.cross_entropy(logits.view(-1, cfg.vocab_size),
                                                 targets.view(-1), ignore_index=-1)
    assert torch.allclose(loss, expected, atol=1e-6)
    # Small init: the loss starts near log(V).
    assert abs(loss.item() - math.log(cfg.vocab_size)) < 0.5
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


@pytest.mark.parametrize("family", ["llama", "gpt"])
def test_init_is_deterministic_and_follows_the_recipe(family: str) -> None:
    cfg = _small(family)
    cfg.n_layer = 8
    torch.manual_seed(3)
    first = build_model(cfg).state_dict()
    torch.manual_seed(3)
    second = build_model(cfg).state_dict()
    assert all(torch.equal(first[k], second[k]) for k in first)
    torch.manual_seed(4)
    third = build_model(cfg).state_dict()
    assert not torch.equal(first["blocks.0.attn.q_proj.weight"], third["blocks.0.attn.q_proj.weight"])
    # A big matrix so the sample std is tight: d_model x vocab.
    assert abs(first["tok_embeddings.weight"].std().item() - cfg.init_std) < 2e-3
    residual = first["blocks.0.attn.o_proj.weight"].std().item()
    assert abs(residual - cfg.init_std / math.sqrt(2 * cfg.n_layer)) < 1e-3


@pytest.mark.parametrize("family", ["llama", "gpt"])
def test_activation_checkpointing_gives_the_same_gradients(family: str) -> None:
    cfg = _small(family)
    torch.manual_seed(0)
    model = build_model(cfg)
    idx = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len))
    model(idx, idx).backward()
    plain = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    model.set_activation_checkpointing(True)
    model(idx, idx).backward()
    for name, param in model.named_parameters():
        assert torch.allclose(param.grad, plain[name], atol=1e-6), name


def test_tied_gpt_has_one_embedding_tensor_and_flops_formula() -> None:
    cfg = load_model_config("tiny_gpt")
    model = build_model(cfg, device="meta")
    names = set(model.state_dict())
    assert "lm_head.weight" not in names and "tok_embeddings.weight" in names
    assert count_parameters(model) == sum(p.numel() for p in model.state_dict().values())
    n = cfg.d_model * cfg.vocab_size + cfg.n_layer * (4 * cfg.d_model ** 2 + 2 * cfg.d_model * cfg.ffn_hidden)
    assert flops_per_token(cfg) == 6 * n + 12 * cfg.n_layer * cfg.d_model * cfg.seq_len


def test_flash_requested_without_flash_attn_fails_clearly() -> None:
    try:
        import flash_attn  # noqa: F401
        pytest.skip("flash-attn is installed here")
    except ImportError:
        pass
    cfg = _small("llama")
    cfg.attention = "flash"
    with pytest.raises(ValueError, match=r"model\.attention=sdpa"):
        build_model(cfg)
