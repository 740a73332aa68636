"""Threshold top-k against the exact one: exactly k, the same set, and its tie rule."""
import pytest
import torch

from scape import topk
from scape.topk import SAMPLE_SIZE, TOPK_METHODS, topk_mask

BIG = 4 * SAMPLE_SIZE + 4096  # large enough for the sampled bracket


def _canonical(score: torch.Tensor, k: int) -> torch.Tensor:
    """The reference: a stable sort by value descending, index ascending among equals."""
    order = torch.sort(score, descending=True, stable=True).indices[:k]
    mask = torch.zeros(score.numel(), dtype=torch.bool)
    mask[order] = True
    return mask


def _mask(score, k, method, **kw):
    out = torch.empty(score.numel(), dtype=torch.bool)
    return topk_mask(score, k, out, method, **kw)


@pytest.mark.parametrize("n,k", [(1000, 10), (1000, 999), (BIG, 300), (BIG, BIG // 10),
                                 (BIG, BIG // 100), (BIG, BIG // 2)])
def test_threshold_selects_the_same_k_and_set_as_exact(n, k):
    score = torch.randn(n, generator=torch.Generator().manual_seed(n + k)).abs()
    exact, threshold = _mask(score, k, "exact"), _mask(score, k, "threshold")
    assert int(threshold.sum()) == k
    assert torch.equal(threshold, exact)  # distinct values: the top-k set is unique
    assert torch.equal(threshold, _canonical(score, k))


@pytest.mark.parametrize("n,k", [(1000, 1), (1000, 100), (BIG, 1), (BIG, 100), (BIG, 5000)])
def test_threshold_breaks_ties_at_the_kth_value_by_lowest_index(n, k):
    gen = torch.Generator().manual_seed(k)
    score = torch.randint(0, 50, (n,), generator=gen).float()  # many ties everywhere
    got = _mask(score, k, "threshold")
    assert torch.equal(got, _canonical(score, k))
    exact = _mask(score, k, "exact")  # torch.topk's choice among ties is its own, the k is not
    kth = score[got].min()
    assert int(exact.sum()) == k and torch.equal(exact & (score > kth), got & (score > kth))


@pytest.mark.parametrize("use_radix", [False, True])
def test_threshold_handles_ties_edge_k_and_negative_scores(use_radix, monkeypatch):
    if use_radix:  # the CUDA path, run on the CPU
        monkeypatch.setattr(topk, "_sampled", lambda *args: False)
    score = torch.zeros(BIG)
    score[::7] = 1.0
    score[3::11] = -2.0
    for k in (0, 1, 5000, BIG // 7 + 3, BIG - 5, BIG):
        assert torch.equal(_mask(score, k, "threshold"), _canonical(score, k)), k
    dense = torch.randn(BIG, generator=torch.Generator().manual_seed(3))  # signed values
    for k in (17, BIG // 10):
        assert torch.equal(_mask(dense, k, "threshold"), _canonical(dense, k))


def test_threshold_falls_back_when_the_sample_misjudges():
    # the strided sample sees only zeros; the top values sit between the sampled positions
    score = torch.zeros(BIG)
    score[1::BIG // SAMPLE_SIZE][:100] = torch.arange(1, 101).float()
    got = _mask(score, 100, "threshold")
    assert torch.equal(got, _canonical(score, 100))


def test_threshold_uses_the_callers_scratch_buffer():
    score = torch.rand(BIG, generator=torch.Generator().manual_seed(5))
    scratch = torch.zeros(BIG, dtype=torch.bool)
    got = _mask(score, BIG // 10, "threshold", scratch=scratch)
    assert torch.equal(got, _canonical(score, BIG // 10))
    assert bool(scratch.any())  # written: the bracket lived there


def test_unknown_method_is_refused_by_name():
    with pytest.raises(ValueError, match="top-k method 'sort'"):
        _mask(torch.rand(10), 3, "sort")
    assert TOPK_METHODS == ("exact", "threshold")


def test_config_key_is_validated():
    from scape.options import validate_config
    from tests.scape.helpers import scape_config
    with pytest.raises(ValueError, match="optimizer.topk_method='fast'"):
        validate_config(scape_config(topk_method="fast"))


@pytest.mark.parametrize("sparsity", [0.9, 0.99])
def test_scape_trains_identically_with_either_method(sparsity):
    from scape.synchronizer import ScapeSynchronizer
    from tests.scape.helpers import make_model, scape_config, train

    params = []
    for method in TOPK_METHODS:
        model = make_model()
        sync = ScapeSynchronizer(model, scape_config(sparsity=sparsity, topk_method=method),
                                 num_partitions=2)
        train(model, sync, 6, rank=0)
        params.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
    assert torch.equal(params[0], params[1])
