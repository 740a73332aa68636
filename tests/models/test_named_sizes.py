"""Pinned shapes of the named sizes: exact parameter counts, counted on the meta device."""
from __future__ import annotations

import glob
import os

import pytest
import yaml

from models import build_model, count_parameters, flops_per_token, load_model_config, matmul_parameters
from models.config import ModelConfig

# Total distinct parameters (a tied embedding counts once) and N of 6N (models.matmul_parameters).
EXPECTED = {
    "tiny_llama": (7_342_336, 5_242_880),
    "tiny_gpt": (5_322_240, 5_242_880),
    "gpt345m": (354_871_296, 353_501_184),
    "llama500m": (557_774_080, 516_751_360),
    "llama1_8b": (1_775_372_288, 1_709_703_168),
}
CONF_DIR = os.path.join(os.path.dirname(__file__), "..", "..", "conf", "model")


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_parameter_counts(name: str) -> None:
    cfg = load_model_config(name)
    model = build_model(cfg, device="meta")
    assert all(p.is_meta for p in model.parameters())
    total, matmul = EXPECTED[name]
    assert count_parameters(model) == total
    assert matmul_parameters(cfg) == matmul
    assert flops_per_token(cfg) == 6 * matmul + 12 * cfg.n_layer * cfg.d_model * cfg.seq_len


def test_every_model_yaml_is_a_complete_model_config() -> None:
    files = sorted(glob.glob(os.path.join(CONF_DIR, "*.yaml")))
    assert {os.path.basename(f)[:-5] for f in files} >= set(EXPECTED)
    for path in files:
        with open(path) as f:
            fields = yaml.safe_load(f)
        cfg = ModelConfig(**fields)  # an unknown key raises here
        assert cfg.name == os.path.basename(path)[:-5]


def test_named_shapes_follow_the_papers() -> None:
    gpt = load_model_config("gpt345m")
    assert (gpt.n_layer, gpt.d_model, gpt.n_head, gpt.seq_len, gpt.vocab_size, gpt.tie_embeddings) == (
        24, 1024, 16, 1024, 50304, True)
    for name in ("llama500m", "llama1_8b"):
        cfg = load_model_config(name)
        assert cfg.vocab_size == 32000 and not cfg.tie_embeddings and cfg.family == "llama"
    for name in ("tiny_llama", "tiny_gpt"):
        cfg = load_model_config(name)
        assert (cfg.vocab_size, cfg.seq_len) == (8192, 256)
