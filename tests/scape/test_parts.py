"""Config validation, partitioning, exact top-k, mask transports and the byte formula."""
import math

import pytest
import torch

from scape import build_synchronizer, transport
from scape.accounting import dense_step_bytes, scape_step_bytes
from scape.config import OptimizerConfig
from scape.options import validate_config
from scape.partition import Partitioning, values_per_partition
from scape.topk import SAMPLE_SIZE, topk_indices, topk_mask


@pytest.mark.parametrize("key,value,needle", [
    ("sparsity", 1.0, "optimizer.sparsity"), ("sparsity", -0.1, "optimizer.sparsity"),
    ("mask_transport", "zip", "bitmap, indices, auto"), ("value_dtype", "fp16", "fp32, bf16"),
    ("update", "eager", "lazy, all"), ("base", "sgd", "adams, adamw"),
    ("score", "hessian", "moment, gradient"), ("dense_warmup_steps", 0, "dense_warmup_steps"),
    ("stale_scale_cap", 0.5, "stale_scale_cap"), ("score_timing", "after", "score_timing"),
    ("stale_scale", "time", "stale_scale"), ("sparsity_warmup_steps", -1, "sparsity_warmup"),
])
def test_invalid_settings_fail_naming_the_key_and_allowed_values(key, value, needle):
    with pytest.raises(ValueError, match=needle) as info:  # the config checks itself when it is built
        OptimizerConfig(name="scape", **{key: value})
    assert key in str(info.value)
    with pytest.raises(ValueError):  # the synchroniser checks a config a caller changed after that
        cfg = OptimizerConfig(name="scape")
        setattr(cfg, key, value)
        build_synchronizer(torch.nn.Linear(4, 4), cfg)


def test_stale_scale_cap_needs_lazy_update():
    with pytest.raises(ValueError, match="update=lazy"):
        OptimizerConfig(name="scape", stale_scale_cap=4, update="all")
    validate_config(OptimizerConfig(name="scape", stale_scale_cap=4, update="lazy"))


def test_k_is_robust_to_float_noise_and_bounded():
    assert values_per_partition(1 - 0.99, 1000) == 10  # 1 - 0.99 = 0.010000000000000009
    assert values_per_partition(1 - 0.9, 1000) == 100
    assert values_per_partition(0.011, 1000) == 11
    assert values_per_partition(1e-9, 1000) == 1
    assert values_per_partition(1.0, 1000) == 1000


def test_partitioning_is_equal_contiguous_and_aligned():
    layout = Partitioning(numel=10_001, num_partitions=4, world=2, rank=1)
    assert layout.padded_numel % (4 * 128) == 0 and layout.padded_numel >= 10_001
    assert layout.partition_size * 4 == layout.padded_numel
    assert layout.owned_start == 2 * layout.partition_size
    assert layout.owned_numel == 2 * layout.partition_size
    with pytest.raises(ValueError, match="multiple of the world size"):
        Partitioning(numel=100, num_partitions=3, world=2)


@pytest.mark.parametrize("n,k", [(1000, 10), (1000, 1000), (4 * SAMPLE_SIZE + 4096, 300),
                                 (4 * SAMPLE_SIZE + 4096, 50_000)])
def test_topk_is_exact_and_sorted(n, k):
    score = torch.randn(n, generator=torch.Generator().manual_seed(n + k)).abs()
    got = topk_indices(score, k)
    assert got.numel() == k and torch.all(got[1:] > got[:-1])
    expected = torch.topk(score, k).values
    torch.testing.assert_close(score[got].sort(descending=True).values, expected, rtol=0, atol=0)


def test_topk_falls_back_when_the_sample_misjudges():
    # the strided sample sees only zeros; the top values sit between the sampled positions
    n = 4 * SAMPLE_SIZE + 8192
    score = torch.zeros(n)
    score[1::n // SAMPLE_SIZE][:100] = torch.arange(1, 101).float()
    got = topk_indices(score, 100)
    assert torch.equal(score[got].sort().values, torch.arange(1, 101).float())


@pytest.mark.parametrize("name", ["bitmap", "indices", "auto"])
@pytest.mark.parametrize("k", [3, 200])
def test_every_transport_round_trips(name, k):
    partitions, size = 4, 1024
    gen = torch.Generator().manual_seed(k)
    local = torch.stack([torch.randperm(size, generator=gen)[:k].sort().values
                         for _ in range(partitions)])
    offsets = torch.arange(partitions).unsqueeze(1) * size
    expected = (local + offsets).reshape(-1)
    mask = torch.zeros(partitions * size, dtype=torch.bool)
    mask[expected] = True
    send = transport.encode(name, mask, partitions, size, k)
    assert send.numel() * send.element_size() == transport.local_nbytes(name, size, k, partitions)
    if transport.resolve(name, size, k) == "indices":
        assert torch.equal(send.long(), local.reshape(-1))  # partition-local, ascending
    received = transport.receive_buffer(name, partitions, size, k, torch.device("cpu"))
    received.copy_(send)  # one rank owning every partition: the all-gather is the identity
    assert torch.equal(transport.decode(name, received, partitions, size, k), expected)


def test_topk_mask_handles_ties_and_edge_k():
    score = torch.zeros(4 * SAMPLE_SIZE + 800)
    score[::7] = 1.0  # many ties at both values
    mask = torch.empty_like(score, dtype=torch.bool)
    for k in (0, 1, 5000, score.numel() // 7 + 3, score.numel()):
        topk_mask(score, k, mask)
        assert int(mask.sum()) == k
        if 0 < k <= score.numel() // 7:
            assert torch.all(score[mask] == 1.0)


def test_auto_picks_indices_only_below_one_in_32():
    assert transport.resolve("auto", 3200, 99) == "indices"
    assert transport.resolve("auto", 3200, 100) == "bitmap"  # equal sizes: bitmap
    assert transport.resolve("auto", 3200, 320) == "bitmap"
    with pytest.raises(ValueError, match="mask_transport"):
        transport.resolve("rle", 3200, 10)


def test_scape99_formula_sends_over_50x_fewer_bytes_than_dense():
    for numel in (354_871_296, 1_800_000_000):
        for world in (2, 32, 64):
            dense = dense_step_bytes(numel, world)
            sparse = scape_step_bytes(numel, world, 0.99)
            assert sparse["transport"] == "indices"
            assert dense / sparse["total"] >= 50
            k = math.ceil(0.01 * sparse["padded_numel"] / world)
            assert sparse["values"] == pytest.approx(2 * (world - 1) * k * 4)
            assert sparse["mask"] == pytest.approx((world - 1) * 4 * k)
