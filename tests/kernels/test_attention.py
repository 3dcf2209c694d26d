"""Paged attention, RoPE and RMSNorm kernels against their plain references (and transformers where it applies)."""
from __future__ import annotations

import pytest
import torch

from kernels.attention import (
    _fused_decode_attention,
    paged_attention,
    paged_decode_attention,
    reference_attention,
    write_kv,
)
from tests.helpers.attention_batches import mixed_batch
from kernels.cpu_kernels import load_cpu_kernels
from kernels.norm import rms_norm, rms_norm_reference
from kernels.rope import RopeScaling, apply_rope, apply_rope_reference, rope_cos_sin_cache, rope_inv_freq

TOL = 1e-5


@pytest.fixture(scope="module")
def cpu_kernels() -> None:
    assert load_cpu_kernels(), "the C++ host kernels (kernels/csrc) did not build: see the warning logged above"


@pytest.mark.parametrize(
    "heads,kv_heads,decode_seq_lens,decode_q,prefill",
    [
        (4, 4, [5, 17, 1], 1, [(7, 7), (3, 12), (1, 9)]),  # MHA; plain prefill, prefix continuation, 1-token chunk
        (6, 2, [9, 33], 3, [(16, 16)]),  # GQA, Q=3 decode (drafts)
        (9, 3, [4, 40, 23, 8], 1, []),  # decode only (SmolLM2 head layout)
        (8, 1, [], 2, [(5, 21), (11, 11)]),  # MQA, prefill only
    ],
)
@pytest.mark.parametrize("head_dim,cpu_kernel", [(16, False), (16, True), (8, True)])  # 8: the kernel's generic loops
def test_paged_attention_matches_reference(heads, kv_heads, decode_seq_lens, decode_q, prefill, head_dim, cpu_kernel,
                                           request):
    if cpu_kernel:
        request.getfixturevalue("cpu_kernels")
    block_size, num_blocks = 4, 64
    meta, num_tokens = mixed_batch(decode_seq_lens, decode_q, prefill, block_size, num_blocks)
    gen = torch.Generator().manual_seed(1)
    num_slots = (num_blocks + 1) * block_size
    # Stale random data everywhere in the cache: any read outside a request's context would show up.
    k_cache = torch.randn(num_slots, kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(num_slots, kv_heads, head_dim, generator=gen)
    q = torch.randn(num_tokens, heads, head_dim, generator=gen)
    k_new = torch.randn(num_tokens, kv_heads, head_dim, generator=gen)
    v_new = torch.randn(num_tokens, kv_heads, head_dim, generator=gen)
    write_kv(k_cache, k_new, meta.slot_mapping)
    write_kv(v_cache, v_new, meta.slot_mapping)
    assert torch.equal(k_cache[meta.slot_mapping], k_new)

    scale = head_dim ** -0.5
    got = paged_attention(q, k_cache, v_cache, meta, scale, cpu_kernel)
    want = reference_attention(q, k_cache, v_cache, meta, scale)
    assert got.shape == q.shape
    assert (got - want).abs().max().item() <= TOL


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_chunks_on_the_cpu_kernel_match_the_reference_alone_and_batched(dtype, cpu_kernels, monkeypatch):
    """Short chunks take the C++ kernel in one call, a chunk past CPU_PREFILL_PAIRS takes SDPA; each request's
    output is the same whether its batch goes through the kernel whole, mixed with an SDPA chunk, or alone."""
    import kernels.attention as attention
    block_size, num_blocks, heads, kv_heads, head_dim = 4, 64, 6, 2, 16
    prefill = [(7, 7), (3, 12), (1, 30), (20, 20)]  # plain, continuation, 1-token chunk of a long context, long
    meta, num_tokens = mixed_batch([], 1, prefill, block_size, num_blocks, seed=4)
    gen = torch.Generator().manual_seed(5)
    k_cache = torch.randn((num_blocks + 1) * block_size, kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn_like(k_cache)
    q = torch.randn(num_tokens, heads, head_dim, generator=gen).to(dtype)
    scale = head_dim ** -0.5
    want = reference_attention(q.float(), k_cache.float(), v_cache.float(), meta, scale)
    whole = paged_attention(q, k_cache, v_cache, meta, scale, cpu_kernel=True)
    monkeypatch.setattr(attention, "CPU_PREFILL_PAIRS", 400)  # each chunk fits, 20 x 30 does not: a call each
    apart = paged_attention(q, k_cache, v_cache, meta, scale, cpu_kernel=True)
    assert torch.equal(apart, whole)
    monkeypatch.setattr(attention, "CPU_PREFILL_PAIRS", 200)  # (20, 20) now takes SDPA, the others the kernel
    mixed = paged_attention(q, k_cache, v_cache, meta, scale, cpu_kernel=True)
    tol = TOL if dtype == torch.float32 else 2e-2
    assert (whole.float() - want).abs().max().item() <= tol
    assert (mixed.float() - want).abs().max().item() <= tol
    short = sum(q_len for q_len, _ in prefill[:3])
    assert torch.equal(mixed[:short], whole[:short])  # a kernel request's output does not depend on its batch
    alone = attention.paged_prefill_attention(q[7:10], k_cache, v_cache, meta.prefill_block_tables[1:2], [3], [12],
                                              block_size, scale, cpu_kernel=True)
    assert torch.equal(alone, whole[7:10])
    with pytest.raises(RuntimeError, match="query count"):
        torch.ops.deepinfer.cpu_paged_prefill_attention(
            q[:7], k_cache, v_cache, meta.prefill_block_tables[:1], torch.tensor([5], dtype=torch.int32),
            torch.tensor([0, 7]), block_size, scale)


@pytest.mark.parametrize("cpu_kernel", [False, True])
def test_decode_ignores_keys_past_seq_len_and_padded_rows_stay_finite(cpu_kernel, request):
    if cpu_kernel:
        request.getfixturevalue("cpu_kernels")
    block_size, num_blocks, heads, head_dim = 4, 8, 2, 8
    meta, num_tokens = mixed_batch([6], 1, [], block_size, num_blocks)
    k_cache = torch.randn((num_blocks + 1) * block_size, heads, head_dim)
    v_cache = torch.randn_like(k_cache)
    q = torch.randn(num_tokens, heads, head_dim)
    before = paged_attention(q, k_cache, v_cache, meta, 1.0, cpu_kernel)
    # Slots 6 and 7 of the request's second block lie past seq_len: changing them must change nothing.
    second_block = int(meta.decode_block_tables[0, 1])
    k_cache[second_block * block_size + 2 :second_block * block_size + 4] = 1e4
    after = paged_attention(q, k_cache, v_cache, meta, 1.0, cpu_kernel)
    assert torch.equal(before, after)

    padded = paged_decode_attention(q, k_cache, v_cache, torch.full((1, 2), num_blocks, dtype=torch.int32),
                                    torch.zeros(1, dtype=torch.int32), 1, block_size, 1.0, cpu_kernel)
    assert torch.isfinite(padded).all()


def test_cpu_decode_kernel_is_one_opaque_op_in_a_compiled_graph(cpu_kernels):
    block_size, num_blocks, heads, kv_heads, head_dim = 4, 64, 9, 3, 64
    meta, num_tokens = mixed_batch([5, 17, 3, 30], 1, [], block_size, num_blocks, seed=5)
    k_cache = torch.randn((num_blocks + 1) * block_size, kv_heads, head_dim)
    v_cache = torch.randn_like(k_cache)
    q = torch.randn(num_tokens, heads, head_dim)

    def attend(q, k_cache, v_cache, tables, seq_lens):
        return paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, 1, block_size, 0.125, True)

    eager = attend(q, k_cache, v_cache, meta.decode_block_tables, meta.decode_seq_lens)
    compiled = torch.compile(attend, fullgraph=True, dynamic=False, backend="inductor")
    assert torch.equal(compiled(q, k_cache, v_cache, meta.decode_block_tables, meta.decode_seq_lens), eager)
    assert (eager - reference_attention(q, k_cache, v_cache, meta, 0.125)).abs().max().item() <= TOL


def test_cpu_decode_kernel_rejects_block_ids_outside_the_cache(cpu_kernels):
    k_cache = torch.randn(8 * 4, 2, 16)
    q = torch.randn(1, 2, 16)
    with pytest.raises(RuntimeError, match="block_tables holds a block id outside the cache"):
        paged_decode_attention(q, k_cache, k_cache, torch.tensor([[0, 8]], dtype=torch.int32),
                               torch.tensor([5], dtype=torch.int32), 1, 4, 1.0, True)


def _decode_case(seq_lens, query_len, head_dim, block_size, dtype=torch.float32, seed=0):
    """SmolLM2's head layout (9 query heads, 3 KV heads) over a stale random cache, tables scattered at random with
    a spare column, as the runner pads; seq_lens may be below query_len (those queries all sit at position 0)."""
    gen = torch.Generator().manual_seed(seed)
    width = max(-(-max(seq_lens) // block_size), 1) + 1
    num_blocks = len(seq_lens) * width + 3
    tables = torch.randperm(num_blocks, generator=gen)[: len(seq_lens) * width].view(len(seq_lens), width)
    k_cache = torch.randn(num_blocks * block_size, 3, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks * block_size, 3, head_dim, generator=gen).to(dtype)
    q = torch.randn(len(seq_lens) * query_len, 9, head_dim, generator=gen).to(dtype)
    return q, k_cache, v_cache, tables.to(torch.int32), torch.tensor(seq_lens, dtype=torch.int32)


# The kernel walks each block in chunks of up to 16 keys, in softmax segments of 256, and splits requests into parts
# of 1,024 keys that merge afterwards: contexts around the chunk, block, segment and part edges (8 queries
# straddling one too), context 1,
# blocks of 32 (two chunks) and 1, short contexts under 8 queries (speculative verification), head_dims with an
# AVX-512 form (16, 64, 128) and without (48, the loops).
@pytest.mark.parametrize("seq_lens,query_len", [([1, 15, 16, 17, 31, 33, 130], 1), ([1, 3, 8, 9, 20, 40], 8),
                                                ([2, 16, 50], 3), ([255, 256, 257, 600], 1), ([260, 300], 8),
                                                ([1023, 1024, 1025, 2100, 40], 1), ([1030, 2050], 8)])
@pytest.mark.parametrize("head_dim,block_size", [(64, 16), (64, 32), (64, 1), (16, 16), (128, 4), (48, 16)])
def test_cpu_decode_kernel_chunks_match_the_torch_form(seq_lens, query_len, head_dim, block_size, cpu_kernels):
    q, k_cache, v_cache, tables, lens = _decode_case(seq_lens, query_len, head_dim, block_size)
    args = (q, k_cache, v_cache, tables, lens, query_len, block_size, head_dim ** -0.5)
    got = paged_decode_attention(*args, cpu_kernel=True)
    want = paged_decode_attention(*args, cpu_kernel=False)
    assert (got - want).abs().max().item() <= TOL


# Requests past 1,024 keys split into parts the threads share (the parts merge in order afterwards); with fewer
# parts than threads, each part splits further by KV head (on 4 threads a 2,100-key request: 3 parts of 3 tasks
# each). Neither may change a bit: one request short and long, a few, a batch, several queries a request.
@pytest.mark.parametrize("seq_lens,query_len", [([2100, 40, 1500], 1), ([130], 1), ([2100], 1), ([300], 8),
                                                ([7, 300], 4), ([5 + 37 * i % 400 for i in range(32)], 1)])
def test_cpu_decode_kernel_gives_the_same_bits_on_any_thread_count(seq_lens, query_len, cpu_kernels):
    q, k_cache, v_cache, tables, lens = _decode_case(seq_lens, query_len, 64, 16)
    args = (q, k_cache, v_cache, tables, lens, query_len, 16, 0.125)
    threads = torch.get_num_threads()
    results = []
    try:
        for count in (1, 2, 4):
            torch.set_num_threads(count)
            results.append(paged_decode_attention(*args, cpu_kernel=True))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(results[0], other) for other in results[1:])


@pytest.mark.parametrize("seq_lens,query_len", [([1, 17, 130], 1), ([1, 5, 40], 8), ([40, 1100], 1)])
@pytest.mark.parametrize("head_dim", [64, 48])
def test_cpu_decode_kernel_bf16_is_the_fp32_kernel_rounded_once(seq_lens, query_len, head_dim, cpu_kernels):
    # Widening bf16 is exact and the math after it is the fp32 kernel's, step for step: equal, not close.
    q, k_cache, v_cache, tables, lens = _decode_case(seq_lens, query_len, head_dim, 16, torch.bfloat16, seed=3)
    rest = (tables, lens, query_len, 16, head_dim ** -0.5)
    got = paged_decode_attention(q, k_cache, v_cache, *rest, cpu_kernel=True)
    fp32 = paged_decode_attention(q.float(), k_cache.float(), v_cache.float(), *rest, cpu_kernel=True)
    assert got.dtype == torch.bfloat16 and torch.equal(got, fp32.to(torch.bfloat16))


@pytest.mark.parametrize("heads,kv_heads,decode_q", [(4, 4, 1), (9, 3, 1), (6, 2, 3), (8, 1, 2)])
def test_fused_decode_attention_matches_reference(heads, kv_heads, decode_q):
    """The form compiled regions take (gather fused into the reductions), run eagerly here; the regions tests
    check it under torch.compile."""
    block_size, num_blocks, head_dim = 4, 64, 16
    meta, num_tokens = mixed_batch([5, 17, 3, 30], decode_q, [], block_size, num_blocks, seed=3)
    gen = torch.Generator().manual_seed(4)
    k_cache = torch.randn((num_blocks + 1) * block_size, kv_heads, head_dim, generator=gen)
    v_cache = torch.randn_like(k_cache)
    q = torch.randn(num_tokens, heads, head_dim, generator=gen)
    got = _fused_decode_attention(q, k_cache, v_cache, meta.decode_block_tables, meta.decode_seq_lens, decode_q,
                                  block_size, 0.25)
    assert (got - reference_attention(q, k_cache, v_cache, meta, 0.25)).abs().max().item() <= TOL
    padded_row = _fused_decode_attention(q[:decode_q], k_cache, v_cache,
                                         torch.full((1, 2), num_blocks, dtype=torch.int32),
                                         torch.zeros(1, dtype=torch.int32), decode_q, block_size, 1.0)
    assert torch.isfinite(padded_row).all()


@pytest.mark.parametrize("scaling", [
    None,
    RopeScaling("linear", factor=4.0),
    RopeScaling("llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64),
])
def test_rope_matches_reference_and_transformers(scaling):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    head_dim, theta, max_pos = 32, 10000.0, 512
    inv_freq = rope_inv_freq(head_dim, theta, scaling)
    cos, sin = rope_cos_sin_cache(inv_freq, max_pos)
    positions = torch.tensor([0, 1, 7, 63, 64, 200, 511])
    x = torch.randn(len(positions), 3, head_dim)
    got = apply_rope(x, cos, sin, positions)
    assert (got - apply_rope_reference(x, inv_freq, positions)).abs().max().item() <= TOL

    rope_parameters = {"rope_type": "default", "rope_theta": theta}
    if scaling is not None:
        rope_parameters = {"rope_theta": theta, "rope_type": scaling.rope_type, "factor": scaling.factor}
        if scaling.rope_type == "llama3":
            rope_parameters.update(low_freq_factor=scaling.low_freq_factor, high_freq_factor=scaling.high_freq_factor,
                                   original_max_position_embeddings=scaling.original_max_position_embeddings)
    config = LlamaConfig(hidden_size=head_dim * 3, num_attention_heads=3, max_position_embeddings=max_pos,
                         rope_parameters=rope_parameters)
    hf_rope = LlamaRotaryEmbedding(config)
    assert torch.equal(hf_rope.inv_freq, inv_freq)
    hf_cos, hf_sin = hf_rope(x, positions[None])
    hf_q, _ = apply_rotary_pos_emb(x.transpose(0, 1)[None], x.transpose(0, 1)[None], hf_cos, hf_sin)
    assert torch.equal(hf_q[0].transpose(0, 1), got)


def test_rope_rejects_unknown_type():
    with pytest.raises(ValueError, match="rope_scaling type"):
        RopeScaling("yarn", factor=2.0)


def test_rms_norm_matches_reference_and_transformers():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    x = torch.randn(5, 48) * 3
    weight = torch.randn(48)
    got = rms_norm(x, weight, 1e-5)
    assert (got - rms_norm_reference(x, weight, 1e-5)).abs().max().item() <= TOL
    hf = LlamaRMSNorm(48, eps=1e-5)
    hf.weight.data.copy_(weight)
    assert torch.equal(hf(x), got)
    bf16 = rms_norm(x.bfloat16(), weight.bfloat16(), 1e-5)
    assert bf16.dtype == torch.bfloat16
    assert torch.equal(hf.bfloat16()(x.bfloat16()), bf16)
