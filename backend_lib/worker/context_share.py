"""Context parallelism: which KV blocks and which rows of a step are this context rank's.

The scheduler sees one pool of ``size x N`` blocks; global block ``g`` lives on context rank ``g % size`` as its
local block ``g // size`` (every rank's cache has ``N`` blocks and a scratch block ``N``; the global scratch block
``size x N`` maps onto each rank's scratch). The KV manager places a request's next block right after its last
one, so a long prompt's blocks alternate between the ranks: round-robin by block, which balances causal attention
(each rank holds keys from the whole sequence) without a zig-zag split; contiguous chunks would leave the rank
with the first chunk idle for most queries. Which rank holds a block never matters for correctness: the id says.

Every rank receives the driver's global step (the step channel) and derives its share here: its slot for each
token it holds (the others write the scratch slot), its held blocks per request with their first positions, and,
for a step of at least ``min_tokens`` rows, its balanced share of the rows (kernels/context_attention.py).
"""
from __future__ import annotations

import torch

from backend_lib.models.parallel import ContextGroup, balanced_range
from kernels.attention_metadata import AttentionMetadata, ContextShare


def _held(tables: torch.Tensor,  # [R, w] global block ids (global scratch padding)
          rank: int, size: int, local_blocks: int,
          block_size: int) -> tuple[torch.Tensor, torch.Tensor]:  # held [R, w'] local ids, first positions [R, w']
    """Each row's blocks held by ``rank``, in order, as local ids with their first positions; padded with the local
    scratch block at a position past every query."""
    tables = tables.to(torch.int64)
    held = (tables % size == rank) & (tables < size * local_blocks)
    width = max(int(held.sum(1).max()) if tables.numel() else 0, 1)
    order = torch.sort((~held).to(torch.int8), dim=1, stable=True).indices[:, :width]  # held entries first
    kept = held.gather(1, order)
    local = torch.where(kept, tables.gather(1, order) // size, torch.full_like(order, local_blocks))
    past_every_query = torch.iinfo(torch.int64).max // 2
    starts = torch.where(kept, order * block_size, torch.full_like(order, past_every_query))
    if tables.shape[1] < width:  # no blocks at all (an empty table): one padding column
        local = torch.full((tables.shape[0], width), local_blocks, dtype=torch.int64)
        starts = torch.full((tables.shape[0], width), past_every_query, dtype=torch.int64)
    return local, starts


def local_tables(tables: torch.Tensor,  # [R, w] global block ids
                 rank: int, size: int, local_blocks: int) -> torch.Tensor:  # [R, w] int64
    """The same tables in this rank's ids, its scratch block where another rank holds the block (models that read
    the tables themselves, DeepSeek-V4's entries, mask those)."""
    tables = tables.to(torch.int64)
    return torch.where(tables % size == rank, tables // size, torch.full_like(tables, local_blocks))


def local_slots(slot_mapping: torch.Tensor,  # [T] int64 global slots
                rank: int, size: int, local_blocks: int, block_size: int) -> torch.Tensor:  # [T] int64
    """This rank's slot for each token it holds; the scratch slot for the others."""
    block, offset = slot_mapping // block_size, slot_mapping % block_size
    mine = block % size == rank
    return torch.where(mine, (block // size) * block_size + offset,
                       torch.full_like(slot_mapping, local_blocks * block_size))


def share_step(meta: AttentionMetadata,
               positions: torch.Tensor,  # [T] int64
               group: ContextGroup, local_blocks: int, min_tokens: int) -> AttentionMetadata:
    """The global step's metadata as this context rank runs it (slot mapping local, ``context`` filled)."""
    rank, size, bs = group.rank, group.size, meta.block_size
    num_rows = positions.shape[0]
    decode_tables, decode_starts = _held(meta.decode_block_tables, rank, size, local_blocks, bs)
    prefill_tables, prefill_starts = _held(meta.prefill_block_tables, rank, size, local_blocks, bs)
    split = num_rows >= max(min_tokens, size)
    row_counts = [balanced_range(num_rows, size, r, "the step's rows")[1] for r in range(size)] if split else None
    share = ContextShare(rank=rank, size=size, query_positions=positions, decode_tables=decode_tables,
                         decode_starts=decode_starts, prefill_tables=prefill_tables, prefill_starts=prefill_starts,
                         scratch_block=local_blocks, row_counts=row_counts)
    meta.slot_mapping = local_slots(meta.slot_mapping, rank, size, local_blocks, bs)
    meta.decode_block_tables = local_tables(meta.decode_block_tables, rank, size, local_blocks)
    meta.prefill_block_tables = local_tables(meta.prefill_block_tables, rank, size, local_blocks)
    meta.context = share
    return meta
