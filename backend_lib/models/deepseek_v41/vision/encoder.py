"""The vision encoder of a V4.1 checkpoint: the tower (``vision.*``), the aligner (``aligner.*``) and the learned fp32
delimiters ``image_start`` / ``image_newline`` / ``image_end`` (``image_pad`` is in the release but unused by V4.1's
layout, vLLM's ``vl_model.py``). ``span_embeddings`` turns one preprocessed image into its whole span's input
embeddings, in the text model's dtype, to enter the text model before the hc expansion."""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from backend_lib.models.deepseek_v41.vision.aligner import VisionAligner
from backend_lib.models.deepseek_v41.vision.config import VisionArgs
from backend_lib.models.deepseek_v41.vision.preprocess import PreprocessedImage
from backend_lib.models.deepseek_v41.vision.span import IMAGE, IMAGE_END, IMAGE_NEW_LINE, IMAGE_PLACEHOLDER, \
    IMAGE_START, llm_grid, span_roles
from backend_lib.models.deepseek_v41.vision.tower import VisionTower

_PREFIXES = ("vision.", "aligner.", "image_start", "image_end", "image_newline", "image_pad")


def is_vision_tensor(name: str) -> bool:
    return name.startswith(_PREFIXES)


class V41VisionEncoder(nn.Module):
    placeholder = IMAGE_PLACEHOLDER

    def __init__(self, args: VisionArgs, dtype: torch.dtype = torch.float32, image_token_id: int = 129264) -> None:
        super().__init__()
        self.args, self.dtype, self.image_token_id = args, dtype, image_token_id
        self.vision = VisionTower(args)
        self.aligner = VisionAligner(args)
        for name in ("image_start", "image_end", "image_newline"):
            setattr(self, name, nn.Parameter(torch.zeros(args.text_hidden_size), requires_grad=False))
        self.requires_grad_(False)
        self.to(dtype)
        for name, p in self.named_parameters():  # the norms and the delimiters stay fp32, as the release stores them
            if name.endswith("norm1.weight") or name.endswith("norm2.weight") or name in (
                    "vision.norm.weight", "image_start", "image_end", "image_newline"):
                p.data = p.data.float()

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """``vision.*`` / ``aligner.*`` / ``image_*`` under the release's names; others are the caller's."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for raw, tensor in weights:
            name = raw.removeprefix("model.")
            if name == "image_pad" or not is_vision_tensor(name):
                continue
            target = params.get(name)
            if target is None:
                raise ValueError(f"unexpected vision checkpoint tensor {raw!r}")
            value = tensor.narrow(0, 0, tensor.shape[0]) if hasattr(tensor, "narrow") else torch.as_tensor(tensor)
            if tuple(value.shape) != tuple(target.shape):
                raise ValueError(f"{raw}: shape {tuple(value.shape)} != expected {tuple(target.shape)}")
            with torch.no_grad():
                target.copy_(value.to(target.dtype))
            loaded.add(name)
        missing = sorted(set(params) - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing vision weights: {missing[:8]}{' ...' if len(missing) > 8 else ''}")

    @torch.no_grad()
    def image_rows(self, patches: torch.Tensor,  # [n_h * n_w, 3, p, p]
                   n_h: int, n_w: int) -> torch.Tensor:  # [rows * cols, hidden] aligner rows in reading order
        return self.aligner(self.vision(patches, n_h, n_w), n_h, n_w)

    @torch.no_grad()
    def span_embeddings(self, patches: torch.Tensor,  # [n_h * n_w, 3, p, p]
                        n_h: int, n_w: int) -> torch.Tensor:  # [span_length, hidden] in the model dtype
        rows = self.image_rows(patches, n_h, n_w)
        roles = span_roles(*llm_grid(n_h, n_w, self.args.downsample_ratio)).to(rows.device)
        out = rows.new_empty(roles.numel(), rows.shape[-1])
        out[roles == IMAGE] = rows
        out[roles == IMAGE_START] = self.image_start.to(rows.dtype)
        out[roles == IMAGE_NEW_LINE] = self.image_newline.to(rows.dtype)
        out[roles == IMAGE_END] = self.image_end.to(rows.dtype)
        return out

    def encode(self, image: PreprocessedImage) -> torch.Tensor:  # [image.num_tokens, hidden]
        device = self.aligner.w1.weight.device
        return self.span_embeddings(image.patches.to(device), image.n_vit_h, image.n_vit_w)
