"""Images in the OpenAI chat API: ``{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}``
content parts become the model's image placeholder in the message text, in place, and the part's base64 payload
one element of the Triton model's ``image`` input (engine/images.py expands and checks them). Only ``data:`` URLs:
this front does not fetch remote images (``http(s)://`` is refused, naming the part); and whether the served model
takes images at all, read from its checkpoint without loading it (``/v1/models``)."""
from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

from backend_lib.frontend.openai.errors import bad_request
from backend_lib.models.deepseek_v41.vision.placeholder import IMAGE_PLACEHOLDER

_DATA_TYPES = ("image/png", "image/jpeg", "image/jpg", "image/webp")


def data_url_payload(url: str, param: str) -> str:
    """The base64 text of a ``data:image/...;base64,`` URL."""
    if url.startswith(("http://", "https://")):
        raise bad_request(f"{param}: remote image URLs are not fetched by this server; send the image inline as a "
                          "data:image/png;base64,... URL", param=param)
    head, comma, payload = url.partition(",")
    if not url.startswith("data:") or not comma or not head.endswith(";base64"):
        raise bad_request(f"{param}: an image URL must be data:image/png|jpeg|webp;base64,<data>", param=param)
    mime = head[len("data:"):-len(";base64")].lower()
    if mime not in _DATA_TYPES:
        raise bad_request(f"{param}: image type {mime!r} is not one of PNG, JPEG, WebP", param=param)
    return payload


def part_text(index: int, k: int, part: Any, images: list[str]) -> str:
    """A content part's text: a text part's own, an image part's placeholder (its payload appended to ``images``)."""
    param = f"messages[{index}].content[{k}]"
    if part.type == "text" and part.text is not None:
        return part.text
    if part.type == "image_url" and part.image_url is not None:
        images.append(data_url_payload(part.image_url.url, param + ".image_url.url"))
        return IMAGE_PLACEHOLDER
    raise bad_request(f"messages[{index}].content: only text and image_url parts are supported, got a "
                      f"{part.type!r} part", param=f"messages[{index}].content")


def checkpoint_takes_images(path: str) -> bool:
    """A Hugging Face directory whose config has a ``vision_config`` and whose tensors include ``vision.*``."""
    root = Path(path)
    try:
        config = json.loads((root / "config.json").read_text())
    except (OSError, ValueError):
        return False  # a GGUF file, or no config: a text model
    if not isinstance(config.get("vision_config"), dict):
        return False
    index = root / "model.safetensors.index.json"
    if index.exists():
        names = json.loads(index.read_text()).get("weight_map", {})
        return any(name.startswith("vision.") for name in names)
    for file in root.glob("*.safetensors"):
        with open(file, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            if any(name.startswith("vision.") for name in json.loads(f.read(size))):
                return True
    return False
