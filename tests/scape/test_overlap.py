"""One process: the overlapped payload leaves during backward, in a fixed order, bucket by bucket."""
import torch

from scape.synchronizer import ScapeSynchronizer
from tests.scape.helpers import make_model, scape_config, train


def test_buckets_cover_the_flat_buffer_and_start_in_backward_order():
    model = make_model()
    sync = ScapeSynchronizer(model, scape_config(), overlap_bucket_numel=100)
    buckets = sync.backward_overlap.buckets
    assert buckets[0].lo == 0 and buckets[-1].hi == sync.layout.padded_numel
    assert all(a.hi == b.lo for a, b in zip(buckets, buckets[1:]))
    # flat order: embed.weight, head.weight, then the vectors; backward reaches head first and
    # embed.weight (the first registered parameter) last
    first = [buckets[b].params for b in sync.backward_overlap.launch_order]
    assert first[0] == [model.head.bias] and first[1] == [model.head.weight]
    assert first[-1] == [model.embed.weight]


def test_the_first_bucket_starts_before_backward_reaches_the_first_layer():
    model = make_model()
    sync = ScapeSynchronizer(model, scape_config(sparsity=0.5), overlap_bucket_numel=100)
    seen = []
    plain = sync.comm.all_reduce

    def spy(tensor, kind, **kw):
        if kind == "scape_values":  # has backward written embed's gradient yet?
            seen.append(bool(model.embed.weight.grad.abs().sum() > 0))
        return plain(tensor, kind, **kw)

    sync.comm.all_reduce = spy
    train(model, sync, 3, rank=0, accum=1)
    # steps 2 and 3 are sparse: 4 buckets each, the first started while embed.weight had no gradient
    assert len(seen) == 8 and seen[0] is False and seen[4] is False and seen[3] is True


def test_no_overlap_without_lag_or_when_switched_off():
    for cfg in (scape_config(lag=False), scape_config(overlap_backward=False)):
        model = make_model()
        sync = ScapeSynchronizer(model, cfg)
        assert sync.backward_overlap is None
        train(model, sync, 3, rank=0)
        assert sync.step_count == 3
