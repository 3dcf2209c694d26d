"""Multi-head latent attention (DeepSeek-V2/V3) over a paged latent cache.

Per token and layer the cache holds ``C = kv_lora_rank + qk_rope_head_dim`` values: the normalized latent
``c`` (after kv_a_layernorm) and the post-rope shared key ``k_rope``; never expanded K/V. With
``kv_b_proj.weight`` viewed as ``[H, Dn + Dv, R]`` = ``[W_UK | W_UV]`` per head:

  k_nope[s, h] = W_UK[h] @ c[s]          v[s, h] = W_UV[h] @ c[s]
  score[h, s]  = q_nope[h] . k_nope[s, h] + q_rope[h] . k_rope[s]
               = (W_UK[h]^T q_nope[h]) . c[s] + q_rope[h] . k_rope[s]      (absorbed)
  out[h]       = sum_s p[h, s] v[s, h] = W_UV[h] @ (sum_s p[h, s] c[s])      (absorbed)

Cache size: for DeepSeek-V3 (128 heads, qk_nope 128, qk_rope 64, v 128, kv_lora_rank 512) a token costs
512 + 64 = 576 values per layer here, against 128 * (192 + 128) = 40960 for an expanded K/V cache: 71x less
(70,272 bytes against 5.0 MB per token over 61 layers in bf16).

Decode uses the absorbed form (fixed shapes, scratch-padded block tables, no host syncs); prefill expands
K/V from the cached latents (cheaper when many queries share the context); ``mla_decode_expanded`` is the
plain reference for the absorbed kernel.

fp8 (``kv_cache_dtype=fp8_e4m3``): the cache holds ``MLARecord`` bytes (kernels/mla_fp8.py: e4m3 latent with a
power-of-two scale per 128 values, bf16 RoPE); every reader takes ``record`` and decodes only the rows it gathered.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.mla_fp8 import MLARecord, decode_records, encode_records


def write_latent_cache(cache: torch.Tensor,  # [num_slots, R + P] one layer (fp8: [num_slots, record bytes] uint8)
                       slot_mapping: torch.Tensor,  # [T] int64
                       latent: torch.Tensor,  # [T, R] normalized
                       k_rope: torch.Tensor,  # [T, P] post-rope
                       record: MLARecord | None = None) -> None:
    if record is not None:
        cache.index_copy_(0, slot_mapping, encode_records(latent, k_rope, record))
    else:
        cache.index_copy_(0, slot_mapping, torch.cat([latent, k_rope], dim=-1).to(cache.dtype))


def context_values(rows: torch.Tensor,  # [..., C] gathered cache rows (fp8: record bytes)
                   record: MLARecord | None, dtype: torch.dtype) -> torch.Tensor:  # [..., R + P]
    return decode_records(rows, record, dtype) if record is not None else rows.to(dtype)


def gather_context(cache_blocks: torch.Tensor,  # [num_blocks + 1, block_size, C]
                   block_tables: torch.Tensor) -> torch.Tensor:  # [B, max_blocks] int32
    """[B, max_blocks * block_size, C]: each request's cache rows in position order (padding included)."""
    b, max_blocks = block_tables.shape
    rows = cache_blocks.index_select(0, block_tables.reshape(-1).long())
    return rows.view(b, max_blocks * cache_blocks.shape[1], cache_blocks.shape[2])


def split_kv_b(kv_b_weight: torch.Tensor,  # [H * (Dn + Dv), R]
               num_heads: int, qk_nope_head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(W_UK [H, Dn, R], W_UV [H, Dv, R]) from kv_b_proj's weight."""
    w = kv_b_weight.view(num_heads, -1, kv_b_weight.shape[-1])
    return w[:, :qk_nope_head_dim], w[:, qk_nope_head_dim:]


def _decode_mask(seq_lens: torch.Tensor,  # [B] int32
                 query_len: int, num_keys: int) -> torch.Tensor:
    """[B, Q, S] bool: query i of a request sits at position seq_len - Q + i and sees keys up to it."""
    q_pos = seq_lens.long()[:, None] - query_len + torch.arange(query_len, device=seq_lens.device)[None, :]
    k_pos = torch.arange(num_keys, device=seq_lens.device)
    return k_pos[None, None, :] <= q_pos[:, :, None]


def _scores(nope_equation: str, q_nope: torch.Tensor, k_nope: torch.Tensor,
            rope_equation: str, q_rope: torch.Tensor, k_rope: torch.Tensor, scale: float) -> torch.Tensor:
    """Scaled scores in fp32 whatever the inputs: bf16 scores (one ulp is 0.06 at 10) would shift the softmax by
    percents, where transformers' SDPA keeps them in fp32. fp32 inputs run exactly the ops they ran before."""
    fp32 = torch.float32
    return (torch.einsum(nope_equation, q_nope.to(fp32), k_nope.to(fp32))
            + torch.einsum(rope_equation, q_rope.to(fp32), k_rope.to(fp32))) * scale


def mla_decode_absorbed(q_nope: torch.Tensor,  # [B, Q, H, Dn]
                        q_rope: torch.Tensor,  # [B, Q, H, P] post-rope
                        cache_blocks: torch.Tensor,  # [num_blocks + 1, block_size, R + P]
                        block_tables: torch.Tensor,  # [B, max_blocks] int32
                        seq_lens: torch.Tensor,  # [B] int32, including this step's Q tokens
                        w_uk: torch.Tensor,  # [H, Dn, R]
                        w_uv: torch.Tensor,  # [H, Dv, R]
                        scale: float,
                        record: MLARecord | None = None) -> torch.Tensor:
    """Absorbed MLA decode -> [B, Q, H, Dv]. Scores and the weighted sum run in the latent space."""
    rank = w_uk.shape[-1]
    ctx = context_values(gather_context(cache_blocks, block_tables), record, q_nope.dtype)  # [B, S, R + P]
    latent, k_rope = ctx[..., :rank], ctx[..., rank:]
    q_latent = torch.einsum("bqhd,hdr->bqhr", q_nope, w_uk)
    scores = _scores("bqhr,bsr->bqhs", q_latent, latent, "bqhp,bsp->bqhs", q_rope, k_rope, scale)
    mask = _decode_mask(seq_lens, q_nope.shape[1], ctx.shape[1])[:, :, None, :]
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1, dtype=torch.float32).to(q_nope.dtype)
    out_latent = torch.einsum("bqhs,bsr->bqhr", probs, latent)
    return torch.einsum("bqhr,hvr->bqhv", out_latent, w_uv)


