"""Block quantization of the drifts (scape/quantize.py): levels, packing, error, bytes."""
import math

import pytest
import torch

from scape.quantize import BITS, BLOCK, STEP_PER_RMS, dequantize, packed_nbytes, quantize


@pytest.mark.parametrize("bits", BITS)
def test_each_value_reads_back_as_its_codes_level_and_the_bytes_are_counted(bits):
    count = 3 * BLOCK + 5  # a partial last block, and codes that do not fill their last byte
    values = torch.randn(count, generator=torch.Generator().manual_seed(bits)) * 2e-3
    packed, scale, read_back = quantize(values, bits, torch.float32)
    assert packed.dtype == torch.uint8 and packed.numel() + 4 * scale.numel() == packed_nbytes(count, bits, 4)
    assert scale.numel() == math.ceil(count / BLOCK)
    rms = torch.nn.functional.pad(values, (0, BLOCK - 5)).view(-1, BLOCK).square().mean(1).sqrt()
    torch.testing.assert_close(scale, rms * STEP_PER_RMS[bits])
    step = scale.repeat_interleave(BLOCK)[:count]
    half = 2 ** (bits - 1)
    level = torch.floor(values / step).clamp(-half, half - 1)  # the code, less 2^(b-1)
    back = dequantize(packed, scale, bits, count)
    torch.testing.assert_close(back, (level + 0.5) * step, rtol=0, atol=0)
    assert torch.equal(read_back, back)  # the sender's read-back is what the receivers decode
    assert len(set((level + half).long().tolist())) == 2 ** bits  # every code is used


@pytest.mark.parametrize("bits,bound", [(1, 0.40), (2, 0.14), (4, 0.02)])
def test_the_error_on_a_gaussian_is_near_the_least_for_a_uniform_quantizer(bits, bound):
    values = torch.randn(64 * BLOCK, generator=torch.Generator().manual_seed(0)) * 3e-4
    packed, scale, _ = quantize(values, bits, torch.bfloat16)
    back = dequantize(packed, scale, bits, values.numel())
    relative = (values - back).square().mean() / values.square().mean()
    assert relative < bound  # Max's least errors: 0.363, 0.118, 0.0095
    if bits == 1:  # the sign times the block's step / 2
        assert torch.equal(back.sign(), values.sign())


def test_a_block_of_zeros_reads_back_as_zeros():
    values = torch.cat([torch.zeros(BLOCK), torch.ones(BLOCK // 2)])
    packed, scale, _ = quantize(values, 2, torch.bfloat16)
    back = dequantize(packed, scale, 2, values.numel())
    assert scale[0] == 0 and torch.equal(back[:BLOCK], torch.zeros(BLOCK))
    assert (back[BLOCK:] > 0).all() and STEP_PER_RMS[2] == pytest.approx(0.9957)


@pytest.mark.parametrize("bits", BITS)
def test_a_whole_number_of_blocks_reads_back_the_same_as_a_padded_one(bits):
    values = torch.randn(4 * BLOCK, generator=torch.Generator().manual_seed(1)) * 1e-3
    packed, scale, read_back = quantize(values, bits, torch.bfloat16)  # no padding copy
    padded, padded_scale, padded_back = quantize(torch.cat([values, torch.ones(1)]), bits, torch.bfloat16)
    assert torch.equal(scale, padded_scale[:-1]) and torch.equal(read_back, padded_back[:-1])
    assert torch.equal(packed, padded[:packed.numel()])
    assert torch.equal(dequantize(packed, scale, bits, values.numel()), read_back)


@pytest.mark.parametrize("scale_dtype", (torch.bfloat16, torch.float32))
def test_a_nan_or_inf_makes_its_block_read_back_non_finite_at_both_ends(scale_dtype):
    # CUDA's NaNs (0x7FFFFFFF, 0xFFFFFFFF) and both Infs, each in its own block
    special = torch.tensor([0x7FFFFFFF, -1, 0x7F800000, 0xFF800000 - (1 << 32)], dtype=torch.int32)
    values = torch.randn(6 * BLOCK, generator=torch.Generator().manual_seed(7)) * 1e-3
    values[[BLOCK + 3, 2 * BLOCK, 4 * BLOCK + 63, 5 * BLOCK + 1]] = special.view(torch.float32)
    bits = 2
    packed, scale, read_back = quantize(values, bits, scale_dtype)
    assert scale.float()[[1, 2]].isnan().all() and torch.equal(scale.float()[[4, 5]], torch.full((2,), math.inf))
    back = dequantize(packed, scale, bits, values.numel()).view(-1, BLOCK)
    assert not back[1:3].isfinite().any() and not back[4:].isfinite().any()
    assert not read_back.view(-1, BLOCK)[[1, 2, 4, 5]].isfinite().any()
    assert back[[0, 3]].isfinite().all() and torch.equal(back[[0, 3]], read_back.view(-1, BLOCK)[[0, 3]])
    assert not math.isfinite(float(back.square().sum()))  # what the policy reads
