"""Context parallelism's pieces without processes: which blocks and slots a context rank holds, and that merging
the ranks' partial attentions (over the blocks each holds, by log-sum-exp) equals attention over all the keys, for
GQA (kernels/attention.py's reference) and MLA's absorbed form (kernels/mla.py's decode)."""
from __future__ import annotations

import pytest
import torch

from backend_lib.models.parallel import ContextGroup
from backend_lib.worker.context_share import local_slots, share_step
from kernels.attention import reference_attention
from kernels.attention_metadata import AttentionMetadata
from kernels.context_attention import (cpp_held_decode, latent_reader, merge_partials, paged_kv_reader,
                                       partial_paged_attention)
from kernels.cpu_kernels import load_cpu_kernels
from kernels.kv_fp8 import KVQuant, e4m3_codes
from kernels.mla import mla_decode_absorbed

BS = 4  # block size
LOCAL = 12  # blocks per rank; the scheduler's pool is LOCAL x ranks


def _rank(rank: int, size: int) -> ContextGroup:
    return ContextGroup(rank=rank, size=size, group=None if size == 1 else "not used by share_step")


def test_held_blocks_and_local_slots():
    size, scratch = 2, 2 * LOCAL
    meta = AttentionMetadata(
        block_size=BS, slot_mapping=torch.tensor([5 * BS + 1, 2 * BS, scratch * BS]), num_decodes=1,
        decode_query_len=1, decode_block_tables=torch.tensor([[4, 5, scratch]]), decode_seq_lens=torch.tensor([6]),
        num_prefills=1, prefill_query_lens=[2], prefill_seq_lens=[2], prefill_block_tables=torch.tensor([[2]]))
    positions = torch.tensor([5, 0, 1])
    zero = share_step(AttentionMetadata(**{**meta.__dict__}), positions, _rank(0, size), LOCAL, 1000)
    one = share_step(AttentionMetadata(**{**meta.__dict__}), positions, _rank(1, size), LOCAL, 1000)
    # Block 4 (positions 0-3) on rank 0 as its local block 2; block 5 (positions 4-7) on rank 1 as its local 2.
    assert zero.context.decode_tables.tolist() == [[2]] and zero.context.decode_starts.tolist() == [[0]]
    assert one.context.decode_tables.tolist() == [[2]] and one.context.decode_starts.tolist() == [[4]]
    assert zero.context.prefill_tables.tolist() == [[1]]
    assert one.context.prefill_tables.tolist() == [[LOCAL]]  # nothing held: the scratch block, past every query
    assert one.context.prefill_starts[0, 0] > 10**9
    assert zero.slot_mapping.tolist() == [LOCAL * BS, 1 * BS, LOCAL * BS]  # the global scratch is rank 0's scratch
    assert one.slot_mapping.tolist() == [2 * BS + 1, LOCAL * BS, LOCAL * BS]
    assert zero.context.row_counts is None
    assert local_slots(torch.tensor([7 * BS + 3]), 1, size, LOCAL, BS).tolist() == [3 * BS + 3]


