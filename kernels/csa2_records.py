"""DeepSeek-V4.1's fp4 paged records (``kv_cache_dtype=fp8_e4m3``): compressed entries and index keys in the
layouts vLLM's V4.1 cache uses, the same roundings as the quantization-aware activations (``kernels/csa2.py``).

A record of ``dim`` channels in blocks of ``block``:

  [0, dim / 2)                     e2m1 codes two a byte, the lower channel in the low nibble; a code is
                                   sign << 3 | the magnitude's index in (0, 0.5, 1, 1.5, 2, 3, 4, 6)
  [dim / 2, dim / 2 + dim / block) one scale byte per block: an e4m3 code of amax / 6 (NVFP4, 16-blocks: the
                                   compressed entries, 288 bytes at V4.1's D = 512) or a ue8m0 byte, the exponent
                                   + 127 of 2^ceil(log2(amax / 6)) (MXFP4, 32-blocks: the index keys, 68 bytes at
                                   Di = 128)

With the quantization-aware activations on (the model's math), the values stored are already on this grid, so a
record decodes to exactly the value an fp32 cache holds: the fp8 cache changes the bytes, not the logits. With them
off it rounds the entries as the QAT would. Codes are computed in int32 and narrowed to uint8 once, at the store;
the e4m3 scale bytes come from ``kernels/kv_fp8.py``'s arithmetic codes (no dtype bitcasts), as V4's records do.

The sliding-window rings are not records: they are fixed per-request state the runner allocates in the model
dtype (as V4's), and with QAT on they already hold the fp8 / 32-block values a 528-byte MXFP8 record would.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.csa2 import FP4_MAX, e2m1_grid, e2m1_magnitude_codes, fp4_block_scales
from kernels.kv_fp8 import e4m3_codes, e4m3_values


@dataclass(frozen=True)
class Fp4Record:
    """``dim`` channels as e2m1 codes with one scale byte per ``block`` (e4m3 scales, else ue8m0)."""

    dim: int
    block: int
    e4m3_scales: bool

    def __post_init__(self) -> None:
        if self.dim % self.block or self.block % 2:
            raise ValueError(f"an fp4 record needs dim ({self.dim}) a multiple of its even block ({self.block})")

    @property
    def num_bytes(self) -> int:
        return self.dim // 2 + self.dim // self.block

    def encode(self, x: torch.Tensor) -> torch.Tensor:  # [T, dim] float -> [T, num_bytes] uint8
        blocks = x.float().unflatten(-1, (-1, self.block))  # [T, G, block]
        scale = fp4_block_scales(blocks, self.e4m3_scales)  # [T, G, 1]
        q = (blocks / scale).clamp(-FP4_MAX, FP4_MAX).flatten(-2)
        codes = e2m1_magnitude_codes(q).to(torch.int32) | (torch.signbit(q).to(torch.int32) << 3)
        pairs = codes[:, 0::2] | (codes[:, 1::2] << 4)
        if self.e4m3_scales:
            scale_bytes = e4m3_codes(scale[..., 0])
        else:
            _, exponent = torch.frexp(scale[..., 0])  # scale = 0.5 * 2^exponent
            scale_bytes = exponent.to(torch.int32) + 126
        return torch.cat([pairs, scale_bytes], dim=-1).to(torch.uint8)  # narrowed once

    def decode(self, records: torch.Tensor,  # [..., num_bytes] uint8
               dtype: torch.dtype = torch.float32) -> torch.Tensor:  # [..., dim]
        raw = records.to(torch.int32)
        half = self.dim // 2
        pairs, scale_bytes = raw[..., :half], raw[..., half:]
        codes = torch.stack([pairs & 15, pairs >> 4], dim=-1).flatten(-2)  # [..., dim]
        values = e2m1_grid(records.device)[(codes & 7).long()]
        values = torch.where(codes >= 8, -values, values)
        if self.e4m3_scales:
            scale = e4m3_values(scale_bytes)
        else:
            scale = torch.ldexp(torch.ones_like(scale_bytes, dtype=torch.float32), scale_bytes - 127)
        return (values.unflatten(-1, (-1, self.block)) * scale[..., None]).flatten(-2).to(dtype)


def entry_record(dim: int) -> Fp4Record:
    """The compressed entries' NVFP4 record (the QAT's fp4 / 16 with e4m3 scales)."""
    return Fp4Record(dim, 16, True)


def index_key_record(dim: int) -> Fp4Record:
    """The index keys' MXFP4 record (the QAT's fp4 / 32 with ue8m0 scales)."""
    return Fp4Record(dim, 32, False)
