"""How one step's flattened tokens map onto the paged KV cache (built on the host by the model runner).

Token order in a step: first the decode requests (``num_decodes`` of them, ``decode_query_len`` tokens
each: 1, or 1 + drafts under speculative decoding), then the prefill chunks (``num_prefills`` requests,
``prefill_query_lens[i]`` tokens each, possibly continuing a cached prefix).

Cache layout: each cache tensor is layer-major, ``[num_layers, num_slots, ...]`` with
``num_slots = (num_blocks + 1) * block_size``; the extra last block is a scratch block that padded rows
write into. A token's slot is ``block_id * block_size + offset``; block tables hold block ids.

Models with fixed per-request state (the hybrid cache, ``backend_lib/core/hybrid_kv.py``) also get ``state``: each
token's state slot and the span of its chunk, so the model can tell which of its recent positions earlier steps
left in the slot and which this step computes.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class StateRows:
    """Per step token, for models with fixed per-request state slots."""

    slots: torch.Tensor  # [T] int64: the request's state slot; -1 for padded rows (they write the scratch slot)
    chunk_starts: torch.Tensor  # [T] int64: position of the first token of the token's chunk
    chunk_ends: torch.Tensor  # [T] int64: one past the last real (non-padded) position of the chunk


@dataclass
class ContextShare:
    """Context parallelism (backend_lib/worker/context_share.py): what this context rank holds of the step's
    requests, and which of the step's rows it computes. Block tables list only the blocks this rank holds (its
    local ids, the scratch block padding), each with the position of its first token (padding: past every query);
    the metadata's own block tables keep their width, with this rank's ids and ``scratch_block`` for the others."""

    rank: int
    size: int
    query_positions: torch.Tensor  # [T] int64: every row's position (the causal mask is by position)
    decode_tables: torch.Tensor  # [num_decodes, w] int64 held blocks
    decode_starts: torch.Tensor  # [num_decodes, w] int64
    prefill_tables: torch.Tensor  # [num_prefills, w'] int64
    prefill_starts: torch.Tensor  # [num_prefills, w'] int64
    scratch_block: int  # this rank's scratch block: where the step's block tables point for blocks it does not hold
    row_counts: list[int] | None = None  # rows per context rank when the step's rows are split, else None
    # what every layer of the step would rebuild (kernels/context_attention.py's masks), built by the first
    memo: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def rows(self) -> slice:
        """This rank's rows of the step (all of them when unsplit)."""
        if self.row_counts is None:
            return slice(0, self.query_positions.shape[0])
        start = sum(self.row_counts[:self.rank])
        return slice(start, start + self.row_counts[self.rank])


@dataclass
class AttentionMetadata:
    block_size: int
    slot_mapping: torch.Tensor  # [T] int64: cache slot of every token's K/V (written before attention)
    num_decodes: int
    decode_query_len: int
    decode_block_tables: torch.Tensor  # [num_decodes, max_blocks] int32, padded with the scratch block
    decode_seq_lens: torch.Tensor  # [num_decodes] int32: context length including this step's tokens
    num_prefills: int
    prefill_query_lens: list[int]  # host ints, one per prefill request
    prefill_seq_lens: list[int]  # host ints: context length including this chunk
    prefill_block_tables: torch.Tensor  # [num_prefills, max_blocks] int32
    state: StateRows | None = None  # hybrid-cache models only
    token_history: torch.Tensor | None = None  # [T, H] int64 ids before each token (-1 before the start): Engram
    engram_rows: torch.Tensor | None = None  # [L_e, T, width]: Engram's gathered table rows, computed on the host
    context: ContextShare | None = None  # context parallelism: this rank's blocks and rows (slot_mapping is local)

    @property
    def num_decode_tokens(self) -> int:
        return self.num_decodes * self.decode_query_len
