"""Attention metadata for a batch of decodes and prefill chunks over random, non-contiguous block tables."""
from __future__ import annotations

import torch

from kernels.attention_metadata import AttentionMetadata


def block_tables(tables: list[list[int]], width: int, pad: int) -> torch.Tensor:  # [n, width] int32
    rows = [t + [pad] * (width - len(t)) for t in tables]
    return torch.tensor(rows, dtype=torch.int32).reshape(len(tables), width)


def mixed_batch(
    decode_seq_lens: list[int], decode_query_len: int, prefill: list[tuple[int, int]], block_size: int,
    num_blocks: int, seed: int = 0,
) -> tuple[AttentionMetadata, int]:
    """Random, non-contiguous block tables for decodes and prefill chunks (query_len, seq_len); the scratch block is
    the last one. Returns the metadata and the number of tokens."""
    gen = torch.Generator().manual_seed(seed)
    free = torch.randperm(num_blocks, generator=gen).tolist()
    scratch = num_blocks
    seqs = [(decode_query_len, s) for s in decode_seq_lens] + prefill
    tables, slots = [], []
    for q_len, seq_len in seqs:
        table = [free.pop() for _ in range(-(-seq_len // block_size))]
        tables.append(table)
        slots += [table[p // block_size] * block_size + p % block_size for p in range(seq_len - q_len, seq_len)]
    width = max(len(t) for t in tables) + 1  # one extra padding column, as the runner pads
    nd = len(decode_seq_lens)
    meta = AttentionMetadata(
        block_size=block_size,
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        num_decodes=nd,
        decode_query_len=decode_query_len,
        decode_block_tables=block_tables(tables[:nd], width, scratch),
        decode_seq_lens=torch.tensor(decode_seq_lens, dtype=torch.int32),
        num_prefills=len(prefill),
        prefill_query_lens=[q for q, _ in prefill],
        prefill_seq_lens=[s for _, s in prefill],
        prefill_block_tables=block_tables(tables[nd:], width, scratch),
    )
    return meta, len(slots)
