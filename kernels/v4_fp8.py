"""DeepSeek-V4's fp8 paged records (``kv_cache_dtype=fp8_e4m3``): compressed entries (CSA / HCA) and the lightning
indexer's keys, in FlashMLA's V4 layouts.

Compressed entry of ``D`` channels whose last ``P`` carry RoPE (584 bytes at V4's D = 512, P = 64, against 1,024 in
bf16 and 2,048 in fp32):

  [0, D - P)                       e4m3 codes of the NoPE channels, each divided by its group's scale
  [D - P, D - P + 2P)              the RoPE channels as bf16 bits, little-endian
  [.., + ceil((D - P) / 64))       one ue8m0 scale a group of 64 NoPE channels: the byte exponent + 127 of a power of
                                   two, ceil(log2(amax / fp8_max)) (at least 2^-14)
  pad                              zeros up to a multiple of 8 bytes (one byte at V4's dimensions)

Indexer key of ``Di`` channels (132 bytes at Di = 128): ``Di`` e4m3 codes, then one fp32 scale, a power of two from
the key's amax (its bytes follow from the exponent, so nothing is bit-cast).

Every byte is computed in int32 and a record narrowed to uint8 once, at the store (the Neuron rule); readers decode
only the rows they gathered. The sliding-window ring stays in the model dtype: it is a fixed per-request buffer (not
paged, its size independent of the context), rewritten every step and read in place by the host's ring attention
kernel, so fp8 there would buy no context and cost a rounding per step on the most recent keys.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.kv_fp8 import (FP8_E4M3_MAX, bf16_bytes, bf16_from_bytes, fp32_pow2_bytes, fp32_pow2_exponents,
                            grouped_codes, grouped_values, pow2_scale_exponents)

ENTRY_GROUP = 64  # NoPE channels per ue8m0 scale


@dataclass(frozen=True)
class EntryRecord:
    """A compressed entry: ``dim`` channels, the last ``rope_dim`` rotary (kept bf16)."""

    dim: int
    rope_dim: int
    fp8_max: float = FP8_E4M3_MAX

    @property
    def nope(self) -> int:
        return self.dim - self.rope_dim

    @property
    def groups(self) -> int:
        return -(-self.nope // ENTRY_GROUP)

    @property
    def num_bytes(self) -> int:
        return -(-(self.nope + 2 * self.rope_dim + self.groups) // 8) * 8

    def encode(self, x: torch.Tensor) -> torch.Tensor:  # [T, dim] float -> [T, num_bytes] uint8
        nope = x[:, :self.nope]
        exps = pow2_scale_exponents(nope, ENTRY_GROUP, self.fp8_max)
        used = self.nope + 2 * self.rope_dim + self.groups
        pad = torch.zeros(x.shape[0], self.num_bytes - used, dtype=torch.int32, device=x.device)
        return torch.cat([grouped_codes(nope, exps, ENTRY_GROUP, self.fp8_max), bf16_bytes(x[:, self.nope:]),
                          exps + 127, pad], dim=-1).to(torch.uint8)  # narrowed once

    def decode(self, records: torch.Tensor,  # [..., num_bytes] uint8
               dtype: torch.dtype = torch.float32) -> torch.Tensor:  # [..., dim]
        raw = records.to(torch.int32)
        n, p = self.nope, self.rope_dim
        exps = raw[..., n + 2 * p:n + 2 * p + self.groups] - 127
        return torch.cat([grouped_values(raw[..., :n], exps, ENTRY_GROUP),
                          bf16_from_bytes(raw[..., n:n + 2 * p])], dim=-1).to(dtype)


@dataclass(frozen=True)
class IndexKeyRecord:
    """A lightning-indexer key: ``dim`` e4m3 codes and one power-of-two fp32 scale."""

    dim: int
    fp8_max: float = FP8_E4M3_MAX

    @property
    def num_bytes(self) -> int:
        return self.dim + 4

    def encode(self, x: torch.Tensor) -> torch.Tensor:  # [T, dim] float -> [T, dim + 4] uint8
        exps = pow2_scale_exponents(x, self.dim, self.fp8_max)  # [T, 1]
        return torch.cat([grouped_codes(x, exps, self.dim, self.fp8_max), fp32_pow2_bytes(exps)],
                         dim=-1).to(torch.uint8)

    def decode(self, records: torch.Tensor,  # [..., dim + 4] uint8
               dtype: torch.dtype = torch.float32) -> torch.Tensor:  # [..., dim]
        raw = records.to(torch.int32)
        return grouped_values(raw[..., :self.dim], fp32_pow2_exponents(raw[..., self.dim:]), self.dim).to(dtype)


def store_entries(entries: torch.Tensor,  # [E, C] paged entries (fp8: [E, record bytes] uint8)
                  rows: torch.Tensor,  # [T] int64
                  values: torch.Tensor,  # [T, dim]
                  record: EntryRecord | IndexKeyRecord | None) -> None:
    """Write each token's candidate entry at its row (in place): as a record, or in the cache's dtype."""
    entries[rows] = record.encode(values) if record is not None else values.to(entries.dtype)


def entry_values(rows: torch.Tensor,  # [..., C] gathered entries
                 record: EntryRecord | IndexKeyRecord | None, dtype: torch.dtype) -> torch.Tensor:  # [..., dim]
    """Gathered entries as values: records decoded to ``dtype``; a plain cache's rows as they are."""
    return record.decode(rows, dtype) if record is not None else rows
