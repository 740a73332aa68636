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


def _force_radix(monkeypatch, chunk: int) -> None:
    """The CUDA path of the threshold method, on the CPU, over slices of ``chunk`` elements."""
    monkeypatch.setattr(topk, "_sampled", lambda *args: False)
    monkeypatch.setattr(topk, "RADIX_CHUNK", chunk)


@pytest.mark.parametrize("chunk", [1000, 4096, 1 << 24])  # slices that do not divide n, and one slice
def test_sliced_radix_select_is_the_canonical_top_k(chunk, monkeypatch):
    _force_radix(monkeypatch, chunk)
    n = 50_000
    gen = torch.Generator().manual_seed(chunk)
    inputs = {"random": torch.randn(n, generator=gen).abs(), "signed": torch.randn(n, generator=gen),
              # ties at the k-th value spread over many slices: the count of those still
              # missing carries from slice to slice
              "ties": torch.randint(0, 4, (n,), generator=gen).float(),
              "one_value": torch.full((n,), 0.5)}
    for name, score in inputs.items():
        for k in (1, 999, 1000, 1001, n // 10, n // 3, n - 1):
            got = _mask(score, k, "threshold")
            assert torch.equal(got, _canonical(score, k)), (name, k)
            if name in ("random", "signed"):  # distinct values: the exact method's set too
                assert torch.equal(got, _mask(score, k, "exact")), (name, k)


def test_the_cuda_paths_read_nothing_back_to_the_host(monkeypatch):
    # on the meta device every host read (item, bool, nonzero, boolean indexing) raises
    monkeypatch.setattr(topk, "RADIX_CHUNK", BIG // 3 + 1)
    score = torch.empty(BIG, device="meta")  # large enough for the CPU's sampled paths
    out = torch.empty(BIG, dtype=torch.bool, device="meta")
    for method in TOPK_METHODS:
        assert topk_mask(score, BIG // 10, out, method) is out
    for host_read in (lambda: bool(out.any()), lambda: torch.nonzero(out), lambda: score[out]):
        with pytest.raises((RuntimeError, NotImplementedError)):  # what the meta device catches
            host_read()


@pytest.mark.parametrize("ties", [False, True])
def test_exact_on_cuda_is_torch_topk_and_agrees_with_the_cpu_path(ties):
    n, k = BIG, BIG // 10
    gen = torch.Generator().manual_seed(11)
    score = torch.randint(0, 50, (n,), generator=gen).float() if ties else torch.rand(n, generator=gen)
    got = topk._torch_topk_mask(score, k, torch.ones(n, dtype=torch.bool))  # every old mark cleared
    expected = torch.zeros(n, dtype=torch.bool)
    expected[torch.topk(score, k, sorted=False).indices] = True
    assert torch.equal(got, expected) and int(got.sum()) == k
    cpu = _mask(score, k, "exact")
    kth = score[got].min()
    assert torch.equal(cpu & (score > kth), got & (score > kth)) and int(cpu.sum()) == k
    assert torch.equal(cpu, got) or ties  # distinct values: one top-k set


def test_threshold_transient_memory_is_bounded():
    """Measured: the peak resident set above the inputs, in a fresh process whose allocator maps
    every large buffer on its own (tests/scape/topk_memory.py); one slice, then slices of n / 16."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from tests.scape import topk_memory
    if not os.path.exists("/proc/self/clear_refs"):
        pytest.skip("needs Linux's /proc/self/clear_refs to reset the peak resident set")
    n, chunk = 1 << 22, 1 << 18
    code = ("import json; from tests.scape.topk_memory import measure; "
            f"print(json.dumps([measure({n}, c, 0.9, ('threshold_sampled', 'threshold_radix')) "
            f"for c in ({topk.RADIX_CHUNK}, {chunk})]))")
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=topk_memory.MMAP_THRESHOLD, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[2], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    whole, sliced = json.loads(proc.stdout.strip().splitlines()[-1])
    assert whole["radix_chunk"] >= n and sliced["radix_chunk"] == chunk
    for measured in (whole, sliced):
        assert measured["threshold_sampled_bytes_per_element"] <= 8
        assert measured["threshold_radix_bytes_per_element"] <= 8
    # a fixed budget: 6 bytes a slice element and the histograms, not the partition's size
    assert sliced["threshold_radix_bytes_per_element"] * n <= 8 * chunk + (2 << 20)
