"""Triton-free codec, request side: a request's tensors and parameters -> plain Python values -> the engine's intake.

model.py only moves numpy arrays and strings in and out of ``pb_utils``. Here the tensors become values (one
element, BYTES as UTF-8 text, BOOL flags, INT32 ids as a list) and the request's parts are routed: which prompt
input, the sampling fields (``sampling_parameters`` JSON and request parameters), the sequence controls, which
outputs to return. What the values mean, and every check of them, is the engine's intake
(``backend_lib/engine/intake.py``); config.pbtxt parameters are ``parameters.py``'s, response tensors
``responses.py``'s. Unit-tested without a server.

The tensor API follows Triton's vLLM backend (text_input, stream, sampling_parameters,
exclude_input_in_output, return_* flags; text_output, finish_reason, cumulative_logprob, logprobs,
num_input_tokens, num_output_tokens) so its clients and ``genai-perf --backend vllm`` work unchanged.
Ours besides: input_ids (INT32) or messages (BYTES, JSON chat) instead of text, output_ids, and prompt_logprobs
(the prompt_logprobs sampling field's answer, with the first response that carries tokens). ``image`` (BYTES, one
base64-encoded PNG / JPEG / WebP per element, as the vLLM backend takes it) goes with any prompt input, one image
per placeholder of the prompt (engine/images.py).
"""
from __future__ import annotations

import base64
import binascii

from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

import numpy as np

from backend_lib.core.errors import RequestError
from backend_lib.core.outputs import SessionControl
from backend_lib.core.sampling_params import SamplingParams
from backend_lib.engine.intake import (SESSION_PARAMETERS, IntakeRequest, Prompt, RequestRules, parse_json,
                                       parse_session, take_in)

# Triton's request flags (tritonserver.h): the sequence protocol on gRPC.
FLAG_SEQUENCE_START = 1
FLAG_SEQUENCE_END = 2

PROMPT_INPUTS = ("text_input", "input_ids", "messages")
BOOL_INPUTS = ("stream", "exclude_input_in_output", "return_finish_reason", "return_cumulative_logprob",
               "return_logprobs", "return_num_input_tokens", "return_num_output_tokens")
IMAGE_INPUT = "image"
INPUT_NAMES = PROMPT_INPUTS + ("sampling_parameters", IMAGE_INPUT) + BOOL_INPUTS


@dataclass
class OutputOptions:
    """Which optional outputs the client asked for (the vLLM backend's return_* inputs)."""

    finish_reason: bool = False
    cumulative_logprob: bool = False
    logprobs: bool = False
    num_input_tokens: bool = False
    num_output_tokens: bool = False
    # The outputs the client named in its request (empty: it named none, so it gets every output). Triton drops
    # unnamed outputs before they reach the client; not building them saves the stub and Triton a copy each.
    requested: frozenset[str] = frozenset()

    def sends(self, output: str) -> bool:
        """Whether responses carry ``output``: its return_* flag is on (text_output and output_ids have none)
        and the client named it, if it named any."""
        return getattr(self, output, True) and (not self.requested or output in self.requested)


@dataclass
class DecodedRequest:
    request: IntakeRequest  # what the engine runs: the intake's
    stream: bool = False
    prepend_text: str = ""  # the prompt text put before a non-streamed output ("" when excluded)
    prepend_ids: list[int] = field(default_factory=list)  # an input_ids prompt to decode and put there instead
    options: OutputOptions = field(default_factory=OutputOptions)

    @property
    def prompt(self) -> Prompt:
        return self.request.prompt

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    @property
    def session(self) -> SessionControl | None:
        return self.request.session


def _scalar(name: str, array: np.ndarray) -> Any:
    flat = np.asarray(array).reshape(-1)
    if flat.size != 1:
        raise RequestError(name, f"input {name} must hold exactly one element, got shape {list(np.shape(array))}")
    return flat[0]


def _text(name: str, array: np.ndarray) -> str:
    value = _scalar(name, array)
    if isinstance(value, (bytes, np.bytes_)):
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise RequestError(name, f"input {name} is not valid UTF-8: {exc}") from None
    if isinstance(value, str):
        return value
    raise RequestError(name, f"input {name} must be BYTES (a string), got {np.asarray(array).dtype}")


def _bool_input(name: str, array: np.ndarray) -> bool:
    value = _scalar(name, array)
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    raise RequestError(name, f"input {name} must be BOOL, got {np.asarray(array).dtype}")


