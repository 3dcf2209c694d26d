"""Images in the OpenAI chat API: ``{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}``
content parts become the model's image placeholder in the message text, in place, and the part's base64 payload
one element of the Triton model's ``image`` input (engine/images.py expands and checks them). ``http(s)://`` URLs
are refused, naming the part, unless the front was started with ``--allow-remote-images``: then ``fetch_remote``
downloads them first (off the event loop; at most ``REMOTE_MAX_BYTES``, ``REMOTE_TIMEOUT_S``) and they go on as
data URLs. And whether the served model takes images at all, read from its checkpoint without loading it
(``/v1/models``)."""
from __future__ import annotations

import asyncio
import base64
import json
import struct
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from backend_lib.frontend.openai.errors import bad_request
from backend_lib.models.deepseek_v41.vision.placeholder import IMAGE_PLACEHOLDER

_DATA_TYPES = ("image/png", "image/jpeg", "image/jpg", "image/webp")
REMOTE_MAX_BYTES = 20 * 1024 * 1024  # the engine's default max_image_bytes
REMOTE_TIMEOUT_S = 10.0


def _download(url: str, param: str) -> str:
    """A remote image as a data URL (its Content-Type kept; the engine decodes and checks the bytes)."""
    try:
        with urllib.request.urlopen(url, timeout=REMOTE_TIMEOUT_S) as response:
            data = response.read(REMOTE_MAX_BYTES + 1)
            mime = response.headers.get_content_type()
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise bad_request(f"{param}: could not fetch the image ({exc})", param=param) from exc
    if len(data) > REMOTE_MAX_BYTES:
        raise bad_request(f"{param}: the image is over {REMOTE_MAX_BYTES} bytes", param=param)
    return f"data:{mime};base64," + base64.b64encode(data).decode("ascii")


async def fetch_remote(messages: list[Any]) -> None:
    """In place: every ``http(s)://`` image part of ``messages`` becomes the data URL of what it points at."""
    for index, message in enumerate(messages):
        if not isinstance(message.content, list):
            continue
        for k, part in enumerate(message.content):
            if part.type == "image_url" and part.image_url is not None and \
                    part.image_url.url.startswith(("http://", "https://")):
                param = f"messages[{index}].content[{k}].image_url.url"
                part.image_url.url = await asyncio.to_thread(_download, part.image_url.url, param)


def data_url_payload(url: str, param: str) -> str:
    """The base64 text of a ``data:image/...;base64,`` URL."""
    if url.startswith(("http://", "https://")):
        raise bad_request(f"{param}: remote image URLs are not fetched by this server (start the OpenAI front with "
                          "--allow-remote-images to allow it); send the image inline as a data:image/png;base64,... "
                          "URL", param=param)
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
