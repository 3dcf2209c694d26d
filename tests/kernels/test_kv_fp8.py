"""fp8 (e4m3) KV cache: codes bit-exact against torch's float8_e4m3fn, and attention over the codes equal to
attention over the dequantized cache (kernels/kv_fp8.py, kernels/attention.py, csrc/paged_decode_attention.cpp)."""
from __future__ import annotations

import pytest
import torch

from kernels.attention import (paged_attention, paged_decode_attention, paged_prefill_attention, reference_attention,
                               write_kv)
from kernels.attention_metadata import AttentionMetadata
from kernels.cpu_kernels import load_cpu_kernels
from kernels.kv_fp8 import FP8_E4M3_MAX, KVQuant, dequantize_kv, e4m3_codes, e4m3_values, quantize_kv


def _torch_codes(x: torch.Tensor, fp8_max: float) -> torch.Tensor:
    """The plain reference: clamp, torch's float8_e4m3fn conversion (round to nearest even), its byte."""
    return x.float().clamp(-fp8_max, fp8_max).to(torch.float8_e4m3fn).view(torch.uint8).to(torch.int32)


def _hard_values() -> torch.Tensor:
    """Every finite e4m3 value, every midpoint between neighbours (ties), both zeros, saturating values, and
    random values over the whole range and below it."""
    finite = torch.arange(256, dtype=torch.int32)
    finite = finite[(finite & 127) != 127]  # 0x7F / 0xFF are NaN
    values = finite.to(torch.uint8).view(torch.float8_e4m3fn).float()
    ordered = values.unique()
    gen = torch.Generator().manual_seed(0)
    spread = torch.randn(20000, generator=gen) * torch.exp2(torch.randint(-14, 10, (20000,), generator=gen).float())
    return torch.cat([values, (ordered[1:] + ordered[:-1]) / 2, torch.tensor([0.0, -0.0, 500.0, -1e4, 464.0]),
                      spread])


def test_every_code_decodes_to_torch_float8_value():
    codes = torch.arange(256, dtype=torch.int32)
    expected = codes.to(torch.uint8).view(torch.float8_e4m3fn).float()
    finite = ~torch.isnan(expected)
    assert finite.sum() == 254
    got = e4m3_values(codes)
    assert torch.equal(got[finite], expected[finite])
    assert torch.equal(torch.signbit(got[finite]), torch.signbit(expected[finite]))  # -0.0 keeps its sign


@pytest.mark.parametrize("fp8_max", [FP8_E4M3_MAX, 224.0])
def test_codes_are_bit_exact_with_torch_including_ties_and_the_device_max(fp8_max):
    x = _hard_values()
    codes = e4m3_codes(x, fp8_max)
    assert codes.dtype == torch.int32
    assert torch.equal(codes, _torch_codes(x, fp8_max))
    assert e4m3_values(codes).abs().max() == fp8_max  # saturated, never beyond


def test_quantize_with_a_scale_round_trips_through_the_codes():
    x = _hard_values()[:5000] * 3.0
    for scale in (1.0, 0.75, 2.0):
        codes = quantize_kv(x, scale)
        assert codes.dtype == torch.uint8
        assert torch.equal(codes.to(torch.int32), _torch_codes(x / scale, FP8_E4M3_MAX))
        back = dequantize_kv(codes, scale, torch.float32)
        assert torch.equal(back, codes.view(torch.float8_e4m3fn).float() * scale)
        inside = (x / scale).abs() <= FP8_E4M3_MAX
        assert ((back - x).abs()[inside] <= (x.abs()[inside] / 16 + 2.0**-10 * scale)).all()  # half a step


def test_write_kv_stores_codes_at_the_slots():
    cache = torch.zeros(8, 2, 4, dtype=torch.uint8)
    values = torch.randn(3, 2, 4) * 10
    write_kv(cache, values, torch.tensor([1, 5, 6]), scale=0.5, fp8_max=224.0)
    assert torch.equal(cache[[1, 5, 6]], quantize_kv(values, 0.5, 224.0))
    assert not cache[[0, 2, 3, 4, 7]].any()


