"""Paged attention over a slot-addressed KV cache (decode and prefill), with a dense reference.

Cache tensors of one layer are ``[num_slots, num_kv_heads, head_dim]`` with
``num_slots = num_blocks_total * block_size``; block ``b`` holds slots ``[b * block_size, (b + 1) * block_size)``.
A query at position ``p`` sees the keys at positions ``0..p`` of its own request.

GQA: query head ``h`` reads KV head ``h // (num_heads // num_kv_heads)`` (transformers' ``repeat_kv`` order);
the kernels group the query heads by KV head instead of repeating K/V.

fp8 caches (``kv_cache_dtype=fp8_e4m3``) are uint8 e4m3 codes with a ``KVQuant`` (kernels/kv_fp8.py): ``write_kv``
quantizes, the C++ kernels widen the codes in registers, and the torch forms dequantize only what they gathered
(one request's blocks, or the fused gather under torch.compile), never the whole cache.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.attention_metadata import AttentionMetadata
from kernels.cpu_kernels import CPU_ATTENTION_DTYPES
from kernels.kv_fp8 import FP8_E4M3_MAX, KVQuant, dequantize_kv, quantize_kv


def write_kv(
    cache: torch.Tensor,  # [num_slots, ...]
    values: torch.Tensor,  # [T, ...]
    slot_mapping: torch.Tensor,  # [T] int64
    scale: float = 1.0,
    fp8_max: float = FP8_E4M3_MAX,
) -> None:
    """Store every token's K or V at its slot (in place); a uint8 (fp8) cache gets e4m3 codes of values / scale."""
    if cache.dtype == torch.uint8:
        cache.index_copy_(0, slot_mapping, quantize_kv(values, scale, fp8_max))
    else:
        cache.index_copy_(0, slot_mapping, values.to(cache.dtype))


