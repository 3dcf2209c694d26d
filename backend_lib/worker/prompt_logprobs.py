"""Prompt logprobs (SamplingParams.prompt_logprobs, vLLM's field; what OpenAI's ``echo`` with ``logprobs`` needs):
which rows of a step's hidden states predict prompt tokens, and their logprobs under the raw model distribution.

Row p of a prompt predicts token p + 1, so a chunk over prompt positions [start, end) gives the entries of tokens
start + 1 .. end (the last prompt position predicts the first output token: that is the sampler's). Positions the
engine already holds (a prefill recomputed after preemption) are skipped. The head runs on ``slice_rows`` rows at a
time: a long prompt's [rows, vocab] fp32 logits would otherwise be whole at once (SmolLM2: 200 KB a row).
Tensor-parallel worker ranks call ``head_slices`` on the same rows, so the head's collectives pair up.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch

from backend_lib.core.outputs import ScheduledChunk, TokenLogprob
from kernels import sampling as sampling_ops

SLICE_ROWS = 256


@dataclass
class PromptRows:
    """The step's rows that predict prompt tokens, chunk by chunk."""

    indices: list[int]  # rows of the step's hidden states
    targets: list[int]  # the prompt token each row predicts
    top_n: list[int]  # the alternatives each row's request wants
    counts: list[int]  # per chunk: how many of the rows are its (consecutive, in chunk order)


def prompt_rows(chunks: list[ScheduledChunk], row_starts: list[int]) -> PromptRows | None:
    """None when no chunk of the step predicts a prompt token of a prompt_logprobs request."""
    rows = PromptRows([], [], [], [])
    for chunk, row_start in zip(chunks, row_starts):
        request = chunk.request
        wanted = request.sampling_params.prompt_logprobs
        if wanted is None:  # every step asks this of every chunk: the common answer first
            rows.counts.append(0)
            continue
        prompt = request.prompt_token_ids
        first = max(chunk.start, request.num_prompt_logprobs)
        end = min(chunk.start + chunk.num_tokens - chunk.num_draft_tokens, len(prompt) - 1)
        count = max(0, end - first)
        for position in range(first, first + count):
            rows.indices.append(row_start + position - chunk.start)
            rows.targets.append(prompt[position + 1])
            rows.top_n.append(wanted)
        rows.counts.append(count)
    return rows if rows.indices else None


def slice_rows(model: torch.nn.Module) -> int:
    """SLICE_ROWS, or a compiled model's largest batch bucket when smaller: each slice then pads to a bucket and
    takes its lm_head graph (on Neuron, a slice of another size would compile a graph of its own)."""
    buckets = getattr(model, "buckets", None)
    return min(SLICE_ROWS, max(buckets.batch_sizes)) if buckets is not None else SLICE_ROWS


def head_slices(model: torch.nn.Module, hidden: torch.Tensor,  # [T, hidden]
                indices: torch.Tensor) -> Iterator[torch.Tensor]:  # [N] int64 -> [<= slice_rows, vocab] each
    size = slice_rows(model)
    for start in range(0, int(indices.shape[0]), size):
        yield model.compute_logits(hidden[indices[start:start + size]])


def compute(model: torch.nn.Module, hidden: torch.Tensor,  # [T, hidden]
            rows: PromptRows) -> list[list[TokenLogprob]]:
    """Per chunk, the entries of the prompt tokens its rows predict."""
    device = hidden.device
    indices = torch.tensor(rows.indices, dtype=torch.int64, device=device)
    targets = torch.tensor(rows.targets, dtype=torch.int64, device=device)
    most = max(rows.top_n)
    entries: list[TokenLogprob] = []
    for logits in head_slices(model, hidden, indices):
        start = len(entries)
        stop = start + logits.shape[0]
        lp, top_ids, top_lp = sampling_ops.compute_logprobs(logits, targets[start:stop], most)
        ids = top_ids.tolist() if top_ids is not None else None
        values = top_lp.tolist() if top_lp is not None else None
        for row, value in enumerate(lp.tolist()):
            wanted = rows.top_n[start + row]
            top = list(zip(ids[row][:wanted], values[row][:wanted])) if ids and wanted else []
            entries.append(TokenLogprob(rows.targets[start + row], value, top))
    per_chunk, at = [], 0
    for count in rows.counts:
        per_chunk.append(entries[at:at + count])
        at += count
    return per_chunk
