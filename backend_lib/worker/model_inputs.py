"""One step's inputs as the model runner prepares them: one tensor per input (one host->device copy each), the
attention metadata, and the host-side bookkeeping the runner needs to map rows back to requests."""
from __future__ import annotations

from dataclasses import dataclass

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
