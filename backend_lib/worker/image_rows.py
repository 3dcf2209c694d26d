"""A step's rows inside image spans (``core/request.py: PromptImage``) and their input embeddings: each chunk takes
the part of each span that falls in its tokens [start, start + num_tokens), so a chunked prefill may cut a span
anywhere and a recompute after preemption reads the same embeddings again."""
from __future__ import annotations

import torch

from backend_lib.core.outputs import ScheduledChunk
from backend_lib.models.interfaces import InputEmbeddingRows


def image_rows(chunks: list[ScheduledChunk], row_starts: list[int],
               device: torch.device) -> InputEmbeddingRows | None:
    rows: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    for i, chunk in enumerate(chunks):
        end = chunk.start + chunk.num_tokens - chunk.num_draft_tokens
        for image in chunk.request.images:
            lo, hi = max(chunk.start, image.start), min(end, image.start + image.num_tokens)
            if lo >= hi:
                continue
            rows.append(torch.arange(lo, hi) - chunk.start + row_starts[i])
            values.append(image.embeddings[lo - image.start:hi - image.start])
    if not rows:
        return None
    return InputEmbeddingRows(torch.cat(rows).to(device), torch.cat(values).to(device))
