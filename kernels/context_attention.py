"""Context parallelism's attention: each context rank attends every query of the step against the KV blocks it
holds, returning the partial output and its log-sum-exp; ``merge_partials`` joins the ranks' partials exactly as
one softmax over all the keys would (the flash-decoding / ring-attention merge).

A rank holds some of a request's blocks (which ones: backend_lib/worker/context_share.py), so the key positions are
not contiguous: each held block comes with the position of its first token (``ContextShare.*_starts``), and the mask
is causal by position, never by index. A query none of whose keys this rank holds gets a zero output and a
log-sum-exp of -inf: it adds nothing to the merge.
"""
from __future__ import annotations

import torch

from typing import Callable

from kernels.attention import _gather_blocks, _values
from kernels.attention_metadata import ContextShare
from kernels.kv_fp8 import KVQuant
from kernels.mla import context_values, gather_context
from kernels.mla_fp8 import MLARecord

# Query rows (queries x heads per KV head) per attention call in a long prefill chunk: bounds the [rows, keys] mask
# (a 2,048-token chunk of SmolLM2 against 8,192 held keys would be 200 MB at once).
QUERY_ROWS = 2048

# Held blocks [B, w] -> (keys [B, Hkv, S, D], values [B, Hkv, S, D]) in the queries' dtype, S = w * block_size.
HeldReader = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
# Decode rows' attention read in place (one query a request): (q [B, H, D], held blocks [B, w], visible held keys
# [B], scale) -> (out [B, H, D] float32, lse [B, H] float32).
HeldDecode = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], tuple[torch.Tensor, torch.Tensor]]


