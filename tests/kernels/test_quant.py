"""fp8 e4m3fn 128x128 block quantization: round trip, partial edge blocks, ue8m0 scales, the linear op."""
from __future__ import annotations

import pytest
import torch

from kernels.quant import (FP8_MAX, block_fp8_linear, dequantize_block_fp8, dequantize_block_fp8_reference,
                           is_power_of_two_grid, quantize_block_fp8)


@pytest.mark.parametrize("shape", [(128, 128), (200, 300), (576, 7), (64, 256)])
@pytest.mark.parametrize("scale_fmt", ["float", "ue8m0"])
def test_block_dequant_matches_reference_and_roundtrips(shape, scale_fmt):
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(shape, generator=gen) * torch.rand(shape[0], 1, generator=gen) * 3
    q, scale = quantize_block_fp8(w, (128, 128), scale_fmt)
    assert q.dtype == torch.float8_e4m3fn
    assert scale.shape == (-(-shape[0] // 128), -(-shape[1] // 128)) and scale.dtype == torch.float32
    assert q.float().abs().max() <= FP8_MAX
    deq = dequantize_block_fp8(q, scale)
    assert torch.equal(deq, dequantize_block_fp8_reference(q, scale))
    # e4m3 has 3 mantissa bits: relative error per element <= 2^-4 (plus subnormal floor)
    assert ((deq - w).abs() <= w.abs() * 2 ** -4 + scale.max() * 2 ** -9).all()
    if scale_fmt == "ue8m0":
        assert is_power_of_two_grid(scale)


def test_ue8m0_scales_are_powers_of_two_and_e8m0_storage_loads():
    w = torch.randn(256, 384)
    q, scale = quantize_block_fp8(w, scale_fmt="ue8m0")
    assert is_power_of_two_grid(scale)
    e8m0 = scale.to(torch.float8_e8m0fnu)  # the format some checkpoints store scales in
    assert torch.equal(dequantize_block_fp8(q, e8m0), dequantize_block_fp8(q, scale))


def test_block_linear_equals_dense_linear_on_dequantized_weight():
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(300, 260, generator=gen)
    q, scale = quantize_block_fp8(w)
    x = torch.randn(5, 260, generator=gen)
    assert torch.equal(block_fp8_linear(x, q, scale), x @ dequantize_block_fp8(q, scale).T)


def test_stacked_expert_weights_dequantize_per_expert():
    ws = [torch.randn(130, 70) for _ in range(3)]
    qs, ss = zip(*(quantize_block_fp8(w) for w in ws))
    stacked = dequantize_block_fp8(torch.stack(qs), torch.stack(ss))
    for e in range(3):
        assert torch.equal(stacked[e], dequantize_block_fp8(qs[e], ss[e]))


def test_bad_scale_grid_is_rejected():
    q, scale = quantize_block_fp8(torch.randn(256, 128))
    with pytest.raises(ValueError, match="weight_scale_inv shape"):
        dequantize_block_fp8(q, scale[:1])
    with pytest.raises(ValueError, match="scale_fmt"):
        quantize_block_fp8(torch.randn(4, 4), scale_fmt="e5m2")
