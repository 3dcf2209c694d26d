"""A Llama decoder layer's small steps as one host C++ op each (kernels/csrc/fused_layer_ops.cpp): RMSNorm, the
residual add fused with the next RMSNorm, SiLU-and-multiply, and RoPE on q and k with the KV-cache write.

Eager host steps only: each replaces 2-14 torch calls whose dispatch, not arithmetic, is their cost at decode
sizes; compiled regions keep the torch forms, which inductor fuses itself. Results equal the torch forms
(kernels/norm.py, kernels/rope.py, backend_lib/models/layers.py) up to the norm's summation order and SiLU's exp
(a polynomial, within ~2 ulp).
"""
from __future__ import annotations

import torch

from kernels.cpu_kernels import cpu_kernels_supported, load_cpu_kernels
from kernels.kv_fp8 import KVQuant


def fused_ops_available(device: torch.device, dtype: torch.dtype) -> bool:
    return cpu_kernels_supported(device, dtype) and load_cpu_kernels()


def rms_norm(x: torch.Tensor,  # [T, hidden]
             weight: torch.Tensor,  # [hidden], x's dtype
             eps: float) -> torch.Tensor:  # [T, hidden]
    return torch.ops.deepinfer.llama_rms_norm(x, weight, eps)


def add_rms_norm(x: torch.Tensor,  # [T, hidden]
                 residual: torch.Tensor,  # [T, hidden]
                 weight: torch.Tensor,  # [hidden]
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:  # normed, x + residual: [T, hidden] each
    return torch.ops.deepinfer.llama_add_rms_norm(x, residual, weight, eps)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:  # x [T, 2 * I] = [gate | up] -> [T, I]
    return torch.ops.deepinfer.silu_and_mul(x)


def rope_qkv_to_cache(qkv: torch.Tensor,  # [T, (H + 2 Hkv) * D], the fused projection's output
                      cos: torch.Tensor,  # [T, 1, D/2] (kernels.rope.rope_at), qkv's dtype
                      sin: torch.Tensor,  # [T, 1, D/2]
                      k_cache: torch.Tensor,  # [num_slots, Hkv, D], written in place
                      v_cache: torch.Tensor,  # [num_slots, Hkv, D], written in place
                      slot_mapping: torch.Tensor,  # [T] int64
                      num_heads: int, num_kv_heads: int) -> torch.Tensor:  # rotated q [T, H, D]
    return torch.ops.deepinfer.rope_qkv_to_cache(qkv, cos, sin, k_cache, v_cache, slot_mapping, num_heads,
                                                 num_kv_heads)


def rope_qkv_to_cache_fp8(qkv: torch.Tensor,  # [T, (H + 2 Hkv) * D], the fused projection's output
                          cos: torch.Tensor,  # [T, 1, D/2] (kernels.rope.rope_at), qkv's dtype
                          sin: torch.Tensor,  # [T, 1, D/2]
                          k_cache: torch.Tensor,  # [num_slots, Hkv, D] uint8 e4m3 codes, written in place
                          v_cache: torch.Tensor,  # [num_slots, Hkv, D] uint8 e4m3 codes, written in place
                          slot_mapping: torch.Tensor,  # [T] int64
                          num_heads: int, num_kv_heads: int,
                          quant: KVQuant) -> torch.Tensor:  # rotated q [T, H, D]
    """rope_qkv_to_cache for an fp8 cache: K and V stored as kernels/kv_fp8.py's quantize_kv codes, bit for bit."""
    return torch.ops.deepinfer.rope_qkv_to_cache_fp8(qkv, cos, sin, k_cache, v_cache, slot_mapping, num_heads,
                                                     num_kv_heads, quant.k_scale, quant.v_scale, quant.fp8_max)
