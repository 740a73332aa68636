"""torch.compile (train.compile=true) traces both families in one graph, forward and backward,
and computes what eager mode computes. AOTAutograd's eager backend, so no C++ compiler is needed;
fullgraph=True turns any graph break (e.g. an out= into a view, a .item()) into a failure."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from models import build_model, load_model_config


@pytest.mark.parametrize("name", ["tiny_llama", "tiny_gpt"])
def test_compiled_model_traces_in_one_graph_and_equals_eager(name: str) -> None:
    extra = {"n_kv_head": 2} if name == "tiny_llama" else {}
    cfg = dataclasses.replace(load_model_config(name), n_layer=2, d_model=64, n_head=4, ffn_hidden=128,
                              vocab_size=256, seq_len=32, **extra)
    torch.manual_seed(0)
    model = build_model(cfg).train()
    idx = torch.randint(0, cfg.vocab_size, (2, 32))
    targets = torch.cat([idx[:, 1:], torch.full((2, 1), -1)], dim=1)
    expected = model(idx, targets)
    expected.backward()
    expected_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)

    torch._dynamo.reset()
    loss = torch.compile(model, backend="aot_eager", fullgraph=True)(idx, targets)
    loss.backward()
    torch.testing.assert_close(loss, expected, atol=1e-6, rtol=1e-6)
    for p, g in zip(model.parameters(), expected_grads):
        torch.testing.assert_close(p.grad, g, atol=1e-6, rtol=1e-5)
    torch._dynamo.reset()
