"""fp8 rescale for Neuron's e4m3 (max 240) and activation quantization to a configurable maximum."""
from __future__ import annotations

import pytest
import torch

from backend_lib.neuron.fp8 import quantize_activations, rescale_for_neuron
from backend_lib.neuron.platform import detect_platform
from kernels.quant import dequantize_block_fp8, quantize_block_fp8

BLOCK = (32, 32)


def _checkpoint(scale_fmt: str, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    w = torch.randn(96, 80, generator=torch.Generator().manual_seed(seed))
    return quantize_block_fp8(w, BLOCK, scale_fmt)


def test_rescaled_weights_fit_240_and_dequantize_bit_identically_where_halving_is_exact():
    weight, scale = _checkpoint("ue8m0")
    assert weight.to(torch.float32).abs().max() > 240  # the checkpoint does use e4m3fn's top range
    new_w, new_s, report = rescale_for_neuron(weight, scale, BLOCK)
    assert new_w.to(torch.float32).abs().max() <= 240
    before = dequantize_block_fp8(weight, scale, BLOCK)
    after = dequantize_block_fp8(new_w, new_s, BLOCK)
    differs = before != after
    # Only the documented edge: halved values below 2**-5 whose last bit cannot be kept.
    assert int(differs.sum()) == report.inexact_values
    assert bool((weight.to(torch.float32).abs()[differs] < 2**-5).all())
    assert report.blocks_rescaled > 0 and report.blocks_total == 3 * 3


def test_ue8m0_checkpoint_without_subnormal_edge_is_bit_identical():
    weight, scale = _checkpoint("ue8m0", seed=1)
    values = weight.to(torch.float32)
    weight = torch.where(values.abs() < 2**-5, torch.zeros_like(values), values).to(weight.dtype)
    new_w, new_s, report = rescale_for_neuron(weight, scale, BLOCK)
    assert report.inexact_values == 0
    assert torch.equal(dequantize_block_fp8(new_w, new_s, BLOCK), dequantize_block_fp8(weight, scale, BLOCK))
    ratio = new_s / scale
    assert bool(((ratio == 1) | (ratio == 2)).all()) and int((ratio == 2).sum()) == report.blocks_rescaled


def test_blocks_below_240_are_untouched_bit_for_bit():
    weight, scale = _checkpoint("float")
    small = (weight.to(torch.float32) / 4).to(weight.dtype)  # every |value| <= 112
    new_w, new_s, report = rescale_for_neuron(small, scale, BLOCK)
    assert report.blocks_rescaled == 0
    assert torch.equal(new_w.view(torch.uint8), small.view(torch.uint8)) and torch.equal(new_s, scale)


def test_rescale_rejects_bad_input():
    weight, scale = _checkpoint("float")
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        rescale_for_neuron(weight.to(torch.float32), scale, BLOCK)
    with pytest.raises(ValueError, match="fp8_max"):
        rescale_for_neuron(weight, scale, BLOCK, fp8_max=500)


@pytest.mark.parametrize("fp8_max", [240.0, 448.0, 224.0])
def test_activation_quantization_respects_the_configured_max(fp8_max):
    x = torch.randn(5, 300, generator=torch.Generator().manual_seed(2)) * 7
    q, scale = quantize_activations(x, 128, fp8_max)
    assert q.shape == x.shape and scale.shape == (5, 3)
    assert q.to(torch.float32).abs().max() == fp8_max
    restored = q.to(torch.float32) * scale.repeat_interleave(128, dim=-1)[:, :300]
    assert torch.allclose(restored, x, rtol=0.07, atol=1e-6)


def test_platform_fp8_max_defaults_and_env_override():
    assert detect_platform({}, neuron_importable=False).fp8_max == 448.0
    assert detect_platform({"DEEPINFER_NEURON_FP8_MAX": "240"}, neuron_importable=False).fp8_max == 240.0
    with pytest.raises(ValueError, match="DEEPINFER_NEURON_FP8_MAX"):
        detect_platform({"DEEPINFER_NEURON_FP8_MAX": "1000"}, neuron_importable=False)
