"""fp8 (e4m3) KV cache values: quantize to codes, dequantize codes, with a per-tensor scale per layer.

The cache holds e4m3 codes as uint8 (``kv_cache_dtype=fp8_e4m3``): torch has no index_copy / gather for
float8 on the CPU, and the Neuron compiler mishandles float8 graph inputs and uint8 assembled inside a graph
(../shared/design/NEURON_PORT_NOTES.md). So the codes are computed with plain float and int32 arithmetic (no dtype
bitcasts), kept int32 while they are computed and narrowed to uint8 once, at the store; dequantizing is the same
arithmetic backwards. Both are bit-exact with torch's float8_e4m3fn conversion of the clamped value (tests compare
all 256 codes and random values), so the host C++ kernels and any reader agree on what a byte means.

``fp8_max`` is the largest magnitude stored: 448 (float8_e4m3fn) on the host, 224 on Neuron (trn2's e4m3 tops out
at 240, and the port quantizes activations and KV to 224: DEEPINFER_NEURON_FP8_MAX). Values beyond it saturate.

Scales: value = code * scale. One ``k_scale`` and one ``v_scale`` per layer (vLLM's per-tensor scheme), read from
the checkpoint where it has them (llm-compressor's ``self_attn.k_scale`` / ``v_scale``), else 1.0 as vLLM does:
a fixed scale makes a block's bytes depend only on its tokens (prefix-cache blocks, sessions and every
tensor-parallel rank agree), where a scale measured from the first prefill would depend on which request came
first. e4m3 covers 2^-9 .. 448, which holds K and V of the models served here at scale 1.0.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.quant import FP8_MAX as FP8_E4M3_MAX  # the KV codes' own name for it

_SUBNORMAL_EXP = -9  # e4m3's quantum below 2^-6: every value is a multiple of 2^-9 there
_MIN_NORMAL = 2.0 ** -6


@dataclass(frozen=True)
class KVQuant:
    """How one layer's K and V are stored: e4m3 codes of value / scale, saturated at ``fp8_max``."""

    k_scale: float = 1.0
    v_scale: float = 1.0
    fp8_max: float = FP8_E4M3_MAX

    def __post_init__(self) -> None:
        if not (self.k_scale > 0 and self.v_scale > 0):
            raise ValueError(f"KV scales must be > 0, got k_scale={self.k_scale}, v_scale={self.v_scale}")
        if not 0 < self.fp8_max <= FP8_E4M3_MAX:
            raise ValueError(f"fp8_max must be in (0, {FP8_E4M3_MAX}], got {self.fp8_max}")


def float_codes(x: torch.Tensor,  # [...] float, within the format's range
                mantissa_bits: int, min_exponent: int) -> torch.Tensor:  # [...] int32
    """Round to nearest even in a small binary float format with ``mantissa_bits`` and smallest normal
    2^min_exponent (e4m3: 3, -6; bf16: 7, -126); the code as int32 (sign << (exponent + mantissa bits) | exponent
    field << mantissa_bits | mantissa). In a binade [2^k, 2^(k+1)) the values are multiples of
    2^(k - mantissa_bits) (2^(min_exponent - mantissa_bits) below the normals), so the rounding is
    ``round(|x| / quantum)``, exact in fp32, and code = 2^mantissa_bits * (log2(quantum) - log2(smallest quantum))
    + that multiple: the multiple runs 2^m..2^(m+1) in a normal binade (the top one is the next binade's first
    code) and 0..2^(m+1) in the subnormal one. Plain float and int32 ops: no dtype bitcasts (the Neuron rule)."""
    x = x.to(torch.float32)
    magnitude = x.abs()
    _, exponent = torch.frexp(magnitude)  # magnitude = m * 2^exponent, m in [0.5, 1)
    smallest = min_exponent - mantissa_bits
    quantum_exp = torch.where(magnitude < 2.0 ** min_exponent, torch.full_like(exponent, smallest),
                              exponent - 1 - mantissa_bits)
    half = -quantum_exp // 2  # two steps: 2^133 (bf16's subnormal quantum) overflows fp32 in one
    multiple = torch.round(torch.ldexp(torch.ldexp(magnitude, half), -quantum_exp - half)).to(torch.int32)
    code = (1 << mantissa_bits) * (quantum_exp.to(torch.int32) - smallest) + multiple
    sign_bit = 1 << (mantissa_bits + (8 if mantissa_bits == 7 else 4))
    return code + sign_bit * torch.signbit(x).to(torch.int32)


def float_values(codes: torch.Tensor,  # [...] integer codes of float_codes' format
                 mantissa_bits: int, min_exponent: int) -> torch.Tensor:  # [...] float32
    """(mantissa + 2^m if normal) * 2^(max(exponent field, 1) + min_exponent - 1 - m), signed."""
    c = codes.to(torch.int32)
    exponent_bits = 8 if mantissa_bits == 7 else 4
    field = (c >> mantissa_bits) & ((1 << exponent_bits) - 1)
    normal = (field > 0).to(torch.int32)
    integer = (c & ((1 << mantissa_bits) - 1)) + (normal << mantissa_bits)
    power = (field.clamp_min(1) + (min_exponent - 1 - mantissa_bits)).to(torch.float32)
    magnitude = integer.to(torch.float32) * torch.exp2(power)
    return torch.where((c >> (mantissa_bits + exponent_bits)) & 1 != 0, -magnitude, magnitude)