def _step(size: int, generator: torch.Generator) -> tuple[AttentionMetadata, torch.Tensor]:
    """Two decode requests (2 queries each) and two prefill chunks, one continuing a prefix, over shuffled blocks."""
    blocks = torch.randperm(size * LOCAL, generator=generator).tolist()
    seq = {"d0": 9, "d1": 14, "p0": 7, "p1": 11}
    tables, at = {}, 0
    for name, length in seq.items():
        count = -(-length // BS)
        tables[name], at = blocks[at:at + count], at + count
    scratch = size * LOCAL

    def table(names: list[str]) -> torch.Tensor:
        width = max(len(tables[n]) for n in names)
        return torch.tensor([tables[n] + [scratch] * (width - len(tables[n])) for n in names])
    query_lens = {"d0": 2, "d1": 2, "p0": 7, "p1": 5}
    positions, slots = [], []
    for name in seq:
        for p in range(seq[name] - query_lens[name], seq[name]):
            positions.append(p)
            slots.append(tables[name][p // BS] * BS + p % BS)
    meta = AttentionMetadata(
        block_size=BS, slot_mapping=torch.tensor(slots), num_decodes=2, decode_query_len=2,
        decode_block_tables=table(["d0", "d1"]), decode_seq_lens=torch.tensor([seq["d0"], seq["d1"]]),
        num_prefills=2, prefill_query_lens=[7, 5], prefill_seq_lens=[seq["p0"], seq["p1"]],
        prefill_block_tables=table(["p0", "p1"]))
    return meta, torch.tensor(positions)


def _local(cache: torch.Tensor,  # [(size * LOCAL + 1) * BS, ...] a global cache
           rank: int, size: int) -> torch.Tensor:  # [(LOCAL + 1) * BS, ...] the blocks rank holds, in local order
    blocks = cache.view(size * LOCAL + 1, BS, *cache.shape[1:])
    held = blocks[:-1].view(LOCAL, size, BS, *cache.shape[1:])[:, rank]
    return torch.cat([held, blocks[-1:]]).flatten(0, 1)


@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("split", [False, True])
def test_merged_partials_equal_attention_over_every_key(size, split):
    generator = torch.Generator().manual_seed(size)
    meta, positions = _step(size, generator)
    heads, kv_heads, dim = 6, 2, 8
    slots = (size * LOCAL + 1) * BS
    k_cache = torch.randn(slots, kv_heads, dim, generator=generator)
    v_cache = torch.randn(slots, kv_heads, dim, generator=generator)
    q = torch.randn(positions.shape[0], heads, dim, generator=generator)
    expected = reference_attention(q, k_cache, v_cache, meta, 0.3)
    outs, lses, rows = [], [], None
    for rank in range(size):
        local = share_step(AttentionMetadata(**{**meta.__dict__}), positions, _rank(rank, size), LOCAL,
                           4 if split else 1000)
        read = paged_kv_reader(_local(k_cache, rank, size), _local(v_cache, rank, size), BS, q.dtype)
        out, lse = partial_paged_attention(q, read, local.context, 2, 2, [7, 5], BS, 0.3)
        outs.append(out)
        lses.append(lse)
        rows = local.context.row_counts
    assert (rows is not None) == split
    merged = merge_partials(torch.stack(outs), torch.stack(lses))
    torch.testing.assert_close(merged, expected, atol=2e-6, rtol=1e-5)


def _decode_step(size: int, generator: torch.Generator) -> tuple[AttentionMetadata, torch.Tensor]:
    """Decode rows only, one query each: lengths from one partial block (held by one rank alone) to several."""
    lengths = [3, BS, BS + 1, 3 * BS + 2, 5 * BS]
    blocks = torch.randperm(size * LOCAL, generator=generator).tolist()
    scratch, tables, at = size * LOCAL, [], 0
    for length in lengths:
        count = -(-length // BS)
        tables.append(blocks[at:at + count])
        at += count
    width = max(map(len, tables))
    positions = [length - 1 for length in lengths]
    meta = AttentionMetadata(
        block_size=BS, slot_mapping=torch.tensor([t[p // BS] * BS + p % BS for t, p in zip(tables, positions)]),
        num_decodes=len(lengths), decode_query_len=1,
        decode_block_tables=torch.tensor([t + [scratch] * (width - len(t)) for t in tables]),
        decode_seq_lens=torch.tensor(lengths), num_prefills=0, prefill_query_lens=[], prefill_seq_lens=[],
        prefill_block_tables=torch.zeros(0, 1, dtype=torch.long))
    return meta, torch.tensor(positions)


@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("dim", [64, 12])  # the AVX-512 form and the portable loops
@pytest.mark.parametrize("cache", ["float32", "bfloat16", "fp8"])
def test_the_cpp_decode_over_held_blocks_gives_the_gathered_partials_and_merges_to_every_key(size, dim, cache):
    if not load_cpu_kernels():
        pytest.skip("the C++ kernels do not build here")
    generator = torch.Generator().manual_seed(dim + size)
    meta, positions = _decode_step(size, generator)
    heads, kv_heads = 6, 2
    slots = (size * LOCAL + 1) * BS
    dtype = torch.bfloat16 if cache == "bfloat16" else torch.float32
    k_cache = torch.randn(slots, kv_heads, dim, generator=generator).to(dtype)
    v_cache = torch.randn(slots, kv_heads, dim, generator=generator).to(dtype)
    quant = KVQuant(0.5, 0.25) if cache == "fp8" else None
    if quant is not None:  # the codes, and the values they stand for as the reference's cache
        k_cache = e4m3_codes(k_cache / quant.k_scale).to(torch.uint8)
        v_cache = e4m3_codes(v_cache / quant.v_scale).to(torch.uint8)
    q = torch.randn(positions.shape[0], heads, dim, generator=generator).to(dtype)
    outs, lses = [], []
    for rank in range(size):
        local = share_step(AttentionMetadata(**{**meta.__dict__}), positions, _rank(rank, size), LOCAL, 1000)
        k_local, v_local = _local(k_cache, rank, size), _local(v_cache, rank, size)
        read = paged_kv_reader(k_local, v_local, BS, q.dtype, quant)
        gathered = partial_paged_attention(q, read, local.context, meta.num_decodes, 1, [], BS, 0.3)
        in_place = partial_paged_attention(q, read, local.context, meta.num_decodes, 1, [], BS, 0.3,
                                           cpp_held_decode(k_local, v_local, BS, quant))
        tolerance = {"atol": 1e-2, "rtol": 1e-2} if dtype == torch.bfloat16 else {"atol": 2e-6, "rtol": 1e-5}
        assert torch.equal(torch.isinf(in_place[1]), torch.isinf(gathered[1]))  # the ranks holding none of a request
        torch.testing.assert_close(in_place[0], gathered[0], **tolerance)
        lse_tolerance = 2e-4 if dtype == torch.bfloat16 else 1e-5  # the flash kernel's bf16 products round apart
        torch.testing.assert_close(in_place[1], gathered[1], atol=lse_tolerance, rtol=lse_tolerance)
        outs.append(in_place[0])
        lses.append(in_place[1])
    assert torch.isinf(torch.stack(lses)).any()  # the premise: some rank holds nothing of the shortest request
    if dtype == torch.float32 and quant is None:
        expected = reference_attention(q, k_cache, v_cache, meta, 0.3)
        torch.testing.assert_close(merge_partials(torch.stack(outs), torch.stack(lses)), expected,
                                   atol=2e-6, rtol=1e-5)


def test_mla_held_latents_merge_to_the_absorbed_decode():
    size, heads, nope, rank, rope, dv = 2, 4, 6, 16, 4, 5
    generator = torch.Generator().manual_seed(7)
    meta, positions = _step(size, generator)
    cache = torch.randn((size * LOCAL + 1) * BS, rank + rope, generator=generator)
    q_nope = torch.randn(4, heads, nope, generator=generator)  # the two decode requests' queries
    q_rope = torch.randn(4, heads, rope, generator=generator)
    w_uk = torch.randn(heads, nope, rank, generator=generator)
    w_uv = torch.randn(heads, dv, rank, generator=generator)
    expected = mla_decode_absorbed(q_nope.view(2, 2, heads, nope), q_rope.view(2, 2, heads, rope),
                                   cache.view(-1, BS, rank + rope), meta.decode_block_tables, meta.decode_seq_lens,
                                   w_uk, w_uv, 0.25).flatten(0, 1)
    q = torch.cat([torch.einsum("thd,hdr->thr", q_nope, w_uk), q_rope], dim=-1)
    outs, lses = [], []
    for r in range(size):
        local = share_step(AttentionMetadata(**{**meta.__dict__}), positions, _rank(r, size), LOCAL, 1000)
        read = latent_reader(_local(cache, r, size).view(-1, BS, rank + rope), None, rank, q.dtype)
        out, lse = partial_paged_attention(q, read, local.context, 2, 2, [], BS, 0.25)
        outs.append(out)
        lses.append(lse)
    merged = merge_partials(torch.stack(outs), torch.stack(lses))[..., :rank]
    torch.testing.assert_close(torch.einsum("thr,hvr->thv", merged, w_uv), expected, atol=1e-4, rtol=1e-4)
