"""A test oracle for DeepSeek-V4.1's vision tower, aligner, image span and image preprocessing: plain torch over the
release's tensor names (``vision.*``, ``aligner.*``, ``image_{start,newline,end}``), one image at a time, written as
functions of a tensor dict so that it shares no code with ``backend_lib/models/deepseek_v41/vision``.

Where each piece comes from (read with the search tools; NeMo AutoModel's ``deepseek_v41/vision.py`` re-uses its
``deepseek_v4/vision.py`` unchanged, with the V4.1 nested config translated):
- the 2D rotary table (row angles ``h * inv_freq``, column angles ``w * inv_freq`` over ``head_dim / 2`` channels,
  interleaved per frequency as ``stack([h, w])`` then flattened) and its rotate-half application in fp32
  [NeMo ``deepseek_v4/vision.py @a3daff8b -> get_vision_cos_sin, apply_vision_rotary``; vLLM
  ``deepseek_v4/common/vision.py @4c5eba3e -> _compute_vision_cos_sin, apply_rotary``];
- RMSNorm eps 1e-6 with an fp32 weight, output in the input dtype [``DeepseekV4VisionRMSNorm`` / ``DeepseekV4RMSNorm``];
- the patch embedding ``Linear(3 * p * p -> vision_dim, bias)`` of the flattened [3, p, p] patch; pre-norm blocks
  ``x + wo(sdpa(rope(q), rope(k), v))`` with ``wqkv`` chunked q | k | v, then ``x + w2(silu(g) * u)`` with ``w1``
  chunked gate | up (no bias); the final norm [``DeepseekV4VisionBlock``, ``DeepseekV4VisionTransformer.forward``];
- the aligner: [n_h * n_w, C] -> [C, n_h, n_w], zero-padded right / bottom to the downsample multiple, ``F.unfold``
  r x r with stride r (channel-major rows of C * r * r), ``w2(gelu(w1(.)))`` [``DeepseekV4VisionAligner.forward``];
- the span: roles START, (IMAGE x n_w, NEWLINE) x n_h, END; IMAGE rows from the aligner in reading order, the
  delimiters the fp32 learned vectors cast to the embedding dtype [vLLM ``deepseek_v41/common/mm_preprocess.py
  @707bb964 -> image_token_types``; ``common/vl_cudagraph.py -> _build_image_span``];
- preprocessing [vLLM ``deepseek_v41/common/mm_preprocess.py @707bb964 -> load_image, safe_resize,
  solve_resize_ratio, llm_grid``, "ported from the official repository's image_processor.py"]: RGB; the width clamped
  to ``max_wh_ratio`` x height; an upscale of both sides to ``min_pixels``; sizes rounded up to the patch; the grid
  shrunk until ``n_h * (n_w + 1) + 2 <= max_image_tokens``; images at least ``max_wh_ratio`` wide resized, others
  fitted with ``ImageOps.pad`` on grey 127; ``(x / 255 - 0.5) / 0.5`` in bf16; patches [N, 3, p, p] row-major.
"""
from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image, ImageOps

IMAGE_START, IMAGE, IMAGE_NEW_LINE, IMAGE_END = range(4)


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    xf = x.float()
    return (weight.float() * (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps))).to(x.dtype)


