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

FP8_E4M3_MAX = 448.0  # largest finite float8_e4m3fn
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


def e4m3_codes(x: torch.Tensor,  # [...] float
               fp8_max: float = FP8_E4M3_MAX) -> torch.Tensor:  # [...] int32 in [0, 255]
    """Round to nearest even e4m3 after clamping to +-fp8_max; the code as int32 (sign << 7 | exponent << 3 |
    mantissa). In a binade [2^k, 2^(k+1)) the e4m3 values are multiples of 2^(k-3) (2^-9 below 2^-6), so the
    rounding is ``round(|x| / quantum)``, exact in fp32, and code = 8 * (log2(quantum) + 9) + that multiple: the
    multiple runs 8..16 in a normal binade (16 is the next binade's first code) and 0..16 in the subnormal one."""
    x = x.to(torch.float32).clamp(-fp8_max, fp8_max)
    magnitude = x.abs()
    _, exponent = torch.frexp(magnitude)  # magnitude = m * 2^exponent, m in [0.5, 1)
    quantum_exp = torch.where(magnitude < _MIN_NORMAL, torch.full_like(exponent, _SUBNORMAL_EXP), exponent - 4)
    multiple = torch.round(torch.ldexp(magnitude, -quantum_exp)).to(torch.int32)
    code = 8 * (quantum_exp.to(torch.int32) - _SUBNORMAL_EXP) + multiple
    return code + 128 * torch.signbit(x).to(torch.int32)


def e4m3_values(codes: torch.Tensor) -> torch.Tensor:  # [...] any integer dtype -> [...] float32
    """The value of each e4m3 code: (mantissa + 8 if normal) * 2^(max(exponent, 1) - 10), signed."""
    c = codes.to(torch.int32)
    exponent = (c >> 3) & 15
    normal = (exponent > 0).to(torch.int32)
    magnitude = ((c & 7) + 8 * normal).to(torch.float32) * torch.exp2((exponent.clamp_min(1) - 10).to(torch.float32))
    return torch.where((c & 128) != 0, -magnitude, magnitude)


def quantize_kv(x: torch.Tensor,  # [...] float
                scale: float, fp8_max: float = FP8_E4M3_MAX) -> torch.Tensor:  # [...] uint8 codes
    """Codes of ``x / scale``, narrowed to uint8 here, once, for the store."""
    return e4m3_codes(x.to(torch.float32) / scale, fp8_max).to(torch.uint8)


def dequantize_kv(codes: torch.Tensor,  # [...] uint8
                  scale: float, dtype: torch.dtype = torch.float32) -> torch.Tensor:  # [...] dtype
    return (e4m3_values(codes) * scale).to(dtype)
