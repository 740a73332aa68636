"""SDP subnetworks: same names, sliced shapes, the full model's init, and the same function as the
full model with the unheld parts zeroed out."""
from __future__ import annotations

import pytest
import torch

from models import build_model, count_parameters, flops_per_token, load_model_config, matmul_parameters
from models.config import ModelConfig
from models.subnet import SubnetSpec, parameter_slices, scatter_state_dict, slice_state_dict


def _cfg(family: str) -> ModelConfig:
    cfg = load_model_config(f"tiny_{family}")
    cfg.n_layer, cfg.d_model, cfg.vocab_size, cfg.seq_len = 3, 64, 256, 16
    cfg.ffn_hidden = 96
    if family == "llama":
        cfg.n_head, cfg.n_kv_head = 4, 2  # groups of 2 query heads
    return cfg


SPECS = {
    "blocks": SubnetSpec(blocks=[0, 2]),
    "neurons": SubnetSpec(heads={0: [2, 3], 1: [0, 1, 2, 3], 2: []},
                          mlp_units={0: [1, 5, 7, 90], 2: list(range(0, 96, 3))}),
    "both": SubnetSpec(blocks=[1, 2], heads={1: [0, 1]}, mlp_units={2: [0, 95]}),
}


def _zero_unheld(full_sd: dict, cfg: ModelConfig, spec: SubnetSpec) -> dict:
    """The full model's weights with everything the subnetwork lacks set to zero, so that the
    missing heads/units/blocks contribute nothing to the residual stream."""
    zeroed = {k: v.clone() for k, v in full_sd.items()}
    head_dim = cfg.d_model // cfg.n_head
    held = set(spec.held_blocks(cfg.n_layer))
    down = "mlp.down_proj.weight" if cfg.family == "llama" else "mlp.proj.weight"
    for layer in range(cfg.n_layer):
        prefix = f"blocks.{layer}."
        if layer not in held:
            for name in zeroed:
                if name.startswith(prefix + "attn.o_proj") or name.startswith(prefix + down.rsplit(".", 1)[0]):
                    zeroed[name].zero_()
            continue
        for h in set(range(cfg.n_head)) - set(spec.kept_heads(layer, cfg.n_head)):
            zeroed[prefix + "attn.o_proj.weight"][:, h * head_dim:(h + 1) * head_dim] = 0
        for unit in set(range(cfg.ffn_hidden)) - set(spec.kept_units(layer, cfg.ffn_hidden)):
            zeroed[prefix + down][:, unit] = 0
    return zeroed


@pytest.mark.parametrize("family", ["llama", "gpt"])
@pytest.mark.parametrize("kind", sorted(SPECS))
def test_subnetwork_is_the_full_model_restricted(family: str, kind: str) -> None:
    cfg, spec = _cfg(family), SPECS[kind]
    torch.manual_seed(7)
    full = build_model(cfg)
    torch.manual_seed(7)
    sub = build_model(cfg, spec)
    full_sd, sub_sd = full.state_dict(), sub.state_dict()

    # Names: the full model's, minus unheld blocks; values: the full init, sliced.
    expected = slice_state_dict(full_sd, cfg, spec)
    assert set(sub_sd) == set(expected)
    assert set(sub_sd) <= set(full_sd)
    for name, tensor in sub_sd.items():
        assert torch.equal(tensor, expected[name]), name
    assert count_parameters(sub) < count_parameters(full)

    # Function: the subnetwork computes what the full model computes with the rest zeroed.
    with torch.no_grad():
        for name, param in full.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                param.add_(0.1 * torch.randn_like(param))
    full_sd = full.state_dict()
    sub.load_state_dict(slice_state_dict(full_sd, cfg, spec))
    full.load_state_dict(_zero_unheld(full_sd, cfg, spec))
    idx = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len))
    with torch.no_grad():
        torch.testing.assert_close(sub(idx), full(idx), atol=1e-5, rtol=0)
    sub(idx, idx).backward()
    # Every held tensor gets a gradient, also in a block that keeps no head (layer 2, neurons).
    assert all(p.grad is not None for p in sub.parameters())