def _values(rows: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Gathered cache rows as ``dtype`` values: fp8 codes dequantized, others as they are."""
    return dequantize_kv(rows, scale, dtype) if rows.dtype == torch.uint8 else rows


def _cpu_kernel_takes(q: torch.Tensor, k_cache: torch.Tensor, kv_quant: KVQuant | None) -> bool:
    return q.dtype in CPU_ATTENTION_DTYPES and (k_cache.dtype == q.dtype
                                                or (kv_quant is not None and k_cache.dtype == torch.uint8))


def _gather_blocks(
    cache: torch.Tensor,  # [num_slots, Hkv, D]
    block_tables: torch.Tensor,  # [B, nb] int
    block_size: int,
) -> torch.Tensor:  # [B, Hkv, nb * block_size, D]
    b, nb = block_tables.shape
    if torch.compiler.is_compiling():
        # Under inductor, advanced indexing on the 5-D block view lowers to a gather whose inner (D) loop is
        # contiguous and vectorized: 0.46 ms a SmolLM2 layer at batch 32 against 1.2 ms for the fused
        # index_select form below (its flat row index needs a division per element).
        gathered = cache.view(-1, block_size, *cache.shape[1:])[block_tables.long()]  # [B, nb, bs, Hkv, D]
        return gathered.view(b, nb * block_size, *cache.shape[1:]).transpose(1, 2)
    # Eager: one row per block and index_select, several times faster on CPU than advanced indexing.
    blocks = cache.view(-1, block_size * cache[0].numel())
    gathered = blocks.index_select(0, block_tables.reshape(-1).long())  # [B * nb, block_size * Hkv * D]
    return gathered.view(b, nb * block_size, *cache.shape[1:]).transpose(1, 2)


def _grouped_attention(
    q: torch.Tensor,  # [B, Q, H, D]
    k: torch.Tensor,  # [B, Hkv, S, D]
    v: torch.Tensor,  # [B, Hkv, S, D]
    visible: torch.Tensor,  # [B, Q, S] bool: query i may read key j
    scale: float,
) -> torch.Tensor:  # [B, Q, H, D]
    b, nq, h, d = q.shape
    hkv = k.shape[1]
    group = h // hkv
    # Rows ordered (query, group member) inside each KV head, so one mask row per query serves the whole group.
    qg = q.view(b, nq, hkv, group, d).permute(0, 2, 1, 3, 4).reshape(b, hkv, nq * group, d)
    mask = visible[:, None, :, None, :].expand(b, 1, nq, group, visible.shape[-1]).reshape(b, 1, nq * group, -1)
    out = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=scale)  # [B, Hkv, Q*G, D]
    return out.view(b, hkv, nq, group, d).permute(0, 2, 1, 3, 4).reshape(b, nq, h, d)


def paged_decode_attention(
    q: torch.Tensor,  # [B*Q, H, D]
    k_cache: torch.Tensor,  # [num_slots, Hkv, D]
    v_cache: torch.Tensor,  # [num_slots, Hkv, D]
    block_tables: torch.Tensor,  # [B, nb] int32
    seq_lens: torch.Tensor,  # [B] int32, context length including the Q query tokens
    query_len: int,
    block_size: int,
    scale: float,
    cpu_kernel: bool = False,
    kv_quant: KVQuant | None = None,  # the caches' scales when they hold fp8 codes (uint8)
) -> torch.Tensor:  # [B*Q, H, D]
    """Decode (Q >= 1 tokens per request, causal among them); shapes depend only on [B, nb] and Q.

    Query ``i`` of a request sits at position ``seq_len - Q + i``. A padded row (seq_len 0) still sees key 0 so
    its softmax stays finite; its output is garbage that the runner discards. ``cpu_kernel``: the C++ host
    kernel (kernels/cpu_kernels.py, loaded by the caller), eagerly and as one opaque op inside graphs, for the
    dtypes it has (fp32; bf16 q and caches with fp32 math); other dtypes take the torch forms. A bf16 cache in
    the torch forms runs SDPA in bf16 (fp32 softmax and accumulation inside torch's CPU kernel).
    """
    if cpu_kernel and _cpu_kernel_takes(q, k_cache, kv_quant):
        if k_cache.dtype == torch.uint8:
            return torch.ops.deepinfer.cpu_paged_decode_attention_fp8(
                q, k_cache, v_cache, block_tables, seq_lens, query_len, block_size, scale, kv_quant.k_scale,
                kv_quant.v_scale)
        return torch.ops.deepinfer.cpu_paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens,
                                                              query_len, block_size, scale)
    num_reqs = block_tables.shape[0]
    quant = kv_quant or KVQuant()
    if torch.compiler.is_compiling():
        return _fused_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, query_len, block_size, scale,
                                       quant)
    k = _values(_gather_blocks(k_cache, block_tables, block_size), quant.k_scale, q.dtype)
    v = _values(_gather_blocks(v_cache, block_tables, block_size), quant.v_scale, q.dtype)
    key_pos = torch.arange(k.shape[2], device=q.device)
    offsets = torch.arange(query_len, device=q.device) - query_len
    query_pos = (seq_lens.to(torch.int64)[:, None] + offsets[None, :]).clamp_min(0)  # [B, Q]
    visible = key_pos[None, None, :] <= query_pos[:, :, None]
    out = _grouped_attention(q.view(num_reqs, query_len, *q.shape[1:]), k, v, visible, scale)
    return out.reshape(num_reqs * query_len, *q.shape[1:])


def _fused_decode_attention(
    q: torch.Tensor,  # [B*Q, H, D]
    k_cache: torch.Tensor,  # [num_slots, Hkv, D]
    v_cache: torch.Tensor,  # [num_slots, Hkv, D]
    block_tables: torch.Tensor,  # [B, nb] int32
    seq_lens: torch.Tensor,  # [B] int32
    query_len: int,
    block_size: int,
    scale: float,
    quant: KVQuant = KVQuant(),
) -> torch.Tensor:  # [B*Q, H, D]
    """Decode attention as products and reductions that inductor fuses with the block-table gather: K and V
    are read from the pool once, never copied out (the gather + SDPA form copies them first and reads them
    twice). SmolLM2 layer at batch 32, 256-token contexts: 0.86 ms against 1.39 ms for gather + SDPA, and 0.46
    against 4.3 ms with scattered blocks in a cache-resident pool. Another summation order (differences ~1e-7)."""
    b, nb = block_tables.shape
    s = nb * block_size
    hkv, d = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // hkv
    rows = query_len * group  # one row per (query, group member) inside each KV head
    blocks = block_tables.long()
    k = _values(k_cache.view(-1, block_size, hkv, d)[blocks], quant.k_scale, q.dtype).view(b, s, hkv, 1, d)
    v = _values(v_cache.view(-1, block_size, hkv, d)[blocks], quant.v_scale, q.dtype).view(b, s, hkv, 1, d)
    qg = q.view(b, query_len, hkv, group, d).permute(0, 2, 1, 3, 4).reshape(b, 1, hkv, rows, d)
    scores = (qg * k).sum(-1) * scale  # [B, S, Hkv, Q*G]
    key_pos = torch.arange(s, device=q.device)
    offsets = torch.arange(query_len, device=q.device) - query_len
    query_pos = (seq_lens.to(torch.int64)[:, None] + offsets[None, :]).clamp_min(0)  # [B, Q]
    visible = key_pos[None, :, None] <= query_pos[:, None, :]  # [B, S, Q]
    visible = visible[:, :, None, :, None].expand(b, s, 1, query_len, group).reshape(b, s, 1, rows)
    probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=1)
    out = (probs[..., None] * v).sum(1)  # [B, Hkv, Q*G, D]
    return out.view(b, hkv, query_len, group, d).permute(0, 2, 1, 3, 4).reshape(b * query_len, hkv * group, d)


# Query x key pairs (chunk length x context) up to which a prefill chunk takes the C++ kernel, e.g. a 128-token
# prompt; not counted per head, so tensor-parallel ranks (fewer heads each) choose as one rank does.
CPU_PREFILL_PAIRS = 1 << 14


def paged_prefill_attention(
    q: torch.Tensor,  # [sum(query_lens), H, D]
    k_cache: torch.Tensor,  # [num_slots, Hkv, D]
    v_cache: torch.Tensor,  # [num_slots, Hkv, D]
    block_tables: torch.Tensor,  # [P, nb] int32
    query_lens: list[int],
    seq_lens: list[int],
    block_size: int,
    scale: float,
    cpu_kernel: bool = False,
    kv_quant: KVQuant | None = None,
) -> torch.Tensor:  # [sum(query_lens), H, D]
    """Prefill chunks (host ints): a chunk's queries are the last positions of its context.

    ``cpu_kernel``: a short chunk (queries x context within ``CPU_PREFILL_PAIRS``) runs on the C++ kernel (K/V
    read in place, causal among the chunk's queries, threads over requests): gathering the blocks, building the
    mask and SDPA's set-up cost more than the attention itself there. A longer chunk keeps SDPA, which threads over
    heads and does not score a query's future keys. The choice is per request, so a request's numerics never depend
    on the rest of its batch."""
    for i, (q_len, seq_len) in enumerate(zip(query_lens, seq_lens)):
        if not 1 <= q_len <= seq_len:
            raise ValueError(f"prefill request {i}: query_len must be in [1, seq_len={seq_len}], got {q_len}")
    if sum(query_lens) != q.shape[0]:
        raise ValueError(f"prefill query tokens: q has {q.shape[0]} rows but query_lens sum to {sum(query_lens)}")
    in_kernel = [cpu_kernel and _cpu_kernel_takes(q, k_cache, kv_quant)
                 and q_len * seq_len <= CPU_PREFILL_PAIRS for q_len, seq_len in zip(query_lens, seq_lens)]
    # The usual case: one call for every chunk of the step. Its score buffers are sized by the longest chunk times
    # the widest context, so a long chunk beside a 1-token chunk of a long context goes request by request.
    if in_kernel and all(in_kernel) and max(query_lens) * max(seq_lens) <= CPU_PREFILL_PAIRS:
        return _cpp_prefill(q, k_cache, v_cache, block_tables, query_lens, seq_lens, block_size, scale, kv_quant)
    outputs = []
    start = 0
    for i, (q_len, seq_len) in enumerate(zip(query_lens, seq_lens)):
        num_blocks = -(-seq_len // block_size)
        table = block_tables[i : i + 1, :num_blocks]
        if in_kernel[i]:
            outputs.append(_cpp_prefill(q[start : start + q_len], k_cache, v_cache, table, [q_len], [seq_len],
                                        block_size, scale, kv_quant))
            start += q_len
            continue
        quant = kv_quant or KVQuant()  # fp8: this request's blocks dequantized, never the whole cache
        k = _values(_gather_blocks(k_cache, table, block_size)[:, :, :seq_len], quant.k_scale, q.dtype)
        v = _values(_gather_blocks(v_cache, table, block_size)[:, :, :seq_len], quant.v_scale, q.dtype)
        query_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
        visible = torch.arange(seq_len, device=q.device)[None, :] <= query_pos[:, None]
        outputs.append(_grouped_attention(q[None, start : start + q_len], k, v, visible[None], scale)[0])
        start += q_len
    return torch.cat(outputs) if outputs else q.new_empty((0, *q.shape[1:]))


def _cpp_prefill(q: torch.Tensor,  # [sum(query_lens), H, D]
                 k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_tables: torch.Tensor,  # [P, nb] int32
                 query_lens: list[int], seq_lens: list[int], block_size: int, scale: float,
                 kv_quant: KVQuant | None = None) -> torch.Tensor:
    width = -(-max(seq_lens) // block_size)
    starts = torch.tensor([0, *query_lens], dtype=torch.int64, device=q.device).cumsum(0)
    args = (q, k_cache, v_cache, block_tables[:, :width].contiguous(),
            torch.tensor(seq_lens, dtype=torch.int32, device=q.device), starts, block_size, scale)
    if k_cache.dtype == torch.uint8:
        return torch.ops.deepinfer.cpu_paged_prefill_attention_fp8(*args, kv_quant.k_scale, kv_quant.v_scale)
    return torch.ops.deepinfer.cpu_paged_prefill_attention(*args)


def paged_attention(
    q: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [num_slots, Hkv, D], this step's K already written
    v_cache: torch.Tensor,  # [num_slots, Hkv, D]
    meta: AttentionMetadata,
    scale: float,
    cpu_kernel: bool = False,
    kv_quant: KVQuant | None = None,  # fp8 (uint8) caches: their scales
) -> torch.Tensor:  # [T, H, D]
    """Decode tokens first, then prefill chunks, as laid out by ``AttentionMetadata``."""
    num_decode_tokens = meta.num_decode_tokens
    parts = []
    if meta.num_decodes:
        parts.append(paged_decode_attention(
            q[:num_decode_tokens], k_cache, v_cache, meta.decode_block_tables, meta.decode_seq_lens,
            meta.decode_query_len, meta.block_size, scale, cpu_kernel, kv_quant))
    if meta.num_prefills:
        parts.append(paged_prefill_attention(
            q[num_decode_tokens:], k_cache, v_cache, meta.prefill_block_tables, meta.prefill_query_lens,
            meta.prefill_seq_lens, meta.block_size, scale, cpu_kernel, kv_quant))
    if not parts:
        raise ValueError("attention metadata has no decode and no prefill requests")
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def reference_attention(
    q: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [num_slots, Hkv, D]
    v_cache: torch.Tensor,  # [num_slots, Hkv, D]
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [T, H, D]
    """Dense loops: for each request, read its keys slot by slot, then each query attends to positions <= its own."""
    requests: list[tuple[list[int], int, int]] = []  # (block ids, query_len, seq_len)
    for i in range(meta.num_decodes):
        requests.append((meta.decode_block_tables[i].tolist(), meta.decode_query_len,
                         int(meta.decode_seq_lens[i])))
    for i in range(meta.num_prefills):
        requests.append((meta.prefill_block_tables[i].tolist(), meta.prefill_query_lens[i],
                         meta.prefill_seq_lens[i]))
    group = q.shape[1] // k_cache.shape[1]
    out = torch.empty_like(q)
    row = 0
    for blocks, q_len, seq_len in requests:
        slots = [blocks[p // meta.block_size] * meta.block_size + p % meta.block_size for p in range(seq_len)]
        keys = k_cache[slots].repeat_interleave(group, dim=1)  # [seq_len, H, D]
        values = v_cache[slots].repeat_interleave(group, dim=1)
        for i in range(q_len):
            position = seq_len - q_len + i
            scores = torch.einsum("hd,shd->hs", q[row], keys[: position + 1]).float() * scale
            probs = scores.softmax(dim=-1).to(q.dtype)
            out[row] = torch.einsum("hs,shd->hd", probs, values[: position + 1])
            row += 1
    return out
