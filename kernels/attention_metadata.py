"""How one step's flattened tokens map onto the paged KV cache (built on the host by the model runner).

Token order in a step: first the decode requests (``num_decodes`` of them, ``decode_query_len`` tokens
each: 1, or 1 + drafts under speculative decoding), then the prefill chunks (``num_prefills`` requests,
``prefill_query_lens[i]`` tokens each, possibly continuing a cached prefix).

Cache layout: each cache tensor is layer-major, ``[num_layers, num_slots, ...]`` with
``num_slots = (num_blocks + 1) * block_size``; the extra last block is a scratch block that padded rows
write into. A token's slot is ``block_id * block_size + offset``; block tables hold block ids.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


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

    @property
    def num_decode_tokens(self) -> int:
        return self.num_decodes * self.decode_query_len