def _step_mask(share: ContextShare, key: tuple, visible: Callable[[], torch.Tensor],  # -> [B, Q, S] bool
               group: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:  # [B, 1, Q*G, S], [B, Q, 1]
    """The flash kernel's additive mask in its (query, group member) row order, and the rows without a held key:
    the same for every layer of the step, so built once (``share.memo``)."""
    def make() -> tuple[torch.Tensor, torch.Tensor]:
        seen = visible()
        b, nq, s = seen.shape
        additive = torch.zeros(seen.shape, dtype=dtype, device=seen.device).masked_fill_(~seen, float("-inf"))
        mask = additive[:, :, None, :].expand(b, nq, group, s).reshape(b, 1, nq * group, s)
        return mask, ~seen.any(-1)[..., None]
    full_key = (*key, group, dtype)
    if full_key not in share.memo:
        share.memo[full_key] = make()
    return share.memo[full_key]


def _held_attention(
    q: torch.Tensor,  # [B, Q, H, D]
    k: torch.Tensor,  # [B, Hkv, S, D] held keys
    v: torch.Tensor,  # [B, Hkv, S, D]
    mask: tuple[torch.Tensor, torch.Tensor],  # _step_mask's: additive [B, 1, Q * G, S], unseen rows [B, Q, 1]
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # out [B, Q, H, D] float32, lse [B, Q, H] float32
    b, nq, h, d = q.shape
    hkv = k.shape[1]
    group = h // hkv
    additive, unseen = mask
    # Rows (query, group member) inside each KV head, so one mask row per query serves the group (as
    # kernels/attention.py's _grouped_attention); torch's CPU flash kernel returns the log-sum-exp beside the output.
    qg = q.view(b, nq, hkv, group, d).permute(0, 2, 1, 3, 4).reshape(b, hkv, nq * group, d)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(qg, k, v, 0.0, False, attn_mask=additive,
                                                                         scale=scale)
    out = out.view(b, hkv, nq, group, d).permute(0, 2, 1, 3, 4).reshape(b, nq, h, d)
    lse = lse.view(b, hkv, nq, group).permute(0, 2, 1, 3).reshape(b, nq, h)
    # The kernel gives a row without any visible key out 0 and lse 0; the merge needs -inf there.
    return out.float(), lse.float().masked_fill(unseen, float("-inf"))


def paged_kv_reader(k_cache: torch.Tensor,  # [num_slots, Hkv, D]
                    v_cache: torch.Tensor,  # [num_slots, Hkv, D]
                    block_size: int, dtype: torch.dtype, kv_quant: KVQuant | None = None) -> HeldReader:
    """The GQA cache's held blocks (fp8 codes dequantized as gathered)."""
    quant = kv_quant or KVQuant()

    def read(tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # tables [B, w]
        return (_values(_gather_blocks(k_cache, tables, block_size), quant.k_scale, dtype),
                _values(_gather_blocks(v_cache, tables, block_size), quant.v_scale, dtype))
    return read


def cpp_held_decode(k_cache: torch.Tensor,  # [num_slots, Hkv, D] (fp8: e4m3 codes)
                    v_cache: torch.Tensor,  # [num_slots, Hkv, D]
                    block_size: int, kv_quant: KVQuant | None = None) -> HeldDecode:
    """The C++ decode kernel over the held blocks in place, with its log-sum-exp (kernels/csrc): no gathered copy
    of the keys and values, which the flash path needs."""
    quant = kv_quant or KVQuant()
    fp8 = k_cache.dtype == torch.uint8

    def decode(q: torch.Tensor, tables: torch.Tensor, seen: torch.Tensor,
               scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        # A request none of whose keys this rank holds reads one slot of its (padding) scratch block, then drops it.
        out, lse = torch.ops.deepinfer.cpu_paged_decode_attention_lse(
            q, k_cache, v_cache, tables.to(torch.int32), seen.clamp_min(1).to(torch.int32), block_size, scale,
            quant.k_scale, quant.v_scale, fp8)
        unseen = (seen == 0)[:, None]  # [B, 1]
        return out.float().masked_fill(unseen[..., None], 0.0), lse.masked_fill(unseen, float("-inf"))
    return decode


def latent_reader(cache_blocks: torch.Tensor,  # [num_blocks + 1, block_size, R + P] one MLA layer (fp8: records)
                  record: MLARecord | None, rank: int, dtype: torch.dtype) -> HeldReader:
    """MLA's held latents as one shared key head (latent + RoPE key) and its value (the latent; the RoPE columns
    zeroed, as the attention kernel wants equal key and value widths): the absorbed form's attention."""
    def read(tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # tables [B, w]
        ctx = context_values(gather_context(cache_blocks, tables), record, dtype)  # [B, S, R + P]
        values = torch.cat([ctx[..., :rank], ctx.new_zeros((*ctx.shape[:-1], ctx.shape[-1] - rank))], dim=-1)
        return ctx[:, None], values[:, None]
    return read


def _key_positions(starts: torch.Tensor,  # [B, w] first position of each held block; padding: past every query
                   block_size: int) -> torch.Tensor:  # [B, w * block_size]
    offsets = torch.arange(block_size, device=starts.device)
    return (starts[:, :, None] + offsets).flatten(1)


def partial_paged_attention(
    q: torch.Tensor,  # [T, H, D] every query of the step (decode rows first, then prefill chunks)
    read: HeldReader,  # this rank's cache, the step's K / V already written
    share: ContextShare,
    num_decodes: int,
    decode_query_len: int,
    prefill_query_lens: list[int],
    block_size: int,
    scale: float,
    held_decode: HeldDecode | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # out [T, H, D] float32, lse [T, H] float32
    """Attention of the step's queries over the keys this rank holds, with each row's log-sum-exp."""
    positions = share.query_positions
    outs, lses = [], []
    if num_decodes and held_decode is not None and decode_query_len == 1:
        # A decode query sees every held key written so far, and those are a prefix of its held blocks in order
        # (only a request's last block is partly filled): their count is all the in-place kernel needs.
        if "decode_seen" not in share.memo:  # the same for every layer of the step
            share.memo["decode_seen"] = (positions[:num_decodes, None] + 1 - share.decode_starts).clamp(
                0, block_size).sum(1)
        seen = share.memo["decode_seen"]
        out, lse = held_decode(q[:num_decodes], share.decode_tables, seen, scale)
        outs.append(out)
        lses.append(lse)
    elif num_decodes:
        rows = num_decodes * decode_query_len
        k, v = read(share.decode_tables)
        group = q.shape[1] // k.shape[1]
        mask = _step_mask(share, ("decode",), lambda: _key_positions(share.decode_starts, block_size)[:, None, :]
                          <= positions[:rows].view(num_decodes, decode_query_len)[:, :, None], group, q.dtype)
        out, lse = _held_attention(q[:rows].view(num_decodes, decode_query_len, *q.shape[1:]), k, v, mask, scale)
        outs.append(out.flatten(0, 1))
        lses.append(lse.flatten(0, 1))
    start = num_decodes * decode_query_len
    for i, q_len in enumerate(prefill_query_lens):
        k, v = read(share.prefill_tables[i:i + 1])
        group = q.shape[1] // k.shape[1]
        key_pos = _key_positions(share.prefill_starts[i:i + 1], block_size)  # [1, S]
        step = max(1, QUERY_ROWS // group)
        for at in range(start, start + q_len, step):
            end = min(at + step, start + q_len)
            mask = _step_mask(share, ("prefill", at), lambda: key_pos[:, None, :] <= positions[at:end][None, :, None],
                              group, q.dtype)
            out, lse = _held_attention(q[None, at:end], k, v, mask, scale)
            outs.append(out[0])
            lses.append(lse[0])
        start += q_len
    return torch.cat(outs), torch.cat(lses)


def merge_partials(out: torch.Tensor,  # [R, N, H, D] float32: every context rank's partial output
                   lse: torch.Tensor,  # [R, N, H] float32: and its log-sum-exp (-inf: no key there)
                   ) -> torch.Tensor:  # [N, H, D] float32
    """One softmax over the union of the ranks' keys: each partial weighted by exp(lse - max lse)."""
    top = lse.max(0).values
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))  # a row no rank sees (padding) stays 0
    weight = torch.exp(lse - top)  # [R, N, H]
    total = weight.sum(0).clamp_min(torch.finfo(torch.float32).tiny)
    return (weight[..., None] * out).sum(0) / total[..., None]


def partial_sink_attention(q: torch.Tensor,  # [T, H, D] post-rope queries
                           keys: torch.Tensor,  # [T or 1, K, D] one K = V head
                           allowed: torch.Tensor,  # [T, K] bool: the keys this rank holds and the query sees
                           sinks: torch.Tensor | None,  # [H] per-head sink logits (one rank counts them), or None
                           scale: float) -> tuple[torch.Tensor, torch.Tensor]:  # out [T, H, D], lse [T, H] float32
    """kernels/compressed_attention.py's ``sink_attention`` over part of the keys, with its log-sum-exp (the sink a
    key whose value is zero): ``merge_partials`` of every rank's parts gives the whole softmax."""
    scores = (torch.matmul(q.float(), keys.float().transpose(1, 2)) * scale).masked_fill(~allowed[:, None, :],
                                                                                        float("-inf"))
    if sinks is not None:
        scores = torch.cat([scores, sinks.float()[None, :, None].expand(q.shape[0], -1, 1)], dim=-1)
    lse = torch.logsumexp(scores, dim=-1)  # -inf: no key (and no sink) here
    probs = torch.exp(scores - torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))[..., None])
    out = torch.matmul(probs[..., :keys.shape[1]], keys.float())
    return out, lse
