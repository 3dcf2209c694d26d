"""DeepSeek-V3's fp8 MLA latent record (FlashMLA's ``fp8_ds_mla`` layout; ``kv_cache_dtype=fp8_e4m3``).

One record per token and layer, ``R + 4 * ceil(R / 128) + 2 * P`` bytes (656 for DeepSeek-V3's R = 512, P = 64,
against 1,152 in bf16 and 2,304 in fp32):

  [0, R)             e4m3 codes of the normalized latent, divided by its group's scale
  [R, R + 4G)        one fp32 scale per group of 128 latent values (G groups; little-endian): amax / fp8_max rounded
                     up to a power of two (so dividing by it is exact), at least 2^-14 (an all-zero group)
  [R + 4G, end)      the P post-rope key values as bf16 bits, little-endian (RoPE stays in 16 bits: its values
                     feed every head's position term and are not worth the error)

Every byte is computed in int32 (kernels/kv_fp8.py: codes without bitcasts; a power-of-two scale's fp32 bytes from
its exponent alone) and the record narrowed to uint8 once, at the store, as the Neuron port requires. Reading
inverts the same arithmetic on the gathered rows only.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.kv_fp8 import FP8_E4M3_MAX, bf16_codes, bf16_values, e4m3_codes, e4m3_values

GROUP = 128  # latent values per scale
_MIN_SCALE_EXP = -14


@dataclass(frozen=True)
class MLARecord:
    """The record layout of one model: latent width R, RoPE width P, saturation bound."""

    rank: int  # R: kv_lora_rank
    rope_dim: int  # P: qk_rope_head_dim
    fp8_max: float = FP8_E4M3_MAX

    @property
    def groups(self) -> int:
        return -(-self.rank // GROUP)

    @property
    def num_bytes(self) -> int:
        return self.rank + 4 * self.groups + 2 * self.rope_dim


def scale_exponents(latent: torch.Tensor,  # [T, R] float
                    record: MLARecord) -> torch.Tensor:  # [T, G] int32
    """log2 of each group's scale: ceil(log2(amax / fp8_max)), from frexp (exact: no rounded log2)."""
    t = latent.shape[0]
    padded = torch.nn.functional.pad(latent.to(torch.float32), (0, record.groups * GROUP - record.rank))
    ratio = padded.view(t, record.groups, GROUP).abs().amax(-1) / record.fp8_max
    mantissa, exponent = torch.frexp(ratio)  # ratio = m * 2^e, m in [0.5, 1): ceil(log2) = e, or e - 1 at m = 0.5
    ceil_log2 = torch.where(mantissa == 0.5, exponent - 1, exponent)
    ceil_log2 = torch.where(ratio > 0, ceil_log2, torch.full_like(ceil_log2, _MIN_SCALE_EXP))  # frexp(0) = (0, 0)
    return ceil_log2.clamp_min(_MIN_SCALE_EXP).to(torch.int32)


def encode_records(latent: torch.Tensor,  # [T, R] normalized latent
                   k_rope: torch.Tensor,  # [T, P] post-rope key
                   record: MLARecord) -> torch.Tensor:  # [T, num_bytes] uint8
    t = latent.shape[0]
    exps = scale_exponents(latent, record)  # [T, G]
    per_value = torch.repeat_interleave(exps, GROUP, dim=1)[:, :record.rank]
    codes = e4m3_codes(torch.ldexp(latent.to(torch.float32), -per_value), record.fp8_max)  # exact division
    biased = exps + 127  # fp32 bits of 2^e: biased exponent << 23, so bytes 0, 0, low bit << 7, the rest >> 1
    zeros = torch.zeros_like(biased)
    scale_bytes = torch.stack([zeros, zeros, (biased & 1) << 7, biased >> 1], dim=-1).view(t, 4 * record.groups)
    rope = bf16_codes(k_rope)
    rope_bytes = torch.stack([rope & 0xFF, rope >> 8], dim=-1).view(t, 2 * record.rope_dim)
    return torch.cat([codes, scale_bytes, rope_bytes], dim=-1).to(torch.uint8)  # narrowed once


def decode_records(records: torch.Tensor,  # [..., num_bytes] uint8
                   record: MLARecord,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:  # [..., R + P] latent | k_rope
    r, g = record.rank, record.groups
    raw = records.to(torch.int32)
    scale_bytes = raw[..., r:r + 4 * g].unflatten(-1, (g, 4))
    exps = ((scale_bytes[..., 3] << 1) | (scale_bytes[..., 2] >> 7)) - 127  # [..., G]
    scales = torch.repeat_interleave(torch.exp2(exps.to(torch.float32)), GROUP, dim=-1)[..., :r]
    latent = e4m3_values(raw[..., :r]) * scales
    rope_bytes = raw[..., r + 4 * g:].unflatten(-1, (record.rope_dim, 2))
    rope = bf16_values(rope_bytes[..., 0] | (rope_bytes[..., 1] << 8))
    return torch.cat([latent, rope], dim=-1).to(dtype)
