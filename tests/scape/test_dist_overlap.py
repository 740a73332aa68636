"""2 gloo ranks: SCAPE with its value all-reduce overlapped with backward equals the unoverlapped
SCAPE bit for bit (parameters, momentum, residual, bytes), with accumulation, for the default
rule (conf/optimizer/scape.yaml), the spec's (scape_spec) and the payload/residual variants."""
import pytest
import torch

from scape.synchronizer import ScapeSynchronizer
from tests.dist_helpers import run_distributed
from tests.scape.helpers import batch, make_model, scape_config
from trainer.step import train_step

VARIANTS = {
    # the study's rule, as conf/optimizer/scape.yaml (sparsity warm-up included)
    "default": dict(sparsity=0.9, sparsity_warmup_steps=4),
    # optimizer=scape_spec: pre-send score, no catch-up, no sparsity warm-up
    "scape_spec": dict(sparsity=0.9, score_timing="pre_send", stale_scale="steps",
                       stale_scale_cap=1, sparsity_warmup_steps=0),
    "bf16_offload": dict(sparsity=0.99, value_dtype="bf16", offload_residual=True,
                         dense_warmup_steps=2, topk_method="threshold"),
    "update_all": dict(sparsity=0.8, update="all", stale_scale_cap=1, score="gradient",
                       mask_transport="indices"),
}
STEPS, ACCUM = 8, 2
SKIPPED = (5, 1)  # (step, rank): a non-finite loss there skips the step on every rank


def _run(rank: int, cfg, overlap: bool, skip: bool):
    cfg.overlap_backward = overlap
    model = make_model()
    sync = ScapeSynchronizer(model, cfg, residual_chunk_numel=300, overlap_bucket_numel=100)
    calls_before_reduce = []
    for step in range(1, STEPS + 1):
        micro = [batch(rank, step, m) for m in range(ACCUM)]
        if skip and (step, rank) == SKIPPED:
            micro[1] = (torch.full_like(micro[1][0], float("inf")), micro[1][1])
        sync.comm.counter.reset()

        def observe(stage: str) -> None:
            if stage == "before_reduce":
                calls_before_reduce.append(sync.comm.counter.calls.get("scape_values", 0))

        result = train_step(model, sync, iter(micro), ACCUM, 1e-2, 0.5, sync.comm, 2, hook=observe)
        assert result.nonfinite == (skip and step == SKIPPED[0])
        bytes_by_kind = dict(sync.comm.counter.bytes)
        yield step, sync, bytes_by_kind, calls_before_reduce


def _overlapped_equals_unoverlapped(rank: int, world: int, variant: str, skip: bool) -> None:
    runs = [_run(rank, scape_config(**VARIANTS[variant]), overlap, skip) for overlap in (False, True)]
    for (step, plain, plain_bytes, _), (_, over, over_bytes, calls) in zip(*runs):
        where = f"{variant} step {step} rank {rank}"
        assert torch.equal(over.flat.data, plain.flat.data), where
        assert torch.equal(over.optimizer.momentum, plain.optimizer.momentum), where
        assert torch.equal(over.residual.storage, plain.residual.storage), where
        over.masks.wait(), plain.masks.wait()
        assert (over.mask is None and plain.mask is None) or torch.equal(over.mask, plain.mask), where
        if skip and step == SKIPPED[0]:  # the skip is decided after the reduction, on both paths
            assert over_bytes.get("scape_values", 0) == plain_bytes.get("scape_values", 0) > 0, where
        assert over_bytes == plain_bytes, where  # the same payload: the same bytes, by kind
    assert over.backward_overlap is not None and over.step_count == plain.step_count
    # the sparse steps' payload went out in several slices, all started before reduce_gradients
    sparse = [c for c in calls if c > 0]
    assert sparse and min(sparse) > 1, calls


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_overlapped_scape_equals_unoverlapped(variant):
    run_distributed(_overlapped_equals_unoverlapped, world_size=2, args=(variant, False))


def test_overlapped_scape_equals_unoverlapped_across_a_skipped_step():
    run_distributed(_overlapped_equals_unoverlapped, world_size=2, args=("default", True))
