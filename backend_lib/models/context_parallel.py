"""Context parallelism inside a model's attention: this rank's partial attention over the KV blocks it holds
(kernels/context_attention.py), one all-gather of every rank's partial output and log-sum-exp, and the merge of
this rank's rows. One collective per layer in decode; a split step (long prefill) adds one all-gather of the
rows' q / k / v before it (ContextGroup.gather_rows)."""
from __future__ import annotations

import torch

from backend_lib.models.parallel import ContextGroup
from kernels.attention_metadata import AttentionMetadata
from kernels.context_attention import HeldDecode, HeldReader, latent_reader, merge_partials, partial_paged_attention
from kernels.mla_fp8 import MLARecord


def context_attention(q: torch.Tensor,  # [T, H, D] every row's queries
                      read: HeldReader,  # this rank's cache (the step's K / V written)
                      meta: AttentionMetadata, scale: float,
                      group: ContextGroup,
                      held_decode: HeldDecode | None = None) -> torch.Tensor:  # [rows, H, D] float32: this rank's
    share = meta.context
    out, lse = partial_paged_attention(q, read, share, meta.num_decodes, meta.decode_query_len,
                                       meta.prefill_query_lens, meta.block_size, scale, held_decode)
    heads, dim = out.shape[1:]
    parts = group.all_gather(torch.cat([out.flatten(1), lse], dim=1))[:, share.rows]  # [R, rows, H * D + H]
    return merge_partials(parts[..., :heads * dim].unflatten(-1, (heads, dim)), parts[..., heads * dim:])


def mla_context_attention(q_nope: torch.Tensor,  # [T, H, Dn] every row's
                          q_rope: torch.Tensor,  # [T, H, P] post-rope
                          cache_blocks: torch.Tensor,  # [num_blocks + 1, block_size, R + P] this rank's latents
                          w_uk: torch.Tensor,  # [H, Dn, R]
                          w_uv: torch.Tensor,  # [H, Dv, R]
                          meta: AttentionMetadata, scale: float, group: ContextGroup,
                          record: MLARecord | None = None) -> torch.Tensor:  # [rows, H, Dv] this rank's rows
    """MLA in the absorbed form for every row (kernels/mla.py's decode algebra): scores against the held latents
    as one shared key head, partial outputs merged in the latent space, then W_UV."""
    rank = w_uk.shape[-1]
    q = torch.cat([torch.einsum("thd,hdr->thr", q_nope, w_uk), q_rope], dim=-1)  # [T, H, R + P]
    read = latent_reader(cache_blocks, record, rank, q.dtype)
    out_latent = context_attention(q, read, meta, scale, group)[..., :rank]  # [rows, H, R]
    return torch.einsum("thr,hvr->thv", out_latent.to(w_uv.dtype), w_uv)
