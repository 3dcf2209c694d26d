"""Image bytes -> ViT patches, as V4.1's reference does it (vLLM ``deepseek_v41/common/mm_preprocess.py ->
load_image``, "ported from the official repository's image_processor.py"), with the request limits checked on the way.

Steps: decode (Pillow; PNG, JPEG or WebP only, the whole payload read so a truncated one is refused), RGB; the
*width* clamped to ``max_wh_ratio`` x height (a tall image is not clamped: the reference clamps only width); both
sides scaled up together (truncated to ints) until the area reaches ``min_pixels``; sides rounded up to the patch;
if the span ``n_llm_h * (n_llm_w + 1) + 2`` is over ``max_image_tokens``, the largest aspect-keeping size that fits
(a single column / row for extreme aspects); an image at least ``max_wh_ratio`` wide is resized to that size,
others fitted inside it and centred on grey 127 (``ImageOps.pad``); values ``(x / 255 - 0.5) / 0.5`` in bf16;
patches [N, 3, p, p] in reading order."""
from __future__ import annotations

import hashlib
import io
import math
import warnings
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image, ImageOps

from backend_lib.core.errors import RequestError
from backend_lib.models.deepseek_v41.vision.config import VisionArgs
from backend_lib.models.deepseek_v41.vision.span import llm_grid, span_length

FORMATS = ("PNG", "JPEG", "WEBP")
GREY = (127, 127, 127)


@dataclass(frozen=True)
class ImageLimits:
    max_image_bytes: int
    max_image_pixels: int  # width x height as decoded, before any resize


@dataclass(frozen=True)
class PreprocessedImage:
    patches: torch.Tensor  # [n_vit_h * n_vit_w, 3, p, p] bf16
    n_vit_h: int
    n_vit_w: int
    n_llm_h: int
    n_llm_w: int
    digest: str  # sha256 of the bytes and the preprocessing settings: the span's prefix-cache key

    @property
    def num_tokens(self) -> int:
        return span_length(self.n_llm_h, self.n_llm_w)


def decode(data: bytes, field: str, limits: ImageLimits) -> Image.Image:
    """The image in ``data``, refused (RequestError naming ``field``) when it is over a limit, not PNG / JPEG / WebP,
    or truncated / corrupt."""
    if len(data) > limits.max_image_bytes:
        raise RequestError(field, f"{field}: the image has {len(data)} bytes; the limit (max_image_bytes) is "
                                  f"{limits.max_image_bytes}", limit="max_image_bytes")
    try:
        with warnings.catch_warnings():  # Pillow's own bomb warning: our pixel limit below decides
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data), formats=FORMATS)
    except Image.DecompressionBombError as err:  # past twice Pillow's own bound: ours is lower, so ours is hit
        raise RequestError(field, f"{field}: {err}; the limit (max_image_pixels) is {limits.max_image_pixels}",
                           limit="max_image_pixels") from err
    except (OSError, SyntaxError, ValueError) as err:
        raise RequestError(field, f"{field}: not a PNG, JPEG or WebP image ({err})") from err
    width, height = image.size
    if width * height > limits.max_image_pixels:
        raise RequestError(field, f"{field}: the image is {width}x{height} = {width * height} pixels; the limit "
                                  f"(max_image_pixels) is {limits.max_image_pixels}", limit="max_image_pixels")
    if width < 1 or height < 1:
        raise RequestError(field, f"{field}: the image is empty ({width}x{height})")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image.load()  # decodes every byte: a truncated payload fails here
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as err:
        raise RequestError(field, f"{field}: truncated or corrupt {image.format} image ({err})") from err
    return image


def target_size(width: int, height: int, a: VisionArgs) -> tuple[int, int]:
    """(height, width) in pixels, multiples of the patch, whose span fits ``max_image_tokens``."""
    p, r = a.patch_size, a.downsample_ratio
    w: float = width
    h: float = height
    if a.max_wh_ratio is not None and w > h * a.max_wh_ratio:
        w = h * a.max_wh_ratio
    if 0 < w * h < a.min_pixels:
        up = (a.min_pixels / (w * h)) ** 0.5  # not math.sqrt: the reference's rounding, bit for bit
        w, h = int(w * up), int(h * up)
    out_h, out_w = math.ceil(h / p) * p, math.ceil(w / p) * p
    if span_length(*llm_grid(out_h // p, out_w // p, r)) <= a.max_image_tokens:
        return out_h, out_w
    return _fit_span(h, w, a)


def _fit_span(h: float, w: float, a: VisionArgs) -> tuple[int, int]:
    # rows x (cols + 1) + 2 <= max with rows = cols * h / w: the positive root of a quadratic in cols
    p, cell, budget = a.patch_size, a.patch_size * a.downsample_ratio, a.max_image_tokens
    aspect = h / w
    cols = math.sqrt((budget - 2) / aspect + 0.25) - 0.5
    rows = cols * aspect
    if cols < 1.0:
        return (budget - 2) // 2 * cell, cell
    if rows < 1.0:
        return cell, (budget - 3) * cell
    scale = min(math.floor(cols) * cell / w, math.floor(rows) * cell / h)
    return math.floor(h * scale / p) * p, math.floor(w * scale / p) * p


def to_patches(image: Image.Image, a: VisionArgs, digest: str = "") -> PreprocessedImage:
    p = a.patch_size
    rgb = image.convert("RGB")
    out_h, out_w = target_size(rgb.width, rgb.height, a)
    if a.max_wh_ratio is not None and rgb.width >= a.max_wh_ratio * rgb.height:
        sized = rgb.resize((out_w, out_h))
    else:
        sized = ImageOps.pad(rgb, (out_w, out_h), color=GREY)
    pixels = torch.from_numpy(np.asarray(sized, dtype=np.float32))  # [H, W, 3]
    values = ((pixels / 255 - 0.5) / 0.5).to(torch.bfloat16)
    n_h, n_w = out_h // p, out_w // p
    patches = values.view(n_h, p, n_w, p, 3).permute(0, 2, 4, 1, 3).reshape(n_h * n_w, 3, p, p).contiguous()
    return PreprocessedImage(patches, n_h, n_w, *llm_grid(n_h, n_w, a.downsample_ratio), digest)


def image_digest(data: bytes, a: VisionArgs) -> str:
    settings = (a.patch_size, a.downsample_ratio, a.max_image_tokens, a.min_pixels, a.max_wh_ratio)
    return hashlib.sha256(repr(settings).encode() + b"\0" + data).hexdigest()


def preprocess(data: bytes, field: str, a: VisionArgs, limits: ImageLimits) -> PreprocessedImage:
    return to_patches(decode(data, field, limits), a, image_digest(data, a))