def _expand(latent: torch.Tensor,  # [..., S, R]
            kv_b_weight: torch.Tensor,  # [H * (Dn + Dv), R]
            num_heads: int, qk_nope_head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    kv = F.linear(latent, kv_b_weight).unflatten(-1, (num_heads, -1))  # [..., S, H, Dn + Dv]
    return kv[..., :qk_nope_head_dim], kv[..., qk_nope_head_dim:]


def mla_decode_expanded(q_nope: torch.Tensor,  # [B, Q, H, Dn]
                        q_rope: torch.Tensor,  # [B, Q, H, P]
                        cache_blocks: torch.Tensor,  # [num_blocks + 1, block_size, R + P]
                        block_tables: torch.Tensor,  # [B, max_blocks] int32
                        seq_lens: torch.Tensor,  # [B] int32
                        kv_b_weight: torch.Tensor,  # [H * (Dn + Dv), R]
                        scale: float,
                        record: MLARecord | None = None) -> torch.Tensor:
    """Reference decode that expands K/V per head from the latent cache -> [B, Q, H, Dv]."""
    num_heads, dn = q_nope.shape[2], q_nope.shape[3]
    rank = kv_b_weight.shape[-1]
    ctx = context_values(gather_context(cache_blocks, block_tables), record, q_nope.dtype)
    k_nope, v = _expand(ctx[..., :rank], kv_b_weight, num_heads, dn)  # [B, S, H, *]
    k_rope = ctx[..., rank:]
    scores = _scores("bqhd,bshd->bqhs", q_nope, k_nope, "bqhp,bsp->bqhs", q_rope, k_rope, scale)
    mask = _decode_mask(seq_lens, q_nope.shape[1], ctx.shape[1])[:, :, None, :]
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1, dtype=torch.float32).to(q_nope.dtype)
    return torch.einsum("bqhs,bshv->bqhv", probs, v)


def mla_prefill(q_nope: torch.Tensor,  # [L, H, Dn] one request's chunk
                q_rope: torch.Tensor,  # [L, H, P]
                cache_blocks: torch.Tensor,  # [num_blocks + 1, block_size, R + P]
                block_table: torch.Tensor,  # [max_blocks] int32
                seq_len: int,  # host int: context length including this chunk
                kv_b_weight: torch.Tensor,  # [H * (Dn + Dv), R]
                scale: float,
                record: MLARecord | None = None) -> torch.Tensor:
    """Expanded MLA for one prefill chunk (which may continue a cached prefix) -> [L, H, Dv]."""
    num_q, num_heads, dn = q_nope.shape
    block_size = cache_blocks.shape[1]
    rank = kv_b_weight.shape[-1]
    num_blocks = -(-seq_len // block_size)
    ctx = cache_blocks.index_select(0, block_table[:num_blocks].long()).flatten(0, 1)[:seq_len]
    ctx = context_values(ctx, record, q_nope.dtype)  # fp8: this request's records decoded, never the whole cache
    k_nope, v = _expand(ctx[:, :rank], kv_b_weight, num_heads, dn)  # [S, H, *]
    k_rope = ctx[:, rank:]
    scores = _scores("lhd,shd->hls", q_nope, k_nope, "lhp,sp->hls", q_rope, k_rope, scale)
    q_pos = torch.arange(seq_len - num_q, seq_len, device=q_nope.device)
    mask = torch.arange(seq_len, device=q_nope.device)[None, :] <= q_pos[:, None]  # [L, S]
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1, dtype=torch.float32).to(q_nope.dtype)
    return torch.einsum("hls,shv->lhv", probs, v)