def e4m3_codes(x: torch.Tensor,  # [...] float
               fp8_max: float = FP8_E4M3_MAX) -> torch.Tensor:  # [...] int32 in [0, 255]
    """e4m3 codes (sign << 7 | exponent << 3 | mantissa) of x clamped to +-fp8_max, rounded to nearest even."""
    return float_codes(x.to(torch.float32).clamp(-fp8_max, fp8_max), 3, -6)


def e4m3_values(codes: torch.Tensor) -> torch.Tensor:  # [...] any integer dtype -> [...] float32
    """The value of each e4m3 code: (mantissa + 8 if normal) * 2^(max(exponent, 1) - 10), signed."""
    return float_values(codes, 3, -6)


def bf16_codes(x: torch.Tensor) -> torch.Tensor:  # [...] float -> [...] int32 in [0, 65535]
    """bf16 bits of x (round to nearest even; finite values within bf16's range), without a bitcast."""
    return float_codes(x, 7, -126)


def bf16_values(codes: torch.Tensor) -> torch.Tensor:  # [...] int32 bf16 bits -> [...] float32
    return float_values(codes, 7, -126)


MIN_SCALE_EXP = -14  # the smallest group scale (an all-zero group), 2^-14


def pow2_scale_exponents(x: torch.Tensor,  # [T, N] float
                         group: int, fp8_max: float) -> torch.Tensor:  # [T, ceil(N / group)] int32
    """log2 of each group's scale: ceil(log2(amax / fp8_max)), at least MIN_SCALE_EXP. From frexp, not a rounded
    log2, so it is exact: a power-of-two scale makes value / scale exact and its bytes computable from the exponent
    alone (fp32: (e + 127) << 23; ue8m0: e + 127)."""
    t, n = x.shape
    groups = -(-n // group)
    padded = torch.nn.functional.pad(x.to(torch.float32), (0, groups * group - n))
    ratio = padded.view(t, groups, group).abs().amax(-1) / fp8_max
    mantissa, exponent = torch.frexp(ratio)  # ratio = m * 2^e, m in [0.5, 1): ceil(log2) = e, or e - 1 at m = 0.5
    ceil_log2 = torch.where(mantissa == 0.5, exponent - 1, exponent)
    ceil_log2 = torch.where(ratio > 0, ceil_log2, torch.full_like(ceil_log2, MIN_SCALE_EXP))  # frexp(0) = (0, 0)
    return ceil_log2.clamp_min(MIN_SCALE_EXP).to(torch.int32)


def grouped_codes(x: torch.Tensor,  # [T, N] float
                  exps: torch.Tensor,  # [T, G] int32 pow2_scale_exponents
                  group: int, fp8_max: float) -> torch.Tensor:  # [T, N] int32 e4m3 codes of x / 2^exp
    per_value = torch.repeat_interleave(exps, group, dim=1)[:, :x.shape[1]]
    return e4m3_codes(torch.ldexp(x.to(torch.float32), -per_value), fp8_max)  # the division is exact


def grouped_values(codes: torch.Tensor,  # [..., N] e4m3 codes
                   exps: torch.Tensor,  # [..., G] int32
                   group: int) -> torch.Tensor:  # [..., N] float32
    scales = torch.repeat_interleave(torch.exp2(exps.to(torch.float32)), group, dim=-1)[..., :codes.shape[-1]]
    return e4m3_values(codes) * scales


def fp32_pow2_bytes(exps: torch.Tensor) -> torch.Tensor:  # [T, G] int32 -> [T, 4 * G] int32 bytes (little-endian)
    """The fp32 bytes of 2^exp: the biased exponent << 23, so 0, 0, its low bit << 7, the rest >> 1."""
    biased = exps + 127
    zeros = torch.zeros_like(biased)
    return torch.stack([zeros, zeros, (biased & 1) << 7, biased >> 1], dim=-1).flatten(-2)


def fp32_pow2_exponents(raw: torch.Tensor) -> torch.Tensor:  # [..., 4 * G] int32 bytes -> [..., G] int32
    quads = raw.unflatten(-1, (-1, 4))
    return ((quads[..., 3] << 1) | (quads[..., 2] >> 7)) - 127


def bf16_bytes(x: torch.Tensor) -> torch.Tensor:  # [T, P] float -> [T, 2 * P] int32 bytes (little-endian)
    bits = bf16_codes(x)
    return torch.stack([bits & 0xFF, bits >> 8], dim=-1).flatten(-2)


def bf16_from_bytes(raw: torch.Tensor) -> torch.Tensor:  # [..., 2 * P] int32 bytes -> [..., P] float32
    pairs = raw.unflatten(-1, (-1, 2))
    return bf16_values(pairs[..., 0] | (pairs[..., 1] << 8))


def quantize_kv(x: torch.Tensor,  # [...] float
                scale: float, fp8_max: float = FP8_E4M3_MAX) -> torch.Tensor:  # [...] uint8 codes
    """Codes of ``x / scale``, narrowed to uint8 here, once, for the store."""
    return e4m3_codes(x.to(torch.float32) / scale, fp8_max).to(torch.uint8)


def dequantize_kv(codes: torch.Tensor,  # [...] uint8
                  scale: float, dtype: torch.dtype = torch.float32) -> torch.Tensor:  # [...] dtype
    return (e4m3_values(codes) * scale).to(dtype)
