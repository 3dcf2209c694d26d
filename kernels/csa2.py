"""DeepSeek-V4.1's CSA2 pieces that V4's kernels lack: the quantization-aware activation roundings and the
hierarchical candidate pool.

Quantization-aware activations are part of V4.1's math (the model was trained through them): the window K = V after
RoPE goes through fp8 e4m3 in 32-channel blocks with power-of-two scales over every channel, the compressed
entries after RoPE through fp4 e2m1 in 16-channel blocks with e4m3 scales, the indexer's queries and keys through
fp4 in 32-channel blocks with power-of-two scales (transformers main ``_fake_quant_fp8_block`` /
``_fake_quant_fp4_block``). Here they are quantize-then-dequantize in the activation dtype; a channel count that is
not a multiple of the block runs unrounded, as the reference does.

The candidate pool (``candidate_pool``): the candidate source's scores, maxed over blocks of ``block`` consecutive
entries; the block holding each query's newest visible entry is forced in; the best ``top_blocks`` blocks are kept,
ties in block order (``top_k_in_order``, the engine's rule), blocks nobody can see never.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.compressed_attention import top_k_in_order

FP8_MAX, FP4_MAX = 448.0, 6.0
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def _pow2_ceil(t: torch.Tensor) -> torch.Tensor:
    """2^ceil(log2 t) for positive normal floats (the ue8m0 scale), from the float's exponent."""
    mantissa, exponent = torch.frexp(t)
    return torch.ldexp(torch.ones_like(t), exponent - (mantissa == 0.5).to(exponent.dtype))


def fake_quant_fp8(x: torch.Tensor,  # [..., C]
                   block: int = 32) -> torch.Tensor:
    if x.shape[-1] % block:
        return x
    b = x.float().unflatten(-1, (-1, block))
    scale = _pow2_ceil(b.abs().amax(-1, keepdim=True).clamp_min(1e-4) / FP8_MAX)
    q = (b / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()
    return (q * scale).flatten(-2).to(x.dtype)


def e2m1_magnitude_codes(q: torch.Tensor) -> torch.Tensor:  # [...] float32, |q| <= 6 -> [...] int64 in 0..7
    """The nearest e2m1 magnitude's index in (0, 0.5, 1, 1.5, 2, 3, 4, 6), a midpoint to the even index
    (0.25 -> 0, 0.75 -> 1, 2.5 -> 2, 5 -> 4)."""
    grid = torch.tensor(_E2M1, device=q.device)
    mids = (grid[1:] + grid[:-1]) / 2
    up_at_tie = torch.arange(1, len(_E2M1), device=q.device) % 2 == 0
    mag = q.abs()[..., None]
    return torch.where(up_at_tie, mag >= mids, mag > mids).sum(-1)


def e2m1_grid(device: torch.device) -> torch.Tensor:  # [8] float32 the e2m1 magnitudes
    return torch.tensor(_E2M1, device=device)


def round_e2m1(q: torch.Tensor) -> torch.Tensor:  # |q| <= 6, float32
    """Round to the nearest e2m1 value, a midpoint to the even code."""
    return torch.copysign(e2m1_grid(q.device)[e2m1_magnitude_codes(q)], q)


def fp4_block_scales(blocks: torch.Tensor,  # [..., G, block] float32
                     e4m3_scales: bool) -> torch.Tensor:  # [..., G, 1] float32
    """Each block's scale: amax / 6 rounded to e4m3 (NVFP4, 16-blocks) or up to a power of two (MXFP4, ue8m0)."""
    amax = blocks.abs().amax(-1, keepdim=True)
    if e4m3_scales:
        return (amax.clamp_min(FP4_MAX * 2.0 ** -9) / FP4_MAX).to(torch.float8_e4m3fn).float()
    return _pow2_ceil(amax.clamp_min(FP4_MAX * 2.0 ** -126) / FP4_MAX)


def fake_quant_fp4(x: torch.Tensor,  # [..., C]
                   block: int, e4m3_scales: bool = False) -> torch.Tensor:
    if x.shape[-1] % block:
        return x
    b = x.float().unflatten(-1, (-1, block))
    scale = fp4_block_scales(b, e4m3_scales)
    return (round_e2m1((b / scale).clamp(-FP4_MAX, FP4_MAX)) * scale).flatten(-2).to(x.dtype)


def select_in_order(scores: torch.Tensor,  # [L, E] float, -inf where not eligible
                    top_k: int) -> torch.Tensor:  # [L, E] bool
    """The ``top_k`` best eligible columns, ties in column order; every eligible one when there are fewer."""
    eligible = scores > float("-inf")
    if top_k >= scores.shape[-1]:
        return eligible
    if top_k <= 0:
        return torch.zeros_like(eligible)
    return top_k_in_order(scores, top_k) & eligible


def candidate_pool(scores: torch.Tensor,  # [L, E] the candidate source's scores, -inf where not visible
                   visible: torch.Tensor,  # [L] int64 entries each query sees
                   top_blocks: int, block: int) -> torch.Tensor:  # [L, E] bool
    width = scores.shape[-1]
    blocks = F.pad(scores, (0, -width % block), value=float("-inf")).unflatten(-1, (-1, block)).amax(-1)
    newest = torch.div(visible - 1, block, rounding_mode="floor")[:, None]  # -1: nothing visible, nothing forced
    index = torch.arange(blocks.shape[-1], device=scores.device)[None, :]
    blocks = blocks.masked_fill(index == newest, float("inf"))
    return select_in_order(blocks, top_blocks).repeat_interleave(block, dim=-1)[:, :width]
