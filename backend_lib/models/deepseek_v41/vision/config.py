"""``vision_config`` of a V4.1 checkpoint, typed and checked (NeMo ``DeepseekV41VisionConfig``'s fields; vLLM flattens
them as ``vision_*``). The release: 32 layers of width 1024, 16 heads, intermediate 2816, 14-pixel patches, a 3x3
merge, ``max_image_tokens`` 1024, ``min_pixels`` 295936."""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any


@dataclass(frozen=True)
class VisionArgs:
    hidden_size: int = 1024
    intermediate_size: int = 2816
    num_hidden_layers: int = 32
    num_attention_heads: int = 16
    patch_size: int = 14
    downsample_ratio: int = 3
    rope_theta: float = 10000.0
    max_image_tokens: int = 1024
    min_pixels: int = 295936
    max_wh_ratio: float | None = None  # None: no aspect clamp
    text_hidden_size: int = 5120  # the aligner's output width (text_config.hidden_size)
    norm_eps: float = 1e-6  # the tower's RMSNorm (fixed in the reference, not a config field)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def patch_dim(self) -> int:
        return 3 * self.patch_size ** 2

    @classmethod
    def from_dict(cls, vision: dict[str, Any], text_hidden_size: int) -> "VisionArgs":
        known = {f.name for f in fields(cls)} - {"text_hidden_size", "norm_eps"}
        kwargs = {k: v for k, v in vision.items() if k in known}
        args = cls(**kwargs, text_hidden_size=text_hidden_size)
        args.check()
        return args

    def check(self) -> None:
        def need(ok: bool, message: str) -> None:
            if not ok:
                raise ValueError(f"vision_config.{message}")
        for name in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "patch_size",
                     "downsample_ratio"):
            need(isinstance(getattr(self, name), int) and getattr(self, name) >= 1,
                 f"{name} must be a positive integer, got {getattr(self, name)!r}")
        need(self.hidden_size % self.num_attention_heads == 0,
             f"hidden_size ({self.hidden_size}) must be a multiple of num_attention_heads ({self.num_attention_heads})")
        # 2D RoPE: head_dim / 2 angles, half rows and half columns, each a rotate-half pair
        need(self.head_dim % 4 == 0, f"hidden_size / num_attention_heads must be a multiple of 4, got {self.head_dim}")
        need(self.max_image_tokens >= 4, f"max_image_tokens must be >= 4, got {self.max_image_tokens}")
        need(self.min_pixels >= 0, f"min_pixels must be >= 0, got {self.min_pixels}")
        need(self.max_wh_ratio is None or self.max_wh_ratio > 0,
             f"max_wh_ratio must be > 0 or null, got {self.max_wh_ratio!r}")
