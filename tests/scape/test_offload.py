"""2 gloo ranks: SCAPE with its residual offloaded to host memory equals the on-device residual
bit for bit over several steps (parameters, momentum, residual, mask), replicated and sharded,
overlapped with backward or not, and moves only what it must: one streamed pass over the
residual a sparse step (in and out), the score of a dense step's mask from this rank's own
partition only (in, not out), and the masked values gathered once a step from the host copy of
the mask (no device-to-host copy of indices, no wait per bucket)."""
from collections import defaultdict

import pytest
import torch

from scape.residual import Residual
from scape.sharded import ShardedScapeSynchronizer
from scape.synchronizer import ScapeSynchronizer
from tests.dist_helpers import run_distributed
from tests.scape.helpers import make_model, scape_config, train

VARIANTS = {
    "default": dict(sparsity=0.9, sparsity_warmup_steps=4, dense_warmup_steps=2),
    "bf16_threshold": dict(sparsity=0.99, value_dtype="bf16", topk_method="threshold", dense_warmup_steps=2),
    "pre_send": dict(sparsity=0.9, score_timing="pre_send", stale_scale_cap=1, sparsity_warmup_steps=0),
    "unoverlapped": dict(sparsity=0.8, overlap_backward=False, mask_transport="indices"),
    "sharded": dict(sparsity=0.9, overlap_backward=False, sparsity_warmup_steps=3),
}
STEPS, CHUNK = 7, 150  # a residual of 1,152 values (one rank): eight chunks


def _traced(sync, log):
    """Record each residual pass (range and write-back) and each gather, by step."""
    chunks, gather = sync.residual.chunks, sync.residual.gather

    def traced_chunks(lo=0, hi=None, write_back=True):
        log[sync.step_count + 1].append(("pass", lo, sync.residual.numel if hi is None else hi, write_back))
        return chunks(lo, hi, write_back)

    def traced_gather(indices, host_indices=None):
        log[sync.step_count + 1].append(("gather", host_indices is not None))
        return gather(indices, host_indices)

    sync.residual.chunks, sync.residual.gather = traced_chunks, traced_gather


def _offload_equals_device(rank: int, world: int, variant: str) -> None:
    overrides = VARIANTS[variant]
    cls = ShardedScapeSynchronizer if variant == "sharded" else ScapeSynchronizer
    runs, logs = [], []
    for offload in (False, True):
        model = make_model()
        kwargs = {} if cls is ShardedScapeSynchronizer else {"overlap_bucket_numel": 100}
        sync = cls(model, scape_config(offload_residual=offload, **overrides), residual_chunk_numel=CHUNK, **kwargs)
        log = defaultdict(list)
        if offload:
            assert len(sync.residual.bounds()) > 5 and not sync.residual.storage.is_pinned()
            _traced(sync, log)
        states = []
        train(model, sync, STEPS, rank, after=lambda step, s=sync, out=states: out.append(
            (s.flat.data.clone(), s.optimizer.momentum.clone(), s.residual.cpu_copy())))
        runs.append(states)
        logs.append(log)
    for step, (device, host) in enumerate(zip(*runs), start=1):
        for name, a, b in zip(("params", "momentum", "residual"), device, host):
            assert torch.equal(a, b), f"{variant} rank {rank} step {step}: {name} differ"
    log, own = logs[1], (sync.layout.owned_start, sync.layout.owned_start + sync.layout.owned_numel)
    numel, dense = sync.residual.numel, overrides.get("dense_warmup_steps", 1)
    # (logged under step_count + 1: the first mask's score, after the last dense step, is
    # logged with the first sparse step)
    first_score = [("pass", *own, False)] if overrides.get("score_timing") != "pre_send" else []
    for step in range(1, STEPS + 1):
        passes = [entry for entry in log[step] if entry[0] == "pass"]
        gathers = [entry for entry in log[step] if entry[0] == "gather"]
        if step <= dense:
            assert log[step] == [], (variant, step, log[step])
        else:  # one pass in and out, one gather from the mask's host copy
            expected = (first_score if step == dense + 1 else []) + [("pass", 0, numel, True)]
            assert passes == expected and gathers == [("gather", True)], (variant, step, log[step])


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_offloaded_residual_equals_the_device_residual(variant):
    run_distributed(_offload_equals_device, world_size=2, args=(variant,))


def test_offload_pins_host_memory_only_with_cuda():
    residual = Residual(1000, torch.device("cpu"), offload=True, chunk_numel=300)
    assert not residual.storage.is_pinned() and residual.copy_stream is None
    assert [hi - lo for lo, hi in residual.bounds()] == [300, 300, 300, 100]
    assert residual.bounds(250, 700) == [(250, 550), (550, 700)]
    residual.storage.copy_(torch.arange(1000.0))
    for lo, hi, view in residual.chunks(250, 700, write_back=False):
        view.zero_()  # a read-only pass: nothing goes back
    assert torch.equal(residual.storage, torch.arange(1000.0))
    indices = torch.tensor([3, 299, 300, 999])
    assert torch.equal(residual.gather(indices, indices.clone()), torch.tensor([3.0, 299.0, 300.0, 999.0]))
