"""DeepSeek-V4 rotary embedding: interleaved pairs ``(x[2i], x[2i+1])`` on the trailing ``rope_dim`` channels of
each head, the leading channels untouched. The layout stays interleaved (unlike V3's, which de-interleaves), so
queries, keys and the output's conjugate rotation (``-sin``) all agree with transformers' ``DeepseekV4``.
"""
from __future__ import annotations

import torch


def rope_cos_sin(inv_freq: torch.Tensor,  # [P / 2] float32
                 positions: torch.Tensor,  # [...] int64
                 attention_scaling: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin), each [..., P / 2]: one angle per interleaved pair."""
    freqs = positions[..., None].float() * inv_freq.to(positions.device).float()
    return (freqs.cos() * attention_scaling).to(dtype), (freqs.sin() * attention_scaling).to(dtype)


def apply_tail_rope(x: torch.Tensor,  # [T, ..., D]: token first, heads (if any) in between
                    cos: torch.Tensor, sin: torch.Tensor,  # [T, P / 2]
                    cpp: bool = False) -> torch.Tensor:  # [T, ..., D]
    """Rotate the last ``P`` channels of every head of every token by its own angles (fp32, cast back). ``cpp``:
    fp32 in one C++ call (kernels/csrc/interleaved_rope.cpp; host engines with the C++ ops built), eagerly only:
    compiled regions fuse the torch form, and an opaque op on the rows written to a ring made inductor copy it."""
    if cpp and x.dtype == cos.dtype == sin.dtype == torch.float32 and not torch.compiler.is_compiling():
        return torch.ops.deepinfer.tail_rope(x, cos, sin)
    extra = x.dim() - 2
    cos = cos.repeat_interleave(2, dim=-1).view(cos.shape[0], *([1] * extra), -1)
    sin = sin.repeat_interleave(2, dim=-1).view(sin.shape[0], *([1] * extra), -1)
    rope_dim = cos.shape[-1]
    nope, rope = x[..., :-rope_dim], x[..., -rope_dim:]
    # (x0, x1) -> (-x1, x0) pairwise, the interleaved "rotate half"
    rotated_half = torch.stack((-rope[..., 1::2], rope[..., 0::2]), dim=-1).flatten(-2)
    rotated = (rope.float() * cos + rotated_half.float() * sin).to(x.dtype)
    return torch.cat([nope, rotated], dim=-1)
