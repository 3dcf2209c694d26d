"""Rotary position embeddings, rotate-half convention (Hugging Face Llama).

The inverse frequencies follow transformers' ``ROPE_INIT_FUNCTIONS`` for the types supported here
("default", "linear", "llama3"). A cos/sin table over all positions is built once; the forward pass only
indexes it by ``positions``, so its shapes never depend on the data.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class RopeScaling:
    rope_type: str = "default"
    factor: float = 1.0
    # llama3 only
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"rope_scaling type must be one of {ROPE_TYPES}, got {self.rope_type!r}")
        if self.factor <= 0:
            raise ValueError(f"rope_scaling factor must be > 0, got {self.factor}")
        if self.rope_type == "llama3":
            if not self.high_freq_factor > self.low_freq_factor > 0:
                raise ValueError("llama3 rope_scaling needs high_freq_factor > low_freq_factor > 0, got "
                                 f"{self.high_freq_factor} and {self.low_freq_factor}")
            if self.original_max_position_embeddings < 1:
                raise ValueError("llama3 rope_scaling original_max_position_embeddings must be >= 1, got "
                                 f"{self.original_max_position_embeddings}")


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None = None) -> torch.Tensor:  # [head_dim/2]
    if head_dim < 2 or head_dim % 2:
        raise ValueError(f"rope head_dim must be an even number >= 2, got {head_dim}")
    if theta <= 0:
        raise ValueError(f"rope_theta must be > 0, got {theta}")
    # int64 arange then float, as transformers does, so the exponents are the same floats.
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    inv_freq = 1.0 / (theta ** exponents)
    if scaling is None or scaling.rope_type == "default":
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    # llama3: long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
    old_len = scaling.original_max_position_embeddings
    low_freq_wavelen = old_len / scaling.low_freq_factor
    high_freq_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rope_cos_sin_cache(
    inv_freq: torch.Tensor,  # [head_dim/2] float32
    max_positions: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # cos, sin: [max_positions, head_dim/2] float32
    if max_positions < 1:
        raise ValueError(f"rope max_positions must be >= 1, got {max_positions}")
    # position * inv_freq in fp32, the same product transformers forms at run time.
    freqs = torch.arange(max_positions, dtype=torch.int64).to(torch.float32)[:, None] * inv_freq[None, :]
    return freqs.cos(), freqs.sin()


def rope_at(
    cos_cache: torch.Tensor,  # [max_positions, head_dim/2] float32
    sin_cache: torch.Tensor,  # [max_positions, head_dim/2] float32
    positions: torch.Tensor,  # [T] int64
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:  # cos, sin: [T, 1, head_dim/2] in dtype
    """The rows of a step's positions, cast to the activations' dtype (as transformers casts them): gathered once
    a step and shared by every layer's q and k, instead of four gathers and casts per layer."""
    return (cos_cache.index_select(0, positions).to(dtype)[:, None, :],
            sin_cache.index_select(0, positions).to(dtype)[:, None, :])


def rotate(
    x: torch.Tensor,  # [T, heads, head_dim]
    cos: torch.Tensor,  # [T, 1, head_dim/2] (rope_at)
    sin: torch.Tensor,  # [T, 1, head_dim/2]
) -> torch.Tensor:  # [T, heads, head_dim]
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    # x * cat(cos, cos) + rotate_half(x) * cat(sin, sin), written on the two halves.
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def apply_rope(
    x: torch.Tensor,  # [T, heads, head_dim]
    cos_cache: torch.Tensor,  # [max_positions, head_dim/2]
    sin_cache: torch.Tensor,  # [max_positions, head_dim/2]
    positions: torch.Tensor,  # [T] int64
) -> torch.Tensor:  # [T, heads, head_dim]
    return rotate(x, *rope_at(cos_cache, sin_cache, positions, x.dtype))


def apply_rope_reference(
    x: torch.Tensor,  # [T, heads, head_dim]
    inv_freq: torch.Tensor,  # [head_dim/2]
    positions: torch.Tensor,  # [T] int64
) -> torch.Tensor:  # [T, heads, head_dim]
    """Per-token rotation matrix form: pair (i, i + D/2) is rotated by angle position * inv_freq[i]."""
    out = torch.empty_like(x)
    half = x.shape[-1] // 2
    for t in range(x.shape[0]):
        angle = positions[t].to(torch.float32) * inv_freq
        c, s = angle.cos().to(x.dtype), angle.sin().to(x.dtype)
        a, b = x[t, :, :half], x[t, :, half:]
        out[t, :, :half] = a * c - b * s
        out[t, :, half:] = a * s + b * c
    return out
