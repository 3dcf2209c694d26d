"""The image span a picture becomes in the prompt (vLLM ``deepseek_v41/common/mm_preprocess.py``): START, then
``n_llm_h`` rows of ``n_llm_w`` IMAGE positions each followed by NEWLINE, then END. Every position carries
``image_token_id``; the roles travel beside the ids (they choose the embedding: an aligner row or a learned vector)."""
from __future__ import annotations

import torch

from backend_lib.models.deepseek_v41.vision.placeholder import IMAGE_PLACEHOLDER

__all__ = ["IMAGE_PLACEHOLDER", "IMAGE_START", "IMAGE", "IMAGE_NEW_LINE", "IMAGE_END", "span_length", "span_roles",
           "llm_grid"]
IMAGE_START, IMAGE, IMAGE_NEW_LINE, IMAGE_END = range(4)


def span_length(n_llm_h: int, n_llm_w: int) -> int:
    return n_llm_h * (n_llm_w + 1) + 2


def span_roles(n_llm_h: int, n_llm_w: int) -> torch.Tensor:  # [span_length] int8
    roles = torch.full((n_llm_h, n_llm_w + 1), IMAGE, dtype=torch.int8)
    roles[:, -1] = IMAGE_NEW_LINE
    start, end = torch.tensor([IMAGE_START], dtype=torch.int8), torch.tensor([IMAGE_END], dtype=torch.int8)
    return torch.cat([start, roles.flatten(), end])


def llm_grid(n_vit_h: int, n_vit_w: int, ratio: int) -> tuple[int, int]:
    """The aligner's rows and columns for a patch grid (each side padded up to the merge ratio)."""
    return -(-n_vit_h // ratio), -(-n_vit_w // ratio)
