"""fp4 (e2m1) expert weights as DeepSeek-V4 checkpoints store them: two e2m1 codes per int8 byte (element ``2j`` in
the low nibble, ``2j + 1`` in the high one) and one scale per row per 32 input elements (ue8m0: a power of two),
``w_real[r, c] = e2m1(code[r, c]) * scale[r, c // 32]`` (transformers ``integrations/finegrained_fp8.py``).
"""
from __future__ import annotations

import torch

FP4_GROUP = 32
# e2m1 code -> value: sign bit 3, then 2 exponent bits and 1 mantissa bit
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
E2M1_MAX = 6.0


def _check(packed: torch.Tensor, scale: torch.Tensor) -> None:
    cols = 2 * packed.shape[-1]
    if cols % FP4_GROUP or tuple(scale.shape[-1:]) != (cols // FP4_GROUP,) or scale.shape[:-1] != packed.shape[:-1]:
        raise ValueError(f"fp4 scale shape {tuple(scale.shape)} does not match packed weight {tuple(packed.shape)}: "
                         f"expected one scale per {FP4_GROUP} of {cols} input elements per row")


def dequantize_fp4(packed: torch.Tensor,  # [..., out, in / 2] int8 (or uint8)
                   scale: torch.Tensor,  # [..., out, in / 32] fp32 or float8_e8m0fnu
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:  # [..., out, in]
    _check(packed, scale)
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=packed.device)
    codes = packed.contiguous().view(torch.uint8).long()
    values = torch.stack([table[codes & 0xF], table[(codes >> 4) & 0xF]], dim=-1).flatten(-2)
    return (values * scale.to(torch.float32).repeat_interleave(FP4_GROUP, dim=-1)).to(dtype)


def quantize_fp4(weight: torch.Tensor,  # [out, in] float, in % 32 == 0
                 ) -> tuple[torch.Tensor, torch.Tensor]:  # packed [out, in / 2] int8, scale [out, in / 32] fp32
    """Round to the nearest e2m1 value under a power-of-two scale per 32 inputs (the largest maps to <= 6)."""
    rows, cols = weight.shape
    if cols % FP4_GROUP:
        raise ValueError(f"fp4 weights need in_features % {FP4_GROUP} == 0, got {cols}")
    w = weight.detach().float().view(rows, cols // FP4_GROUP, FP4_GROUP)
    amax = w.abs().amax(dim=-1)
    scale = torch.exp2(torch.ceil(torch.log2(torch.where(amax > 0, amax / E2M1_MAX, torch.ones_like(amax)))))
    scaled = (w / scale[..., None]).flatten(1)
    table = torch.tensor(E2M1_VALUES[:8])
    magnitude = (scaled.abs()[..., None] - table).abs().argmin(dim=-1)
    codes = magnitude | ((scaled < 0).long() << 3)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8).view(torch.int8)
    return packed, scale
