"""A request's images -> its prompt's image spans (a model with a vision tower: ``model.image_encoder``).

The placeholder rule: each image takes the place of one placeholder, in order. In text (and in the rendered chat
template) the placeholder is the encoder's ``placeholder`` string (V4.1: ``<｜deepseek_image｜>``), split out before
tokenizing, so the rule holds whatever the tokenizer makes of the string; in ``input_ids`` it is one
``image_token_id``. Placeholders and images must be as many. Each placeholder becomes the image's whole span
(``span_length`` positions, all ``image_token_id``); the encoder runs here, once per image, on the caller's thread
(off the step loop), and its output rides on the request (``core/request.py: PromptImage``) until it ends.
"""
from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

from backend_lib.core.config import EngineConfig, RequestLimits
from backend_lib.core.errors import RequestError
from backend_lib.core.request import PromptImage
from backend_lib.engine.tokenizer import Tokenizer
from backend_lib.models.deepseek_v41.vision.preprocess import ImageLimits, preprocess
from backend_lib.models.interfaces import capabilities_of

log = logging.getLogger(__name__)


class ImagePrompts:
    def __init__(self, encoder: Any, limits: RequestLimits) -> None:
        self.encoder = encoder
        self.image_token_id: int = encoder.image_token_id
        self.limits = ImageLimits(limits.max_image_bytes, limits.max_image_pixels)

    def tokenize(self, tokenizer: Tokenizer, prompt: Any, add_special_tokens: bool = True) -> list[int]:
        """The prompt's ids with one ``image_token_id`` per placeholder (token-id prompts as they are)."""
        if isinstance(prompt, str):
            text, specials = prompt, add_special_tokens
        elif prompt and isinstance(prompt[0], dict):
            text, specials = tokenizer.render_chat(prompt), False  # the template writes BOS itself
        else:
            return list(prompt)
        pieces = text.split(self.encoder.placeholder)
        ids = tokenizer.encode(pieces[0], add_special_tokens=specials)
        for piece in pieces[1:]:
            ids += [self.image_token_id] + (tokenizer.encode(piece, add_special_tokens=False) if piece else [])
        return ids

    def expand(self, ids: list[int], images: tuple[bytes, ...]) -> tuple[list[int], tuple[PromptImage, ...]]:
        """Each placeholder id replaced by its image's span; the spans' embeddings encoded."""
        slots = [i for i, t in enumerate(ids) if t == self.image_token_id]
        if len(slots) != len(images):
            raise RequestError("image", f"the prompt has {len(slots)} image placeholders ({self.encoder.placeholder!r} "
                               f"in text, id {self.image_token_id} in input_ids) for {len(images)} images; give "
                               f"one image per placeholder")
        out: list[int] = []
        spans: list[PromptImage] = []
        previous = 0
        for k, (slot, data) in enumerate(zip(slots, images)):
            image = preprocess(data, f"image[{k}]", self.encoder.args, self.limits)
            out += ids[previous:slot]
            spans.append(PromptImage(len(out), image.num_tokens, image.digest, self.encoder.encode(image)))
            out += [self.image_token_id] * image.num_tokens
            previous = slot + 1
        return out + ids[previous:], tuple(spans)

    def turn(self, tokenizer: Tokenizer, prompt: Any, history: list[int], kept: tuple[PromptImage, ...],
             images: tuple[bytes, ...]) -> tuple[list[int], tuple[PromptImage, ...]]:
        """A session turn: ``history`` (a text session's ids, whose spans are ``kept``) and the new prompt's ids with
        its ``images`` expanded after it. A chat turn passes the whole conversation, no history, every image."""
        ids, spans = self.expand(self.tokenize(tokenizer, prompt, add_special_tokens=not history), images)
        shifted = tuple(replace(span, start=span.start + len(history)) for span in spans)
        return history + ids, kept + shifted


def image_prompts_for(model: Any, config: EngineConfig) -> ImagePrompts | None:
    """The engine's image path, or None when the model takes no images. Tensor parallelism: the driver encodes (the
    tower is replicated on every rank, whole: it is small beside the text model, and splitting it would add two
    all-reduces per layer for a few thousand rows) and the step message carries the spans' embeddings to the other
    ranks. Context parallelism: images off (logged; no image model runs it)."""
    if not capabilities_of(model).images or model.image_encoder is None:
        return None
    if config.parallel.context_parallel_size > 1:
        log.warning("images are off with context_parallel_size %d", config.parallel.context_parallel_size)
        return None
    return ImagePrompts(model.image_encoder, config.limits)
