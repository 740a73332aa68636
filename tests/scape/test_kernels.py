"""Each Triton kernel equals its PyTorch reference (CPU, TRITON_INTERPRET=1)."""
import importlib
import math
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"  # chosen at decoration time: before the module is imported

import pytest
import torch

from scape.kernels import reference

if "scape.kernels.triton_kernels" in sys.modules:  # imported earlier without the interpreter
    importlib.reload(sys.modules["scape.kernels.triton_kernels"])
triton_kernels = pytest.importorskip("scape.kernels.triton_kernels")

N_BITS = 8 * 300  # not a multiple of the byte block: the tail is exercised


def _mask(seed: int) -> torch.Tensor:
    return torch.rand(N_BITS, generator=torch.Generator().manual_seed(seed)) < 0.3


def test_pack_bits_matches_reference_and_is_lsb_first():
    mask = _mask(0)
    expected = reference.pack_bits(mask, torch.empty(N_BITS // 8, dtype=torch.uint8))
    got = triton_kernels.pack_bits(mask, torch.empty(N_BITS // 8, dtype=torch.uint8))
    assert torch.equal(got, expected)
    lone = torch.zeros(16, dtype=torch.bool)
    lone[9] = True  # byte 1, bit 1
    assert reference.pack_bits(lone, torch.empty(2, dtype=torch.uint8)).tolist() == [0, 2]


def test_reference_bit_tricks_cover_every_byte():
    every = torch.arange(256, dtype=torch.uint8)
    weights = torch.tensor([1 << b for b in range(8)], dtype=torch.uint8)
    bits = torch.bitwise_and(every.unsqueeze(1), weights).ne(0).reshape(-1)
    assert torch.equal(reference.unpack_bits(every, torch.empty(2048, dtype=torch.bool)), bits)
    assert torch.equal(reference.pack_bits(bits, torch.empty(256, dtype=torch.uint8)), every)
    assert torch.equal(reference.set_bit_positions(every), torch.nonzero(bits).squeeze(1))
    assert torch.equal(triton_kernels.pack_bits(bits, torch.empty(256, dtype=torch.uint8)), every)


def test_unpack_bits_matches_reference_and_round_trips():
    mask = _mask(1)
    packed = reference.pack_bits(mask, torch.empty(N_BITS // 8, dtype=torch.uint8))
    expected = reference.unpack_bits(packed, torch.empty(N_BITS, dtype=torch.bool))
    got = triton_kernels.unpack_bits(packed, torch.zeros(N_BITS, dtype=torch.bool))
    assert torch.equal(expected, mask)
    assert torch.equal(got, mask)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gather_and_clear_matches_reference(dtype):
    gen = torch.Generator().manual_seed(2)
    source = torch.randn(5000, generator=gen)
    indices = torch.randperm(5000, generator=gen)[:1500].sort().values
    src_ref, src_tri = source.clone(), source.clone()
    out_ref = reference.gather_and_clear(src_ref, indices, torch.empty(1500, dtype=dtype))
    out_tri = triton_kernels.gather_and_clear(src_tri, indices, torch.empty(1500, dtype=dtype))
    assert torch.equal(out_ref, out_tri)
    assert torch.equal(src_ref, src_tri)
    # nothing is lost: what was sent plus what stays equals the original
    restored = src_tri.clone()
    restored.index_add_(0, indices, out_tri.float())
    assert torch.equal(restored, source)
    if dtype == torch.float32:
        assert torch.count_nonzero(src_tri[indices]) == 0


def test_scatter_matches_reference():
    gen = torch.Generator().manual_seed(3)
    indices = torch.randperm(4000, generator=gen)[:1200]
    values = torch.randn(1200, generator=gen)
    expected = reference.scatter(torch.zeros(4000), indices, values)
    got = triton_kernels.scatter(torch.zeros(4000), indices, values)
    assert torch.equal(got, expected)
    assert torch.equal(got[indices], values)


@pytest.mark.parametrize("with_scale", [False, True])
def test_adams_masked_update_matches_reference(with_scale):
    gen = torch.Generator().manual_seed(4)
    param, momentum = torch.randn(3000, generator=gen), 0.1 * torch.randn(3000, generator=gen)
    indices = torch.randperm(3000, generator=gen)[:700].sort().values
    grad = torch.randn(700, generator=gen)
    scale = torch.randint(1, 5, (700,), generator=gen).float() if with_scale else None
    p_ref, m_ref, p_tri, m_tri = param.clone(), momentum.clone(), param.clone(), momentum.clone()
    args = dict(lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, bias_correction=1 - 0.9 ** 3,
                scale=scale)
    reference.adams_masked_update(p_ref, m_ref, indices, grad, **args)
    triton_kernels.adams_masked_update(p_tri, m_tri, indices, grad, **args)
    torch.testing.assert_close(p_tri, p_ref, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(m_tri, m_ref, rtol=1e-6, atol=1e-7)
    off_mask = torch.ones(3000, dtype=torch.bool)
    off_mask[indices] = False
    assert torch.equal(p_tri[off_mask], param[off_mask])
    assert not torch.equal(p_tri[indices], param[indices])


def test_adams_dense_update_matches_reference():
    gen = torch.Generator().manual_seed(5)
    param, momentum = torch.randn(3000, generator=gen), 0.1 * torch.randn(3000, generator=gen)
    grad = torch.randn(3000, generator=gen)
    p_ref, m_ref, p_tri, m_tri = param.clone(), momentum.clone(), param.clone(), momentum.clone()
    args = dict(lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, bias_correction=1 - 0.9 ** 2,
                weight_decay=0.1, decay_end=1700)
    reference.adams_dense_update(p_ref, m_ref, grad, **args)
    triton_kernels.adams_dense_update(p_tri, m_tri, grad, **args)
    torch.testing.assert_close(p_tri, p_ref, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(m_tri, m_ref, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("bits", (1, 2, 4))
@pytest.mark.parametrize("scale_dtype", (torch.bfloat16, torch.float32))
@pytest.mark.parametrize("count", (37 * 64, 37 * 64 + 21))  # a whole number of blocks, and a partial last one
def test_quantize_blocks_matches_reference(bits, scale_dtype, count):
    from scape.quantize import BLOCK, STEP_PER_RMS, dequantize
    gen = torch.Generator().manual_seed(bits)
    values = torch.randn(count, generator=gen) * torch.rand(count, generator=gen).square() * 1e-3
    values[5 * BLOCK:6 * BLOCK] = 0.0  # a block of zeros: step 0, read back as zeros
    args = (bits, STEP_PER_RMS[bits], BLOCK, scale_dtype)
    packed, scale, read_back = triton_kernels.quantize_blocks(values, *args)
    ref_packed, ref_scale, ref_back = reference.quantize_blocks(values, *args)
    # the block's sum of squares adds up in another order: an fp32 scale may lie one ulp away
    # (then codes at a level's edge move by one level); rounded to bf16 the scales agree
    torch.testing.assert_close(scale.float(), ref_scale.float(), rtol=1e-6, atol=0)
    agree = (scale == ref_scale).repeat_interleave(BLOCK)[:count]
    assert scale.dtype == scale_dtype and (agree.all() or scale_dtype == torch.float32)
    assert torch.equal(read_back[agree], ref_back[agree])
    step = ref_scale.float().repeat_interleave(BLOCK)[:count]
    assert ((read_back - ref_back).abs() <= 1.001 * step).all()
    assert torch.equal(dequantize(packed, scale, bits, count), read_back)  # the receivers read what was kept
    if agree.all():
        assert torch.equal(packed, ref_packed)
    assert torch.equal(read_back[5 * BLOCK:6 * BLOCK], torch.zeros(BLOCK))


# Non-finite inputs as a GPU makes them: CUDA's canonical NaN is 0x7FFFFFFF (its payload is all
# ones, so rounding it on the bits carries into the sign), the CPU's is 0x7FC00000.
_NON_FINITE_BITS = {"cuda_nan": 0x7FFFFFFF, "cuda_negative_nan": -1, "cpu_nan": 0x7FC00000,
                    "inf": 0x7F800000, "negative_inf": 0xFF800000 - (1 << 32)}
# finite patterns at rounding's edges: ties to even (down and up), the largest finite float
# (rounds to Inf, as torch's cast does), a subnormal, -0.0
_EDGE_BITS = [0x3F808000, 0x3F818000, 0x7F7FFFFF, 0xFF7FFFFF - (1 << 32), 0x00000001, -(1 << 31)]
_BACKENDS = {"reference": reference, "triton": triton_kernels}


def _from_bits(bits) -> torch.Tensor:
    return torch.tensor(bits, dtype=torch.int32).view(torch.float32)


@pytest.mark.parametrize("backend", _BACKENDS)
def test_gather_and_clear_keeps_nan_and_inf_through_bf16(backend):
    gen = torch.Generator().manual_seed(6)
    source = torch.randn(3000, generator=gen)
    indices = torch.randperm(3000, generator=gen)[:800].sort().values
    special = _from_bits(list(_NON_FINITE_BITS.values()) + _EDGE_BITS)
    source[indices[100:100 + special.numel()]] = special
    sent = source[indices]
    src = source.clone()
    out = _BACKENDS[backend].gather_and_clear(src, indices, torch.empty(800, dtype=torch.bfloat16))
    assert torch.equal(out.float().isnan(), sent.isnan()) and int(sent.isnan().sum()) == 3
    assert torch.equal(out.float().isinf(), sent.to(torch.bfloat16).float().isinf())
    assert torch.equal(out.float().signbit()[sent.isinf()], sent.signbit()[sent.isinf()])
    finite = ~sent.isnan()  # everything else, Inf included, rounds exactly as torch's cast
    assert torch.equal(out[finite].view(torch.int16), sent[finite].to(torch.bfloat16).view(torch.int16))
    # a non-finite value is never taken for a finite one: its residual is NaN, not a clean zero
    kept = src[indices]
    assert torch.equal(kept.isnan(), ~sent.isfinite())
    assert torch.equal(kept[sent.isfinite()], sent[sent.isfinite()] - out[sent.isfinite()].float())


def _blocks_with_non_finite(count: int, block: int) -> tuple:
    gen = torch.Generator().manual_seed(count)
    values = torch.randn(count, generator=gen) * 1e-3
    bad_blocks = {"cuda_nan": 1, "cuda_negative_nan": 3, "cpu_nan": 4, "inf": 6, "negative_inf": 7}
    for name, b in bad_blocks.items():
        values[b * block + 5] = _from_bits([_NON_FINITE_BITS[name]])[0]
    values[-1] = _from_bits([0x7FFFFFFF])[0]  # in the partial last block
    bad = torch.zeros(math.ceil(count / block), dtype=torch.bool)
    bad[list(bad_blocks.values()) + [-1]] = True
    return values, bad, bad_blocks


@pytest.mark.parametrize("backend", _BACKENDS)
@pytest.mark.parametrize("scale_dtype", (torch.bfloat16, torch.float32))
@pytest.mark.parametrize("bits", (1, 2, 4))
def test_quantize_blocks_keeps_nan_and_inf_in_scales_and_read_back(backend, scale_dtype, bits):
    from scape.quantize import BLOCK, STEP_PER_RMS, dequantize
    count = 12 * BLOCK + 9
    values, bad, bad_blocks = _blocks_with_non_finite(count, BLOCK)
    args = (bits, STEP_PER_RMS[bits], BLOCK, scale_dtype)
    packed, scale, read_back = _BACKENDS[backend].quantize_blocks(values, *args)
    nan_blocks = [bad_blocks[n] for n in ("cuda_nan", "cuda_negative_nan", "cpu_nan")] + [scale.numel() - 1]
    assert scale.float()[nan_blocks].isnan().all()
    assert torch.equal(scale.float()[[bad_blocks["inf"], bad_blocks["negative_inf"]]],
                       torch.full((2,), math.inf))
    in_bad = bad.repeat_interleave(BLOCK)[:count]
    received = dequantize(packed, scale, bits, count)
    # every value of a block holding a NaN or Inf reads back non-finite, at both ends: the
    # non-finite policy sees it and skips the step instead of applying zeros
    assert not read_back[in_bad].isfinite().any() and not received[in_bad].isfinite().any()
    assert read_back[~in_bad].isfinite().all()
    assert torch.equal(received[~in_bad], read_back[~in_bad])
    # the finite blocks are as if the bad ones were zeros (blocks are independent)
    clean_packed, clean_scale, clean_back = _BACKENDS[backend].quantize_blocks(values.masked_fill(in_bad, 0.0), *args)
    assert torch.equal(scale[~bad], clean_scale[~bad]) and torch.equal(read_back[~in_bad], clean_back[~in_bad])