def _prompt_input(inputs: Mapping[str, np.ndarray]) -> tuple[str, str | list[Any]]:
    """The one prompt input's name and its value as plain Python (text, or a list of ids), unchecked."""
    given = [name for name in PROMPT_INPUTS if name in inputs]
    if len(given) != 1:
        raise RequestError(given[-1] if given else "text_input", f"give exactly one of the inputs "
                           f"{', '.join(PROMPT_INPUTS)}; got {', '.join(given) if given else 'none'}")
    name = given[0]
    if name != "input_ids":
        return name, _text(name, inputs[name])
    ids = np.asarray(inputs[name])
    if ids.dtype.kind not in "iu":
        raise RequestError(name, f"input_ids must be INT32, got {ids.dtype}")
    # tolist() converts in C (Python ints, exact for uint64 too): the length cap is the intake's
    # (RequestLimits.max_input_ids), and a per-element Python loop made a huge tensor cost seconds first.
    return name, ids.reshape(-1).tolist()


def _images(array: np.ndarray) -> list[bytes]:
    """The ``image`` input: each element base64 text (the vLLM backend's form), decoded to the image's bytes."""
    images = []
    for k, value in enumerate(np.asarray(array).reshape(-1).tolist()):
        if not isinstance(value, (bytes, str)):
            raise RequestError(f"image[{k}]", f"input image must be BYTES (base64 text), got {type(value).__name__}")
        try:
            images.append(base64.b64decode(value, validate=True))
        except (binascii.Error, ValueError) as exc:
            raise RequestError(f"image[{k}]", f"image[{k}] is not base64: {exc}") from None
    return images


def decode_request(inputs: Mapping[str, np.ndarray], parameters_json: str = "{}",
                   correlation_id: int | str = 0, flags: int = 0,
                   requested_outputs: Iterable[str] = (), rules: RequestRules | None = None) -> DecodedRequest:
    """Input tensors + request parameters (+ gRPC sequence controls) -> the intake -> what the engine needs.

    ``inputs`` holds the numpy arrays of the inputs the request carries. Sampling fields come from the
    ``sampling_parameters`` JSON and/or request parameters (the JSON wins on a clash); ``rules`` are the engine's
    (``AsyncEngine.rules``; None: the default limits and no model, for unit tests). Raises RequestError naming the
    field; nothing is queued before this succeeds.
    """
    unknown_inputs = [name for name in inputs if name not in INPUT_NAMES]
    if unknown_inputs:
        raise RequestError(unknown_inputs[0], f"unknown input {unknown_inputs[0]!r} (allowed: "
                           f"{', '.join(INPUT_NAMES)})")
    prompt_field, raw_prompt = _prompt_input(inputs)

    request_parameters = parse_json("request parameters", parameters_json or "{}")
    if not isinstance(request_parameters, dict):
        raise RequestError(None, "request parameters must be a JSON object")
    session_values = {k: v for k, v in request_parameters.items() if k in SESSION_PARAMETERS}
    sampling = {k: v for k, v in request_parameters.items() if k not in SESSION_PARAMETERS}
    if "sampling_parameters" in inputs:
        text = _text("sampling_parameters", inputs["sampling_parameters"])
        from_json = parse_json("sampling_parameters", text) if text.strip() else {}
        if not isinstance(from_json, dict):
            raise RequestError("sampling_parameters", f"sampling_parameters must be a JSON object, got "
                               f"{type(from_json).__name__}")
        # vLLM clients send null for "use the default"; max_tokens' null is vLLM's "as many as fit" (SamplingParams).
        sampling.update({k: v for k, v in from_json.items() if v is not None or k == "max_tokens"})
    session = parse_session(session_values, correlation_id, bool(flags & FLAG_SEQUENCE_START),
                            bool(flags & FLAG_SEQUENCE_END))
    images = _images(inputs[IMAGE_INPUT]) if IMAGE_INPUT in inputs else None
    request = take_in(rules or RequestRules(), raw_prompt, sampling, session=session, prompt_field=prompt_field,
                      images=images)
    prompt = request.prompt

    bools = {name: _bool_input(name, inputs[name]) for name in BOOL_INPUTS if name in inputs}
    stream = bools.get("stream", False)
    if "exclude_input_in_output" in bools:
        prepend = not bools["exclude_input_in_output"]
    else:
        prepend = not stream  # the vLLM backend's default: prompt + output unless streaming
    if prepend and stream:
        raise RequestError("exclude_input_in_output", "exclude_input_in_output=false is not allowed when streaming")
    options = OutputOptions(**{name[len("return_"):]: bools.get(name, False)
                               for name in BOOL_INPUTS if name.startswith("return_")},
                            requested=frozenset(requested_outputs))
    return DecodedRequest(
        request=request,
        stream=stream,
        # A text prompt is repeated as given; input_ids are decoded only when the client asked by name
        # (exclude_input_in_output=false: OpenAI's echo), so the default output of an ids prompt stays the new text
        # alone, as it always was; chat messages have no text (documented choice).
        prepend_text=prompt if (prepend and isinstance(prompt, str)) else "",
        prepend_ids=list(prompt) if "exclude_input_in_output" in bools and prepend and request.is_token_ids else [],
        options=options,
    )
