"""The fused host ops of a Llama layer (kernels/fused_layer_ops.py) against the torch forms they replace."""
from __future__ import annotations

import pytest
import torch

from backend_lib.models.layers import silu_and_mul as torch_silu_and_mul
from kernels import fused_layer_ops as fused
from kernels.attention import write_kv
from kernels.norm import rms_norm as torch_rms_norm
from kernels.rope import rope_at, rotate

pytestmark = pytest.mark.skipif(not fused.fused_ops_available(torch.device("cpu"), torch.float32),
                                reason="the C++ host kernels did not build")

DTYPES = [torch.float32, torch.bfloat16]


def _ulps(dtype: torch.dtype) -> float:
    return 0.0 if dtype == torch.float32 else 2 ** -7  # relative size of one bf16 ulp


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden", [(1, 576), (32, 576), (7, 100)])
def test_rms_norm_and_add_rms_norm_equal_the_torch_norm(dtype, rows, hidden):
    torch.manual_seed(rows + hidden)
    x, residual = torch.randn(rows, hidden).to(dtype), torch.randn(rows, hidden).to(dtype)
    weight = (1 + 0.1 * torch.randn(hidden)).to(dtype)
    # Only the mean's summation order differs: ~1e-7 relative in fp32, at most one bf16 rounding step in bf16.
    tol = dict(rtol=max(1e-6, 2 * _ulps(dtype)), atol=1e-6)
    torch.testing.assert_close(fused.rms_norm(x, weight, 1e-5), torch_rms_norm(x, weight, 1e-5), **tol)
    normed, summed = fused.add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(summed, x + residual)
    torch.testing.assert_close(normed, torch_rms_norm(x + residual, weight, 1e-5), **tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [1536, 1543])  # 16-lane body only; body and a scalar tail
def test_silu_and_mul_equals_the_torch_form(dtype, inter):
    torch.manual_seed(0)
    x = (4 * torch.randn(33, 2 * inter)).to(dtype)
    x[0, :4] = torch.tensor([-200.0, 200.0, 0.0, -0.0]).to(dtype)  # exp overflow and zero stay finite
    got = fused.silu_and_mul(x)
    assert got.shape == (33, inter) and got.dtype == dtype and torch.isfinite(got).all()
    torch.testing.assert_close(got, torch_silu_and_mul(x), rtol=max(1e-6, 2 * _ulps(dtype)), atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_qkv_to_cache_equals_rotate_and_write_kv_bit_for_bit(dtype):
    torch.manual_seed(1)
    tokens, heads, kv_heads, dim, slots = 9, 9, 3, 64, 40
    qkv_full = torch.randn(tokens, (heads + 2 * kv_heads) * dim + 8).to(dtype)
    qkv = qkv_full[:, :(heads + 2 * kv_heads) * dim]  # rows with a stride, like a split of a wider output
    positions = torch.tensor([0, 1, 5, 17, 100, 2047, 3, 4, 9])
    angles = torch.arange(2048, dtype=torch.float32)[:, None] * (10000.0 ** (-torch.arange(0, dim, 2) / dim))
    cos, sin = rope_at(angles.cos(), angles.sin(), positions, dtype)
    slot_mapping = torch.randperm(slots)[:tokens]
    k_cache, v_cache = torch.zeros(slots, kv_heads, dim, dtype=dtype), torch.zeros(slots, kv_heads, dim, dtype=dtype)
    q = fused.rope_qkv_to_cache(qkv, cos, sin, k_cache, v_cache, slot_mapping, heads, kv_heads)

    q_ref, k_ref, v_ref = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    k_cache_ref, v_cache_ref = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    write_kv(k_cache_ref, rotate(k_ref.reshape(tokens, kv_heads, dim), cos, sin), slot_mapping)
    write_kv(v_cache_ref, v_ref.reshape(tokens, kv_heads, dim), slot_mapping)
    assert torch.equal(q, rotate(q_ref.reshape(tokens, heads, dim), cos, sin))
    assert torch.equal(k_cache, k_cache_ref) and torch.equal(v_cache, v_cache_ref)


def test_bad_inputs_name_the_argument_and_leave_the_cache_untouched():
    k_cache, v_cache = torch.zeros(4, 1, 8), torch.zeros(4, 1, 8)
    qkv, cos, sin = torch.randn(2, 24), torch.ones(2, 1, 4), torch.zeros(2, 1, 4)
    with pytest.raises(RuntimeError, match="slot 9 outside the cache"):
        fused.rope_qkv_to_cache(qkv, cos, sin, k_cache, v_cache, torch.tensor([1, 9]), 1, 1)
    assert not k_cache.any() and not v_cache.any()
    with pytest.raises(RuntimeError, match="qkv must be"):
        fused.rope_qkv_to_cache(torch.randn(2, 20), cos, sin, k_cache, v_cache, torch.tensor([0, 1]), 1, 1)
    with pytest.raises(RuntimeError, match="weight must be"):
        fused.rms_norm(torch.randn(2, 8), torch.ones(9), 1e-6)
    with pytest.raises(RuntimeError, match="residual must match"):
        fused.add_rms_norm(torch.randn(2, 8), torch.randn(3, 8), torch.ones(8), 1e-6)
    with pytest.raises(RuntimeError, match="silu_and_mul: x must be"):
        fused.silu_and_mul(torch.randn(2, 7))


def _norm_in_kernel_order(x, weight, eps):
    """The kernel's RMSNorm written out in its order of operations: 16 partial sums of squares over the 16-aligned
    body, added in lane order, then the tail; fp32 products and sums unfused, bf16 rounded where torch stores it."""
    xf, hidden = x.float(), x.shape[1]
    body = hidden // 16 * 16
    lanes = torch.zeros(x.shape[0], 16)
    for start in range(0, body, 16):
        chunk = xf[:, start:start + 16]
        lanes = lanes + chunk * chunk
    total = torch.zeros(x.shape[0])
    for lane in range(16):
        total = total + lanes[:, lane]
    for i in range(body, hidden):
        total = total + xf[:, i] * xf[:, i]
    # Tensor by tensor: torch divides by a Python number as a product with its reciprocal. The square root in
    # fp64 rounds to fp32's correctly rounded one (the kernel's sqrtf); torch's fp32 sqrt can be one ulp off.
    mean = total / torch.full_like(total, hidden)
    inv = torch.ones_like(mean) / torch.sqrt((mean + eps).double()).float()
    h = (xf * inv[:, None]).to(x.dtype).float()
    return (weight.float() * h).to(x.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
# 32 and 600 rows: split over the threads
@pytest.mark.parametrize("rows,hidden", [(1, 576), (32, 576), (5, 100), (3, 7), (600, 576)])
def test_rms_norm_is_its_written_order_to_the_bit(dtype, rows, hidden):
    """Pins the norm's bits, whichever of the kernel's loops (16 lanes or scalar) serves the CPU: the decode loop
    op and the per-layer ops must keep agreeing with each other and with earlier runs."""
    torch.manual_seed(rows * hidden)
    x, residual = (3 * torch.randn(rows, hidden)).to(dtype), torch.randn(rows, hidden).to(dtype)
    weight = (1 + 0.1 * torch.randn(hidden)).to(dtype)
    assert torch.equal(fused.rms_norm(x, weight, 1e-5), _norm_in_kernel_order(x, weight, 1e-5))
    normed, summed = fused.add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(summed, x + residual)
    assert torch.equal(normed, _norm_in_kernel_order(x + residual, weight, 1e-5))
