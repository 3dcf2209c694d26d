"""One step's inputs as the model runner prepares them: one tensor per input (one host->device copy each), the
attention metadata, and the host-side bookkeeping the runner needs to map rows back to requests."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from backend_lib.models.interfaces import InputEmbeddingRows
from backend_lib.worker.prompt_logprobs import PromptRows
from kernels.attention_metadata import AttentionMetadata


@dataclass
class ModelInputs:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # [S + drafts] int64: per sampling chunk, its draft rows then its last token
    order: list[int]  # chunk indices in token order (decode-like chunks first)
    sampling_chunks: list[int]  # chunk indices that sample, aligned with logits_indices
    row_starts: list[int]  # per chunk index: its first row in the flattened tokens
    prompt_rows: PromptRows | None = None  # rows that predict prompt tokens of prompt_logprobs requests
    embed_rows: InputEmbeddingRows | None = None  # rows inside image spans, with their input embeddings

    def forward_kwargs(self) -> dict:
        """The model's optional inputs this step has (a model without images is never passed embed_rows)."""
        return {} if self.embed_rows is None else {"embed_rows": self.embed_rows}


@dataclass
class StepOverlap:
    """What a step scheduled while the previous one ran (zero-overhead scheduling) takes from that step: its rows
    whose token is the previous step's sample, and its sampling metadata once the previous step's tokens are
    committed (the engine builds it on its thread; the runner waits on ``sampling`` after the forward)."""

    dst_rows: torch.Tensor  # [P] int64 rows of this step's input_ids holding a placeholder
    src_rows: torch.Tensor  # [P] int64 their rows in the previous step's sampled ids
    sampling: Callable[[], Any]  # -> the SamplingMetadata (or None: nothing samples), blocking until it is built
