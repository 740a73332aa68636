"""ZeRO-1 (optimizer.shard=true for adamw / adams) equals DenseAllReduce, with 1/N of its state."""
import pytest
import torch

from core.optim import DenseOptimizerConfig, build_optimizer
from core.sync import DenseAllReduce
from core.zero import ZeroDenseSynchronizer
from tests.dist_helpers import run_distributed
from tests.scape.helpers import make_model, train
from tests.scape.test_dist_resume import roundtrip


def _state_numel(optimizer: torch.optim.Optimizer) -> int:
    return sum(t.numel() for state in optimizer.state.values() for t in state.values()
               if isinstance(t, torch.Tensor) and t.ndim > 0)


def _equal_to_dense(rank: int, world: int) -> None:
    for name in ("adamw", "adams"):
        cfg = DenseOptimizerConfig(name=name, lr=1e-2, weight_decay=0.1)
        dense_model, zero_model = make_model(), make_model()
        dense = DenseAllReduce(dense_model, lambda ps: build_optimizer(ps, cfg))
        zero = ZeroDenseSynchronizer(zero_model, cfg)
        for step in range(6):
            a = train(dense_model, dense, 1, rank, start=step, max_norm=0.3)  # clipping acts
            b = train(zero_model, zero, 1, rank, start=step, max_norm=0.3)
            assert a == pytest.approx(b, rel=0, abs=1e-6)
            for (key, p), q in zip(dense_model.named_parameters(), zero_model.parameters()):
                torch.testing.assert_close(q, p, rtol=0, atol=1e-6, msg=f"{name} {key} step {step + 1}")
        moments = 2 if name == "adamw" else 1
        assert _state_numel(zero.optimizer) == moments * zero.flat.padded_numel // world
        assert _state_numel(dense.optimizer) == moments * zero.flat.numel
        old, new = dense.comm.counter.bytes, zero.comm.counter.bytes
        if world > 1:  # 6 steps: reduce-scatter + all-gather of the padded buffer vs the all-reduce
            assert new["grad_reducescatter"] == new["param_allgather"]
            padded = zero.flat.padded_numel / zero.flat.numel
            assert new["grad_reducescatter"] + new["param_allgather"] == pytest.approx(
                old["grad_allreduce"] * padded)
        _resume(rank, zero_model, zero, cfg)


def _resume(rank: int, model, sync: ZeroDenseSynchronizer, cfg) -> None:
    saved = roundtrip({"model": sync.model_state_dict(), "replicated": sync.state_dict(),
                       "local": sync.local_state_dict()})
    expected = train(model, sync, 3, rank, start=6)
    final = sync.flat.data.clone()
    model = make_model(seed=5)
    again = ZeroDenseSynchronizer(model, cfg)
    again.load_model_state_dict(saved["model"])
    again.load_state_dict(saved["replicated"])
    again.load_local_state_dict(saved["local"])
    assert train(model, again, 3, rank, start=6) == expected
    assert torch.equal(again.flat.data, final)
    dense = DenseAllReduce(make_model(), lambda ps: build_optimizer(ps, cfg))
    with pytest.raises(ValueError, match="optimizer.shard=true"):
        dense.load_state_dict(saved["replicated"])
    with pytest.raises(ValueError, match="optimizer.shard=false"):
        again.load_state_dict(dense.state_dict())


def test_zero1_equals_dense_on_2_ranks_and_resumes_bit_exactly():
    run_distributed(_equal_to_dense, world_size=2)


def test_zero1_equals_dense_on_4_ranks_and_resumes_bit_exactly():
    run_distributed(_equal_to_dense, world_size=4)