@pytest.mark.parametrize("family", ["llama", "gpt"])
def test_scatter_writes_back_only_what_is_held(family: str) -> None:
    cfg, spec = _cfg(family), SPECS["both"]
    torch.manual_seed(0)
    full_sd = build_model(cfg).state_dict()
    sub_sd = {k: torch.randn_like(v) for k, v in slice_state_dict(full_sd, cfg, spec).items()}
    target = {k: torch.zeros_like(v) for k, v in full_sd.items()}
    scatter_state_dict(sub_sd, target, cfg, spec)
    # Reading the written tensors back gives exactly what was scattered ...
    again = slice_state_dict(target, cfg, spec)
    for name, tensor in sub_sd.items():
        assert torch.equal(again[name], tensor), name
    # ... and nothing else changed: unheld block 0, unkept heads of block 1, unkept units of 2.
    assert all(not target[k].any() for k in target if k.startswith("blocks.0."))
    head_dim = cfg.d_model // cfg.n_head
    assert not target["blocks.1.attn.q_proj.weight"][2 * head_dim:].any()
    assert target["blocks.1.attn.q_proj.weight"][:2 * head_dim].all()
    down = "blocks.2." + ("mlp.down_proj.weight" if family == "llama" else "mlp.proj.weight")
    assert not target[down][:, 1:95].any() and target[down][:, [0, 95]].all()


def test_grouped_query_attention_requires_whole_groups() -> None:
    cfg = _cfg("llama")  # 4 heads, 2 kv heads: groups {0,1} and {2,3}
    with pytest.raises(ValueError, match="whole groups"):
        build_model(cfg, SubnetSpec(heads={0: [1, 2]}))
    slices = parameter_slices(cfg, SubnetSpec(heads={0: [2, 3]}))
    head_dim = cfg.d_model // cfg.n_head
    dim, rows = slices["blocks.0.attn.k_proj.weight"]
    assert dim == 0 and rows.tolist() == list(range(1 * head_dim, 2 * head_dim))
    dim, cols = slices["blocks.0.attn.o_proj.weight"]
    assert dim == 1 and cols.tolist() == list(range(2 * head_dim, 4 * head_dim))


def test_invalid_specs_fail_clearly_and_json_keys_are_accepted() -> None:
    cfg = _cfg("gpt")
    with pytest.raises(ValueError, match="outside"):
        build_model(cfg, SubnetSpec(blocks=[0, 3]))
    with pytest.raises(ValueError, match="outside"):
        build_model(cfg, SubnetSpec(mlp_units={1: [96]}))
    with pytest.raises(ValueError, match="duplicate"):
        build_model(cfg, SubnetSpec(mlp_units={1: [4, 4]}))
    spec = SubnetSpec(blocks=[2, 0], heads={"1": [3, 1]})  # as read back from a JSON plan
    assert spec.blocks == [0, 2] and spec.heads == {1: [1, 3]}
    # Coverage 1: listing everything explicitly is still the full model.
    assert SubnetSpec().is_full(cfg)
    assert SubnetSpec(blocks=[0, 1, 2], heads={0: [0, 1, 2, 3]}, mlp_units={1: list(range(96))}).is_full(cfg)
    assert not spec.is_full(cfg) and not SubnetSpec(mlp_units={0: [0]}).is_full(cfg)


def test_subnetwork_is_built_at_its_own_size_and_counts_its_flops() -> None:
    cfg = load_model_config("llama1_8b")
    spec = SubnetSpec(blocks=list(range(0, 32, 2)))
    sub = build_model(cfg, spec, device="meta")
    assert sorted(int(k) for k in sub.blocks.keys()) == list(range(0, 32, 2))
    full = build_model(cfg, device="meta")
    per_block = (count_parameters(full) - count_parameters(sub)) // 16
    assert count_parameters(sub) == count_parameters(full) - 16 * per_block
    assert matmul_parameters(cfg, spec) < matmul_parameters(cfg)
    assert flops_per_token(cfg, spec) < flops_per_token(cfg)
    # A real (CPU) build of a tiny subnetwork allocates only its own parameters.
    tiny = _cfg("llama")
    small = build_model(tiny, SubnetSpec(blocks=[1], mlp_units={1: [0, 1]}))
    assert sum(p.numel() for p in small.parameters()) == count_parameters(small)
    assert small.blocks["1"].mlp.up_proj.weight.shape == (2, tiny.d_model)
