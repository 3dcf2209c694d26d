"""fp8 for Neuron: checkpoint float8_e4m3fn weights made fit for trn2's e4m3, and activation quantization.

trn2 reads fp8 e4m3 as IEEE e4m3: exponent 15 is inf / nan, so the largest finite value is 240, where
float8_e4m3fn (OCP, DeepSeek's checkpoints) reaches 448. Both share every encoding below 256, so only blocks
holding a magnitude above 240 must change: their values are halved and their block scale doubled, which
leaves ``w_fp8 * scale_inv`` unchanged wherever the halved value is representable. Doubling a scale is exact
(a power-of-two factor on an fp32); halving an fp8 value is exact except for the lowest bit of the smallest
magnitudes (below 2**-5, where halving would need a subnormal finer than 2**-9): those round to nearest-even,
and ``rescale_report`` counts them. The rescale runs once on the host at load, never per shape on the device.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from backend_lib.neuron.platform import FP8_MAX_NEURON
from kernels.quant import FP8_MAX
from kernels.quant import FP8_DTYPE, expand_scales


@dataclass(frozen=True)
class RescaleReport:
    blocks_rescaled: int
    blocks_total: int
    inexact_values: int  # halved values that rounded (their dequantized value moved by half a subnormal step)


def _block_amax(weight: torch.Tensor, scale_inv: torch.Tensor, block_size: tuple[int, int]) -> torch.Tensor:
    """[..., gr, gc] largest |w_fp8| of each block (partial edge blocks included)."""
    w = weight.to(torch.float32).abs()
    b0, b1 = block_size
    rows, cols = w.shape[-2:]
    gr, gc = scale_inv.shape[-2:]
    padded = w.new_zeros((*w.shape[:-2], gr * b0, gc * b1))
    padded[..., :rows, :cols] = w
    return padded.unflatten(-1, (gc, b1)).unflatten(-3, (gr, b0)).amax(dim=(-3, -1))


def rescale_for_neuron(weight: torch.Tensor,  # [..., out, in] float8_e4m3fn
                       scale_inv: torch.Tensor,  # [..., ceil(out/b0), ceil(in/b1)] fp32 (or e8m0)
                       block_size: tuple[int, int] = (128, 128),
                       fp8_max: float = FP8_MAX_NEURON) -> tuple[torch.Tensor, torch.Tensor, RescaleReport]:
    """(weight with every |value| <= fp8_max, fp32 scale grid, report): blocks above ``fp8_max`` are halved
    (and their scale doubled) until they fit; other blocks are returned bit for bit."""
    if weight.dtype != FP8_DTYPE:
        raise ValueError(f"rescale_for_neuron expects float8_e4m3fn weights, got {weight.dtype}")
    if not 0 < fp8_max <= FP8_MAX:
        raise ValueError(f"fp8_max must be in (0, {FP8_MAX}], got {fp8_max}")
    scale = scale_inv.to(torch.float32)
    amax = _block_amax(weight, scale, block_size)
    # Halvings per block: 448 -> 224 needs one; a tighter fp8_max may need more.
    shifts = torch.zeros_like(amax)
    while bool(((amax * torch.exp2(-shifts)) > fp8_max).any()):
        shifts = torch.where(amax * torch.exp2(-shifts) > fp8_max, shifts + 1, shifts)
    factor = expand_scales(torch.exp2(-shifts), weight.shape, block_size)  # per element, 1 where untouched
    values = weight.to(torch.float32)
    halved = (values * factor).to(FP8_DTYPE)
    inexact = int(((halved.to(torch.float32) / factor) != values).sum())
    report = RescaleReport(blocks_rescaled=int((shifts > 0).sum()), blocks_total=shifts.numel(),
                           inexact_values=inexact)
    return halved, scale * torch.exp2(shifts), report


def quantize_activations(x: torch.Tensor,  # [..., K] float
                         group_size: int = 128,
                         fp8_max: float = FP8_MAX_NEURON) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token, per-group fp8 quantization (DeepSeek's dynamic activation scheme) to ``fp8_max``:
    returns (float8_e4m3fn [..., K], fp32 scales [..., ceil(K / group_size)]) with x ~ q * scale."""
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if not 0 < fp8_max <= FP8_MAX:
        raise ValueError(f"fp8_max must be in (0, {FP8_MAX}], got {fp8_max}")
    k = x.shape[-1]
    groups = -(-k // group_size)
    padded = torch.nn.functional.pad(x.to(torch.float32), (0, groups * group_size - k))
    grouped = padded.unflatten(-1, (groups, group_size))
    amax = grouped.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, amax / fp8_max, torch.ones_like(amax))
    q = (grouped / scale).clamp(-fp8_max, fp8_max).to(FP8_DTYPE)
    return q.flatten(-2)[..., :k], scale.squeeze(-1)