def _caches(num_slots: int, hkv: int, d: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    k = quantize_kv(torch.randn(num_slots, hkv, d, generator=gen) * 3, 1.0)
    v = quantize_kv(torch.randn(num_slots, hkv, d, generator=gen), 1.0)
    return k, v


def _decode_case(seed: int, dtype: torch.dtype, head_dim: int, query_len: int = 1, lens=(1, 17, 40, 1100)):
    block_size, hkv, heads = 16, 2, 6
    widths = [-(-n // block_size) for n in lens]
    num_blocks = sum(widths) + 1
    k, v = _caches(num_blocks * block_size, hkv, head_dim, seed)
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed))
    tables = torch.full((len(lens), max(widths)), num_blocks - 1, dtype=torch.int32)
    at = 0
    for i, w in enumerate(widths):
        tables[i, :w] = perm[at:at + w]
        at += w
    q = torch.randn(len(lens) * query_len, heads, head_dim, generator=torch.Generator().manual_seed(seed + 1))
    return q.to(dtype), k, v, tables, torch.tensor(lens, dtype=torch.int32), block_size


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim,query_len", [(64, 1), (32, 3), (48, 1)])
@pytest.mark.parametrize("scales", [(1.0, 1.0), (0.5, 2.0)])
def test_cpp_decode_over_codes_equals_decode_over_the_dequantized_cache(dtype, head_dim, query_len, scales):
    """Power-of-two scales: the codes widened in registers give the same bits as the kernel over dequantized K/V."""
    if not load_cpu_kernels():
        pytest.skip("no C++ toolchain")
    q, k, v, tables, lens, bs = _decode_case(head_dim + query_len, dtype, head_dim, query_len)
    quant = KVQuant(*scales)
    fp8 = paged_decode_attention(q, k, v, tables, lens, query_len, bs, 0.125, cpu_kernel=True, kv_quant=quant)
    k_ref, v_ref = dequantize_kv(k, scales[0], dtype), dequantize_kv(v, scales[1], dtype)
    ref = paged_decode_attention(q, k_ref, v_ref, tables, lens, query_len, bs, 0.125, cpu_kernel=True)
    assert torch.equal(fp8, ref)
    torch_form = paged_decode_attention(q, k, v, tables, lens, query_len, bs, 0.125, kv_quant=quant)
    assert torch.equal(torch_form, paged_decode_attention(q, k_ref, v_ref, tables, lens, query_len, bs, 0.125))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(fp8.float(), torch_form.float(), atol=tol, rtol=tol)


def test_cpp_decode_with_any_scale_is_within_summation_order_of_the_dequantized_cache():
    if not load_cpu_kernels():
        pytest.skip("no C++ toolchain")
    q, k, v, tables, lens, bs = _decode_case(5, torch.float32, 64)
    quant = KVQuant(0.37, 1.9)
    fp8 = paged_decode_attention(q, k, v, tables, lens, 1, bs, 0.125, cpu_kernel=True, kv_quant=quant)
    ref = paged_decode_attention(q, dequantize_kv(k, 0.37), dequantize_kv(v, 1.9), tables, lens, 1, bs, 0.125,
                                 cpu_kernel=True)
    torch.testing.assert_close(fp8, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("cpu_kernel", [False, True])
def test_prefill_and_mixed_steps_over_codes_equal_the_dequantized_cache(cpu_kernel):
    if cpu_kernel and not load_cpu_kernels():
        pytest.skip("no C++ toolchain")
    block_size, hkv, heads, d = 4, 2, 4, 32
    k, v = _caches(40 * block_size, hkv, d, 3)
    quant = KVQuant(0.5, 0.25)
    q = torch.randn(2 + 5 + 9, heads, d, generator=torch.Generator().manual_seed(4))
    meta = AttentionMetadata(
        block_size=block_size, slot_mapping=torch.zeros(16, dtype=torch.int64), num_decodes=2, decode_query_len=1,
        decode_block_tables=torch.tensor([[3, 9, 0], [7, 1, 2]], dtype=torch.int32),
        decode_seq_lens=torch.tensor([10, 12], dtype=torch.int32), num_prefills=2, prefill_query_lens=[5, 9],
        prefill_seq_lens=[7, 30],
        prefill_block_tables=torch.tensor([[11, 12, 0, 0, 0, 0, 0, 0], [20, 5, 21, 30, 31, 32, 33, 34]],
                                          dtype=torch.int32))
    k_ref, v_ref = dequantize_kv(k, 0.5), dequantize_kv(v, 0.25)
    fp8 = paged_attention(q, k, v, meta, 0.2, cpu_kernel, quant)
    ref = paged_attention(q, k_ref, v_ref, meta, 0.2, cpu_kernel)
    assert torch.equal(fp8, ref)
    torch.testing.assert_close(fp8, reference_attention(q, k_ref, v_ref, meta, 0.2), atol=1e-5, rtol=1e-5)
    # A chunk past CPU_PREFILL_PAIRS takes the gather + SDPA form (this request's blocks dequantized) either way.
    long_q = torch.randn(200, heads, d, generator=torch.Generator().manual_seed(5))
    table = torch.arange(100, 150, dtype=torch.int32)[None]
    k, v = _caches(160 * block_size, hkv, d, 6)
    long = paged_prefill_attention(long_q, k, v, table, [200], [200], block_size, 0.2, cpu_kernel, quant)
    torch.testing.assert_close(long, paged_prefill_attention(long_q, dequantize_kv(k, 0.5), dequantize_kv(v, 0.25),
                                                             table, [200], [200], block_size, 0.2, cpu_kernel),
                               atol=0, rtol=0)


def test_fp8_decode_compiles_to_the_eager_result():
    """The fused gather + dequantize form traced by torch.compile (aot_eager) equals the eager gather form."""
    q, k, v, tables, lens, bs = _decode_case(9, torch.float32, 32, query_len=2, lens=(3, 20, 33))
    quant = KVQuant(0.5, 1.0, 224.0)

    def step(q, k, v, tables, lens):
        return paged_decode_attention(q, k, v, tables, lens, 2, bs, 0.3, kv_quant=quant)

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True, dynamic=False)
    torch.testing.assert_close(compiled(q, k, v, tables, lens), step(q, k, v, tables, lens), atol=1e-6, rtol=1e-6)

    def store(cache, values, slots):
        write_kv(cache, values, slots, 0.5, 224.0)
        return cache

    values, slots = torch.randn(5, 2, 32) * 100, torch.tensor([3, 0, 9, 4, 1])
    eager = store(torch.zeros(16, 2, 32, dtype=torch.uint8), values, slots)
    graph = torch.compile(store, backend="aot_eager", fullgraph=True, dynamic=False)
    assert torch.equal(graph(torch.zeros(16, 2, 32, dtype=torch.uint8), values, slots), eager)
