"""A step's paged views for DeepSeek-V4 / V4.1 attention: each token's block table, and the row groups that share
one gather of their context (decode rows per token, each prefill chunk once)."""
from __future__ import annotations

import torch

from kernels.attention_metadata import AttentionMetadata
from kernels.compressed_attention import ChunkPages, TokenPages


def token_pages(positions: torch.Tensor,  # [T] int64
                meta: AttentionMetadata) -> TokenPages:
    """Each token's block table: decode rows repeated per query, prefill rows per chunk token. Columns past a
    table's end read block 0: every entry there is masked (past the token's position)."""
    tables = []
    if meta.num_decodes:
        tables.append(meta.decode_block_tables.repeat_interleave(meta.decode_query_len, dim=0))
    if meta.num_prefills:
        lens = torch.tensor(meta.prefill_query_lens, device=positions.device)
        tables.append(meta.prefill_block_tables.repeat_interleave(lens, dim=0,
                                                                  output_size=sum(meta.prefill_query_lens)))
    width = max(t.shape[1] for t in tables)
    padded = [torch.nn.functional.pad(t.long(), (0, width - t.shape[1]), value=0) for t in tables]
    return TokenPages(positions, torch.cat(padded), meta.block_size)

def chunk_groups(pages: TokenPages, meta: AttentionMetadata) -> tuple:
    """Decode rows keep per-token keys; each prefill chunk shares one gather of its context's keys."""
    groups: list = []
    nd = meta.num_decode_tokens
    if nd:
        groups.append((0, nd, TokenPages(pages.positions[:nd], pages.block_tables[:nd], meta.block_size)))
    start = nd
    for i, length in enumerate(meta.prefill_query_lens):
        first = meta.prefill_seq_lens[i] - length
        table = meta.prefill_block_tables[i:i + 1].long()
        groups.append((start, start + length, ChunkPages(first, length, table, meta.block_size)))
        start += length
    return tuple(groups)
