"""V4.1's aligner (NeMo ``DeepseekV4VisionAligner``; vLLM ``DeepseekV4Aligner``): the ViT's [n_h, n_w] grid
zero-padded right and bottom to a multiple of ``downsample_ratio`` r, each r x r cell merged into one row of
``vision_dim * r * r`` values (channel-major within the cell, as ``F.unfold`` lays it out: channel c's r * r pixels
together, row-major), then ``w2(gelu(w1(.)))`` into the text width. Names under ``aligner.``: ``w1``, ``w2`` (bias)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from backend_lib.models.deepseek_v41.vision.config import VisionArgs
from backend_lib.models.deepseek_v41.vision.span import llm_grid


class VisionAligner(nn.Module):
    def __init__(self, a: VisionArgs) -> None:
        super().__init__()
        self.ratio = a.downsample_ratio
        self.w1 = nn.Linear(a.hidden_size * a.downsample_ratio ** 2, a.text_hidden_size, bias=True)
        self.w2 = nn.Linear(a.text_hidden_size, a.text_hidden_size, bias=True)

    def merge(self, x: torch.Tensor,  # [n_h * n_w, C]
              n_h: int, n_w: int) -> torch.Tensor:  # [rows * cols, C * r * r]
        r = self.ratio
        rows, cols = llm_grid(n_h, n_w, r)
        grid = x.new_zeros(rows * r, cols * r, x.shape[-1])
        grid[:n_h, :n_w] = x.view(n_h, n_w, -1)
        # [rows, r, cols, r, C] -> [rows, cols, C, r, r]: one cell's channels outermost
        cells = grid.view(rows, r, cols, r, -1).permute(0, 2, 4, 1, 3)
        return cells.reshape(rows * cols, -1)

    def forward(self, x: torch.Tensor, n_h: int, n_w: int) -> torch.Tensor:  # [n_h * n_w, C] -> [rows * cols, hidden]
        return self.w2(F.gelu(self.w1(self.merge(x, n_h, n_w))))
