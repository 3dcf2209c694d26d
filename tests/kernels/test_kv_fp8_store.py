"""The fp8 KV cache's C++ store and its one-op decode loop (kernels/csrc/kv_fp8_store.cpp, llama_decode.cpp): codes
bit-exact with kernels/kv_fp8.py's quantize_kv (ties, saturation at 448 and the device's 224, scales), RoPE equal to
the model-dtype op's, and llama_decode_layers refusing an fp8 cache without its scales (the loop over an fp8 cache
equal to the module path: tests/models/test_llama_decode_op.py)."""
from __future__ import annotations

import pytest
import torch

from kernels.cpu_kernels import load_cpu_kernels
from kernels.fused_layer_ops import rope_qkv_to_cache, rope_qkv_to_cache_fp8
from kernels.kv_fp8 import KVQuant, quantize_kv

pytestmark = pytest.mark.skipif(not load_cpu_kernels(), reason="the C++ host kernels did not build")

HEADS, KV_HEADS, DIM = 4, 2, 64


def _hard_values(n: int) -> torch.Tensor:
    """Every e4m3 value, every midpoint between neighbours (ties), both zeros, values beyond 448, random ones over
    the whole range and below it; n of them."""
    codes = torch.arange(256, dtype=torch.int32)
    values = codes[(codes & 127) != 127].to(torch.uint8).view(torch.float8_e4m3fn).float()
    ordered = values.unique()
    gen = torch.Generator().manual_seed(1)
    spread = torch.randn(n, generator=gen) * torch.exp2(torch.randint(-14, 10, (n,), generator=gen).float())
    picked = torch.cat([values, (ordered[1:] + ordered[:-1]) / 2, torch.tensor([0.0, -0.0, 500.0, -1e4, 464.0,
                                                                                 232.0, -230.0]), spread])
    return picked[:n]


def _qkv(tokens: int, dtype: torch.dtype, k_values: torch.Tensor, v_values: torch.Tensor) -> torch.Tensor:
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(tokens, HEADS * DIM, generator=gen)
    return torch.cat([q, k_values.view(tokens, -1), v_values.view(tokens, -1)], dim=1).to(dtype)


def _rope(tokens: int, dtype: torch.dtype, identity: bool) -> tuple[torch.Tensor, torch.Tensor]:
    if identity:  # cos 1, sin 0: RoPE leaves k as it is, so k's codes are the quantizer's alone
        return torch.ones(tokens, 1, DIM // 2, dtype=dtype), torch.zeros(tokens, 1, DIM // 2, dtype=dtype)
    angles = torch.rand(tokens, 1, DIM // 2, generator=torch.Generator().manual_seed(3)) * 6.3
    return angles.cos().to(dtype), angles.sin().to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("quant", [KVQuant(), KVQuant(0.75, 2.0), KVQuant(1.0, 1.0, 224.0), KVQuant(0.3, 0.1, 224.0)])
@pytest.mark.parametrize("identity", [True, False])
def test_store_writes_quantize_kv_codes_of_the_rotated_k_and_v(dtype, quant, identity):
    tokens, slots = 48, 200  # 48 x 128 K values: every code, every tie, the extremes and random ones
    values = _hard_values(2 * tokens * KV_HEADS * DIM)
    k_values, v_values = values.chunk(2)  # every code and tie in k; random values in both
    v_values = v_values.flip(0)
    qkv = _qkv(tokens, dtype, k_values, v_values)
    cos, sin = _rope(tokens, dtype, identity)
    slot_mapping = torch.randperm(slots, generator=torch.Generator().manual_seed(4))[:tokens]
    # The reference: the model-dtype op's RoPE and store, then kernels/kv_fp8.py's quantizer.
    k_ref, v_ref = torch.zeros(slots, KV_HEADS, DIM, dtype=dtype), torch.zeros(slots, KV_HEADS, DIM, dtype=dtype)
    q_ref = rope_qkv_to_cache(qkv, cos, sin, k_ref, v_ref, slot_mapping, HEADS, KV_HEADS)
    k_codes = torch.full((slots, KV_HEADS, DIM), 0x55, dtype=torch.uint8)
    v_codes = k_codes.clone()
    q = rope_qkv_to_cache_fp8(qkv, cos, sin, k_codes, v_codes, slot_mapping, HEADS, KV_HEADS, quant)
    assert torch.equal(q, q_ref)
    assert torch.equal(k_codes[slot_mapping], quantize_kv(k_ref[slot_mapping], quant.k_scale, quant.fp8_max))
    assert torch.equal(v_codes[slot_mapping], quantize_kv(v_ref[slot_mapping], quant.v_scale, quant.fp8_max))
    untouched = torch.ones(slots, dtype=torch.bool)
    untouched[slot_mapping] = False
    assert bool((k_codes[untouched] == 0x55).all()) and bool((v_codes[untouched] == 0x55).all())
    if identity and quant.k_scale == 1.0:  # the codes cover the format: saturated, both zeros, subnormals
        assert {0x00, 0x80, 0x01, 0x81}.issubset(set(k_codes[slot_mapping].flatten().tolist()))
        top = 0x7E if quant.fp8_max == 448.0 else 0x76
        assert int(k_codes[slot_mapping].max()) == 0x80 | top  # -max: the largest byte


def test_store_refuses_a_slot_outside_the_cache_and_writes_nothing():
    qkv = torch.randn(2, (HEADS + 2 * KV_HEADS) * DIM)
    cos, sin = _rope(2, torch.float32, False)
    k_codes = torch.zeros(16, KV_HEADS, DIM, dtype=torch.uint8)
    v_codes = torch.zeros_like(k_codes)
    with pytest.raises(RuntimeError, match="outside the cache"):
        rope_qkv_to_cache_fp8(qkv, cos, sin, k_codes, v_codes, torch.tensor([3, 16]), HEADS, KV_HEADS, KVQuant())
    assert not k_codes.any() and not v_codes.any()


def test_one_op_decode_loop_refuses_an_fp8_cache_without_its_scales():
    caches = torch.zeros(2, 16, 2, 16, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="one k_scale and one v_scale a layer"):
        torch.ops.deepinfer.llama_decode_layers(
            torch.zeros(1, 64), torch.zeros(1, 1, 8), torch.zeros(1, 1, 8), caches, caches.clone(),
            torch.zeros(1, dtype=torch.long), torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32),
            1, 16, 0.25, 4, 2, 128, 1e-5, [torch.ones(64)] * 4, [torch.ones(1)] * 8, 0, k_scales=[1.0])
