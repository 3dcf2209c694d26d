"""fp8 (float8_e4m3fn) block-quantized weights: quantize, block-dequantize, and the linear op over them.

DeepSeek-V3 checkpoints store each linear weight ``[out, in]`` as float8_e4m3fn with one ``weight_scale_inv``
per 128x128 block (``[ceil(out/128), ceil(in/128)]``, the last block row/column may be partial), such that
``w_real = w_fp8 * scale_inv`` block-wise. Scales are fp32, or ue8m0 (powers of two, DeepSeek-V3.1's
``scale_fmt``), stored as fp32 or as float8_e8m0fnu. Weights stay fp8 in memory; ``block_fp8_linear``
dequantizes block-wise inside the op (or a caller dequantizes once at load with ``dequantize_block_fp8``).
"""
from __future__ import annotations

import math

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn
DEFAULT_BLOCK = (128, 128)
SCALE_FORMATS = ("float", "ue8m0")


def _check_grid(weight: torch.Tensor, scale_inv: torch.Tensor, block_size: tuple[int, int]) -> None:
    rows, cols = weight.shape[-2:]
    expected = (math.ceil(rows / block_size[0]), math.ceil(cols / block_size[1]))
    if tuple(scale_inv.shape[-2:]) != expected or scale_inv.shape[:-2] != weight.shape[:-2]:
        raise ValueError(f"weight_scale_inv shape {tuple(scale_inv.shape)} does not match weight "
                         f"{tuple(weight.shape)} with block {tuple(block_size)}: expected grid {expected}")


def scales_to_float(scale_inv: torch.Tensor) -> torch.Tensor:
    """fp32 view of a scale grid stored as fp32/bf16 or float8_e8m0fnu (a power of two per byte)."""
    return scale_inv.to(torch.float32)


def expand_scales(scale_inv: torch.Tensor, shape: torch.Size | tuple[int, ...],
                  block_size: tuple[int, int]) -> torch.Tensor:
    """Per-element scale for a weight of ``shape`` (partial edge blocks cut off)."""
    rows, cols = shape[-2:]
    s = scales_to_float(scale_inv)
    s = s.repeat_interleave(block_size[0], dim=-2)[..., :rows, :]
    return s.repeat_interleave(block_size[1], dim=-1)[..., :cols]


def dequantize_block_fp8(weight: torch.Tensor,  # [..., out, in] float8_e4m3fn
                         scale_inv: torch.Tensor,  # [..., ceil(out/b0), ceil(in/b1)]
                         block_size: tuple[int, int] = DEFAULT_BLOCK,
                         dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Block-wise ``w_fp8 * scale_inv`` in fp32, cast to ``dtype``; leading dims (stacked experts) allowed."""
    _check_grid(weight, scale_inv, block_size)
    return (weight.to(torch.float32) * expand_scales(scale_inv, weight.shape, block_size)).to(dtype)


def dequantize_block_fp8_reference(weight: torch.Tensor, scale_inv: torch.Tensor,
                                   block_size: tuple[int, int] = DEFAULT_BLOCK) -> torch.Tensor:
    """Plain loop over 2-D blocks, for tests."""
    _check_grid(weight, scale_inv, block_size)
    out = torch.empty(weight.shape, dtype=torch.float32)
    b0, b1 = block_size
    for i in range(scale_inv.shape[0]):
        for j in range(scale_inv.shape[1]):
            block = weight[i * b0:(i + 1) * b0, j * b1:(j + 1) * b1].to(torch.float32)
            out[i * b0:(i + 1) * b0, j * b1:(j + 1) * b1] = block * float(scale_inv[i, j].to(torch.float32))
    return out


def block_fp8_linear(x: torch.Tensor,  # [..., in]
                     weight: torch.Tensor,  # [out, in] float8_e4m3fn
                     scale_inv: torch.Tensor,  # [ceil(out/b0), ceil(in/b1)]
                     block_size: tuple[int, int] = DEFAULT_BLOCK) -> torch.Tensor:
    """``x @ dequant(weight).T`` with the weight kept fp8 in memory; output in ``x.dtype``.

    Activations are not quantized (DeepSeek's "dynamic" activation scheme quantizes them per token group on
    fp8 hardware; on the host and in the oracle the math is the dequantized weight in full precision).
    """
    w = dequantize_block_fp8(weight, scale_inv, block_size, dtype=x.dtype)
    return torch.nn.functional.linear(x, w)


def quantize_block_fp8(weight: torch.Tensor,  # [out, in] float
                       block_size: tuple[int, int] = DEFAULT_BLOCK,
                       scale_fmt: str = "float") -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn weight, fp32 scale_inv grid). ``ue8m0`` rounds each scale up to a power of two."""
    if scale_fmt not in SCALE_FORMATS:
        raise ValueError(f"scale_fmt must be one of {SCALE_FORMATS}, got {scale_fmt!r}")
    if weight.dim() != 2:
        raise ValueError(f"quantize_block_fp8 expects a 2-D weight, got shape {tuple(weight.shape)}")
    rows, cols = weight.shape
    b0, b1 = block_size
    grid = (math.ceil(rows / b0), math.ceil(cols / b1))
    w = weight.detach().to(torch.float32)
    padded = torch.zeros(grid[0] * b0, grid[1] * b1)
    padded[:rows, :cols] = w
    amax = padded.view(grid[0], b0, grid[1], b1).abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    if scale_fmt == "ue8m0":
        # round the exponent up so that no block value exceeds FP8_MAX after division
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    q = (w / expand_scales(scale, w.shape, block_size)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale.to(torch.float32)


def is_power_of_two_grid(scale_inv: torch.Tensor) -> bool:
    s = scales_to_float(scale_inv)
    mantissa, _ = torch.frexp(s)
    return bool(((mantissa == 0.5) & (s > 0)).all())
