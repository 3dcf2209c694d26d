"""The ids before each token of a step, for models whose layers read them (Engram's n-gram hash).

The host holds every request's ids, so a token's n-gram context is read from the request itself: exact through
chunked prefill cut anywhere, preemption (recompute), session turns and rejected drafts, with no state to roll back.
"""
from __future__ import annotations

import numpy as np
import torch
from numpy.lib.stride_tricks import sliding_window_view

from backend_lib.core.outputs import ScheduledChunk


def _ids_before(chunk: ScheduledChunk, width: int) -> list[int]:
    """The last ``width`` ids before the chunk's first token (fewer at the start of the sequence)."""
    request = chunk.request
    begin, end, num_prompt = max(0, chunk.start - width), chunk.start, request.num_prompt_tokens
    if begin >= num_prompt:
        return request.output_token_ids[begin - num_prompt:end - num_prompt]
    if end <= num_prompt:
        return request.prompt_token_ids[begin:end]
    return request.prompt_token_ids[begin:] + request.output_token_ids[:end - num_prompt]


def chunk_history(chunk: ScheduledChunk, tokens: list[int], width: int) -> np.ndarray:  # [len(tokens), width]
    """Row i: the ``width`` ids before ``tokens[i]`` (the chunk's tokens, drafts included), oldest first; -1 where
    the sequence has not started."""
    before = _ids_before(chunk, width)
    sequence = np.asarray([-1] * (width - len(before)) + before + tokens, dtype=np.int64)
    return sliding_window_view(sequence, width)[:len(tokens)]


def padding_history(rows: int, width: int) -> np.ndarray:  # [rows, width]: padded rows read nothing real
    return np.full((rows, width), -1, dtype=np.int64)


def step_history(rows: list[np.ndarray], device: torch.device | str) -> torch.Tensor:  # [T, width] int64
    return torch.from_numpy(np.concatenate(rows)).to(device)