def _linear(x: torch.Tensor, t: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    bias = t.get(name + ".bias")
    return F.linear(x, t[name + ".weight"].to(x.dtype), None if bias is None else bias.to(x.dtype))


def rope_tables(n_h: int, n_w: int, dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [n_h * n_w, 1, dim] fp32 (``dim`` = head_dim / 2)."""
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    hpos = torch.arange(n_h).unsqueeze(1).expand(n_h, n_w)
    wpos = torch.arange(n_w).unsqueeze(0).expand(n_h, n_w)
    freqs = (torch.stack([hpos, wpos], dim=-1).reshape(-1, 2, 1).float() * inv).flatten(1)
    return freqs.cos().unsqueeze(1), freqs.sin().unsqueeze(1)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def vit(t: dict[str, torch.Tensor], vision: dict, patches: torch.Tensor, n_h: int, n_w: int,
        dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[n_h * n_w, 3, p, p] patches -> [n_h * n_w, vision_dim]."""
    heads = vision["num_attention_heads"]
    head_dim = vision["hidden_size"] // heads
    x = _linear(patches.flatten(1).to(dtype), t, "vision.patch_embed.proj")
    cos, sin = rope_tables(n_h, n_w, head_dim // 2, float(vision["rope_theta"]))
    n = x.shape[0]
    for i in range(vision["num_hidden_layers"]):
        p = f"vision.blocks.{i}."
        q, k, v = (y.view(n, heads, head_dim) for y in _linear(_rms(x, t[p + "norm1.weight"]), t,
                                                              p + "attn.wqkv").chunk(3, -1))
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1))
        x = x + _linear(o.transpose(0, 1).reshape(n, -1), t, p + "attn.wo")
        gate, up = _linear(_rms(x, t[p + "norm2.weight"]), t, p + "mlp.w1").chunk(2, -1)
        x = x + _linear(F.silu(gate) * up, t, p + "mlp.w2")
    return _rms(x, t["vision.norm.weight"])


def aligner(t: dict[str, torch.Tensor], ratio: int, x: torch.Tensor, n_h: int, n_w: int) -> torch.Tensor:
    """[n_h * n_w, vision_dim] -> [ceil(n_h / r) * ceil(n_w / r), hidden]."""
    x = x.view(n_h, n_w, -1).permute(2, 0, 1)
    x = F.pad(x, (0, -n_w % ratio, 0, -n_h % ratio))
    x = F.unfold(x.unsqueeze(0), ratio, stride=ratio).squeeze(0).transpose(0, 1)
    return _linear(F.gelu(_linear(x, t, "aligner.w1")), t, "aligner.w2")


def span_types(n_llm_h: int, n_llm_w: int) -> list[int]:
    return [IMAGE_START] + ([IMAGE] * n_llm_w + [IMAGE_NEW_LINE]) * n_llm_h + [IMAGE_END]


def image_span(t: dict[str, torch.Tensor], vision: dict, patches: torch.Tensor, n_h: int, n_w: int,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The whole span's input embeddings [n_llm_h * (n_llm_w + 1) + 2, hidden] for one preprocessed image."""
    r = vision["downsample_ratio"]
    rows = aligner(t, r, vit(t, vision, patches, n_h, n_w, dtype), n_h, n_w)
    types = torch.tensor(span_types(-(-n_h // r), -(-n_w // r)))
    span = rows.new_empty(types.numel(), rows.shape[-1])
    span[types == IMAGE_START] = t["image_start"].to(dtype)
    span[types == IMAGE_END] = t["image_end"].to(dtype)
    span[types == IMAGE_NEW_LINE] = t["image_newline"].to(dtype)
    span[types == IMAGE] = rows
    return span


# ---- preprocessing (vLLM mm_preprocess.load_image) --------------------------------------------------------------
def _llm_grid(best_h: int, best_w: int, p: int, r: int) -> tuple[int, int]:
    return math.ceil((best_h // p) / r), math.ceil((best_w // p) / r)


def _solve(height: float, width: float, p: int, r: int, max_n: int) -> tuple[int, int]:
    ratio = height / width
    max_w = math.sqrt((max_n - 2) / ratio + 0.25) - 0.5
    max_h = max_w * ratio
    cell = p * r
    if max_w < 1.0:
        return (max_n - 2) // 2 * cell, cell
    if max_h < 1.0:
        return cell, (max_n - 3) * cell
    beta = min(math.floor(max_w) * cell / width, math.floor(max_h) * cell / height)
    return math.floor(height * beta / p) * p, math.floor(width * beta / p) * p


def load_image(image: Image.Image, vision: dict) -> tuple[torch.Tensor, int, int, int, int]:
    """patches [N, 3, p, p] bf16, n_vit_h, n_vit_w, n_llm_h, n_llm_w."""
    p, r, max_n = vision["patch_size"], vision["downsample_ratio"], vision["max_image_tokens"]
    min_pixels, max_wh = vision["min_pixels"], vision.get("max_wh_ratio")
    image = image.convert("RGB")
    width, height = image.size
    if max_wh is not None and width > height * max_wh:
        width = height * max_wh
    if 0 < width * height < min_pixels:
        scale = (min_pixels / (width * height)) ** 0.5
        width, height = int(width * scale), int(height * scale)
    best_w, best_h = math.ceil(width / p) * p, math.ceil(height / p) * p
    n_llm_h, n_llm_w = _llm_grid(best_h, best_w, p, r)
    if n_llm_h * (n_llm_w + 1) + 2 > max_n:
        best_h, best_w = _solve(height, width, p, r, max_n)
        n_llm_h, n_llm_w = _llm_grid(best_h, best_w, p, r)
    n_vit_h, n_vit_w = best_h // p, best_w // p
    if max_wh is not None and image.width >= max_wh * image.height:
        image = image.resize((best_w, best_h))
    else:
        image = ImageOps.pad(image, (best_w, best_h), color=(127, 127, 127))
    x = torch.from_numpy(np.asarray(image, dtype=np.float32)).permute(2, 0, 1) / 255
    x = ((x - 0.5) / 0.5).to(torch.bfloat16)
    patches = x.reshape(3, n_vit_h, p, n_vit_w, p).permute(1, 3, 0, 2, 4).reshape(n_vit_h * n_vit_w, 3, p, p)
    return patches, n_vit_h, n_vit_w, n_llm_h, n_llm_w
