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

from kernels.kv_fp8 import (FP8_E4M3_MAX, bf16_bytes, bf16_from_bytes, fp32_pow2_bytes, fp32_pow2_exponents,
                            grouped_codes, grouped_values, pow2_scale_exponents)

GROUP = 128  # latent values per scale


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


def encode_records(latent: torch.Tensor,  # [T, R] normalized latent
                   k_rope: torch.Tensor,  # [T, P] post-rope key
                   record: MLARecord) -> torch.Tensor:  # [T, num_bytes] uint8
    exps = pow2_scale_exponents(latent, GROUP, record.fp8_max)  # [T, G]
    codes = grouped_codes(latent, exps, GROUP, record.fp8_max)
    return torch.cat([codes, fp32_pow2_bytes(exps), bf16_bytes(k_rope)], dim=-1).to(torch.uint8)  # narrowed once


def decode_records(records: torch.Tensor,  # [..., num_bytes] uint8
                   record: MLARecord,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:  # [..., R + P] latent | k_rope
    r, g = record.rank, record.groups
    raw = records.to(torch.int32)
    latent = grouped_values(raw[..., :r], fp32_pow2_exponents(raw[..., r:r + 4 * g]), GROUP)
    return torch.cat([latent, bf16_from_bytes(raw[..., r + 4 * g:])], dim=-1).to(dtype)
