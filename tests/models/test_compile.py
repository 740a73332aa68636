"""torch.compile as the trainer applies it (train.compile, models/common.py's compile_blocks): each
block compiled on its own with static shapes, computing what eager mode computes, one graph shared
by identical blocks, and a backward that hands each block's gradients over before the earlier
blocks run, so post-accumulate-grad hooks (SCAPE's bucketed all-reduce) still overlap backward.
AOTAutograd's eager backend, so no C++ compiler is needed; fullgraph=True turns any graph break
(e.g. an out= into a view, a .item()) into a failure."""
from __future__ import annotations

import dataclasses
from typing import List

import pytest
import torch
from torch._dynamo.utils import counters

from models import build_model, load_model_config
from tests.train_helpers import compose_config
from trainer.config import ConfigError, TrainConfig, to_config


def _model(name: str, n_layer: int = 2, **overrides):
    extra = {"n_kv_head": 2} if name == "tiny_llama" else {}
    cfg = dataclasses.replace(load_model_config(name), n_layer=n_layer, d_model=64, n_head=4, ffn_hidden=128,
                              vocab_size=256, seq_len=32, **{**extra, **overrides})
    torch.manual_seed(0)
    return build_model(cfg).train(), cfg


def _batch(cfg, batch: int = 2):
    idx = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len), generator=torch.Generator().manual_seed(1))
    return idx, torch.cat([idx[:, 1:], torch.full((batch, 1), -1)], dim=1)


@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("name,kernels", [("tiny_llama", "stock"), ("tiny_llama", "cpu"), ("tiny_gpt", "auto")])
def test_compiled_blocks_equal_eager_and_keep_the_parameter_names(name: str, kernels: str,
                                                                   checkpointing: bool) -> None:
    model, cfg = _model(name, kernels=kernels)
    model.set_activation_checkpointing(checkpointing)
    idx, targets = _batch(cfg)
    expected = model(idx, targets)
    expected.backward()
    expected_grads = [p.grad.clone() for p in model.parameters()]
    names = list(model.state_dict())
    model.zero_grad(set_to_none=True)

    torch._dynamo.reset()
    model.compile_blocks(backend="aot_eager", fullgraph=True)
    loss = model(idx, targets)
    loss.backward()
    assert list(model.state_dict()) == names  # no "_orig_mod." anywhere: checkpoints unchanged
    torch.testing.assert_close(loss, expected, atol=1e-6, rtol=1e-6)
    for p, g in zip(model.parameters(), expected_grads):
        torch.testing.assert_close(p.grad, g, atol=1e-6, rtol=1e-5)
    torch._dynamo.reset()


def test_identical_blocks_share_one_graph_and_no_grad_forwards_stay_eager() -> None:
    model, cfg = _model("tiny_llama", n_layer=10, kernels="stock")  # more blocks than dynamo's cache limit
    idx, targets = _batch(cfg)
    torch._dynamo.reset()
    counters.clear()
    model.compile_blocks(backend="aot_eager", fullgraph=True)
    model(idx, targets).backward()
    assert counters["stats"]["unique_graphs"] == 1
    with torch.no_grad():  # validation / evaluation shapes vary: they must not recompile
        model(idx[:, :17])
        model(idx[:1])
    assert counters["stats"]["unique_graphs"] == 1 and not counters["recompiles"]
    torch._dynamo.reset()


def _hook_and_node_events(model, loss: torch.Tensor) -> List[str]:
    """The order in which compiled backward nodes start and the blocks' parameters get their final
    gradient (post-accumulate-grad hooks, as scape/overlap.py registers them)."""
    events: List[str] = []
    for name, param in model.named_parameters():
        if name.startswith("blocks."):
            param.register_post_accumulate_grad_hook(lambda p, n=name: events.append("grad " + n.split(".")[1]))
    seen, stack = set(), [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if "Compiled" in type(node).__name__:
            node.register_prehook(lambda grads: events.append("compiled backward"))
        stack.extend(f for f, _ in node.next_functions)
    loss.backward()
    return events


def test_the_last_blocks_gradients_are_final_before_the_first_blocks_backward_runs() -> None:
    model, cfg = _model("tiny_llama", n_layer=3, kernels="stock")
    idx, targets = _batch(cfg)
    torch._dynamo.reset()
    model.compile_blocks(backend="aot_eager", fullgraph=True)
    events = _hook_and_node_events(model, model(idx, targets))
    # one compiled node per block, and block 2's gradients are all final before block 1's and
    # block 0's backward start (the whole model as one graph gives one node, then every hook)
    assert events.count("compiled backward") == 3
    last_block_done = max(i for i, e in enumerate(events) if e == "grad 2")
    assert events[last_block_done + 1:].count("compiled backward") == 2
    assert events.index("grad 0") > events.index("grad 1") > last_block_done
    torch._dynamo.reset()


def test_train_compile_accepts_true_false_auto_and_refuses_anything_else() -> None:
    assert TrainConfig().compile == "auto"
    assert TrainConfig().compiles("cuda") and not TrainConfig().compiles("cpu")
    assert TrainConfig(compile=True).compiles("cpu") and not TrainConfig(compile=False).compiles("cuda")
    assert TrainConfig(compile="False").compile is False
    for override, expected in (("train.compile=true", True), ("train.compile=false", False),
                               ("train.compile=auto", "auto")):
        assert to_config(compose_config([override])).train.compile == expected
    with pytest.raises(ConfigError, match=r"train.compile='yes': expected true, false or auto"):
        to_config(compose_config(["train.compile=yes"]))
    with pytest.raises(ConfigError, match=r"train.compile=1: expected true, false or auto"):
        TrainConfig(compile=1)
