"""Context parallelism inside a model's attention: this rank's partial attention over the KV blocks it holds
(kernels/context_attention.py), one all-gather of every rank's partial output and log-sum-exp, and the merge of
this rank's rows. One collective per layer in decode; a split step (long prefill) adds one all-gather of the
rows' q / k / v before it (ContextGroup.gather_rows)."""
from __future__ import annotations

import torch

from backend_lib.models.parallel import ContextGroup
from kernels.attention_metadata import AttentionMetadata
from kernels.context_attention import merge_partials, partial_paged_attention
from kernels.kv_fp8 import KVQuant


def context_attention(q: torch.Tensor,  # [T, H, D] every row's queries
                      k_cache: torch.Tensor,  # [num_slots, Hkv, D] this rank's blocks, the step's K written
                      v_cache: torch.Tensor,  # [num_slots, Hkv, D]
                      meta: AttentionMetadata, scale: float, group: ContextGroup,
                      kv_quant: KVQuant | None = None) -> torch.Tensor:  # [rows, H, D] float32: this rank's rows
    share = meta.context
    out, lse = partial_paged_attention(q, k_cache, v_cache, share, meta.num_decodes, meta.decode_query_len,
                                       meta.prefill_query_lens, meta.block_size, scale, kv_quant)
    heads, dim = out.shape[1:]
    parts = group.all_gather(torch.cat([out.flatten(1), lse], dim=1))[:, share.rows]  # [R, rows, H * D + H]
    return merge_partials(parts[..., :heads * dim].unflatten(-1, (heads, dim)), parts[..., heads * dim:])
