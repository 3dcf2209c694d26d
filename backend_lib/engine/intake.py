"""The intake: a request's plain values become a validated engine request here, and nowhere else.

Every front ends here, in one pass (``take_in`` -> ``IntakeRequest``): the Triton codec hands over the values it read
from the tensors and parameters (the OpenAI front's requests arrive through Triton the same way), ``LLM.generate``
and the CLI their prompts and ``SamplingParams``. The engine tokenizes an ``IntakeRequest`` once and checks only
what needs its tokens (the context room) or its state (ids in use, the session table); it re-checks nothing the
intake checked (it asserts the request was taken in under its own ``RequestRules``). Each rule lives once, and
every refusal is a ``RequestError`` (core/errors.py) naming the request field:

- fields (``parse_sampling``): unknown names (``SamplingParams.from_dict``), strings coerced for typed fields (HTTP
  parameters, vLLM-style clients), JSON text parsed with its recursion guard (``parse_json``), value ranges
  (``SamplingParams``), the structured-output fields (``structured_outputs``, ``guided_*``) parsed into an
  ``OutputConstraint`` under ``RequestLimits``' structured-output limits;
- the prompt (``parse_prompt``: ``parse_text`` / ``parse_input_ids`` / ``parse_messages``), session parameters
  (``parse_session``) and the scheduling priority (``parse_priority``);
- what the server allows one request (``check_prompt``, ``check_params``: ``RequestLimits``), token ids within the
  vocabulary (``check_ids``), the context room (``check_context``);
- images (``check_images``): the model takes them, their count and encoded size (``RequestLimits``); decoding,
  the pixel limit and the placeholders are the engine's (``engine/images.py``), which needs the model's settings;
- the fields a session turn cannot have (``check_turn_fields``); the room for a new session (``check_session_room``).

Two rules live in core because the scheduler holds them as its own contract too, and core cannot import the engine:
a request id not in use (``core/request.py: check_unused``) and a turn's session protocol
(``core/sessions.py: SessionTable.check_turn``); the engine calls them before any work.

Limit checks run before tokenization where they can: a huge prompt must not cost a tokenizer pass on the way to
its refusal.
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from backend_lib.core.config import RequestLimits
from backend_lib.core.errors import RequestError, busy
from backend_lib.core.outputs import SessionControl
from backend_lib.core.sampling_params import SamplingParams
from backend_lib.core.sessions import SessionTable
from backend_lib.structured_output.constraints import (CONSTRAINT_FIELDS, ConstraintKind, StructuredOutputError,
                                                      make_constraint, parse_constraint)

SESSION_PARAMETERS = ("sequence_id", "sequence_start", "sequence_end")
# vLLM's older flag for "any JSON object"; the other guided_* fields are the constraint parser's.
GUIDED_JSON_OBJECT = "guided_json_object"
# A request's scheduling priority (scheduling_policy "priority"; lower runs earlier): a field of the request, not
# of its sampling, but sent with the sampling fields (sampling_parameters, request parameters, OpenAI's extra field).
PRIORITY = "priority"
PRIORITY_RANGE = (-2**31, 2**31 - 1)
REQUEST_FIELDS = (*CONSTRAINT_FIELDS, GUIDED_JSON_OBJECT)  # fields besides SamplingParams' own

# Sampling fields by type, for values that arrive as strings (HTTP parameters, vLLM-style clients that send
# {"temperature": "0.1"}). Everything else goes to SamplingParams unchanged.
_INT_FIELDS = frozenset({"max_tokens", "top_k", "seed", "min_tokens", "logprobs", "prompt_logprobs"})
_FLOAT_FIELDS = frozenset({"temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                           "frequency_penalty"})
_BOOL_FIELDS = frozenset({"ignore_eos", "include_stop_str_in_output", "skip_special_tokens", "speculative",
                          GUIDED_JSON_OBJECT})
# No model behind the rules (the codec's unit tests): nothing is outside the vocabulary or the context.
_NO_MODEL_SIZE = 2**62

Prompt = str | list[int] | list[dict[str, Any]]


@dataclass(frozen=True)
class RequestRules:
    """What the intake checks a request against: the server's per-request limits and the model's sizes."""

    limits: RequestLimits = field(default_factory=RequestLimits)
    vocab_size: int = _NO_MODEL_SIZE
    max_model_len: int = _NO_MODEL_SIZE
    images: bool = False  # the model takes images (a vision tower loaded)


@dataclass(frozen=True)
class IntakeRequest:
    """A request the intake took in: typed values, each checked once under ``rules``."""

    prompt: Prompt  # text, token ids (within the vocabulary), or chat messages
    params: SamplingParams  # within rules.limits
    rules: RequestRules
    session: SessionControl | None = None
    priority: int | None = None  # None: not given (0, or a session's own: LLMEngine.submit)
    images: tuple[bytes, ...] = ()  # encoded images (PNG / JPEG / WebP), one per placeholder of the prompt

    @property
    def is_chat(self) -> bool:
        return _is_chat(self.prompt)

    @property
    def is_token_ids(self) -> bool:
        return not isinstance(self.prompt, str) and not self.is_chat


def take_in(rules: RequestRules, prompt: Any, sampling: Mapping[str, Any] | SamplingParams | None = None,
            session: SessionControl | None = None, prompt_field: str | None = None,
            priority: Any = None, images: Any = None) -> IntakeRequest:
    """A request's raw values -> an ``IntakeRequest``, or a RequestError naming the field.

    ``prompt``: text, a list of token ids or chat messages (a list of objects, or their JSON text when
    ``prompt_field`` is "messages"); ``prompt_field`` is the name the front's client gave it (the Triton inputs'
    names), else "prompt" for text. ``sampling``: the sampling and structured-output fields as plain values
    (strings allowed for typed fields; ``priority`` among them), or a ``SamplingParams`` a Python caller built
    (validated when built) with ``priority`` apart. ``images``: encoded images (bytes), in the order of the
    prompt's image placeholders."""
    prompt = parse_prompt(prompt, prompt_field)
    if isinstance(sampling, SamplingParams):
        params = sampling
    else:
        fields = dict(sampling or {})
        priority = fields.pop(PRIORITY, priority)
        params = parse_sampling(fields, rules.limits)
    priority = parse_priority(priority)
    check_params(rules.limits, params, rules.vocab_size)
    check_prompt(rules.limits, prompt, rules.max_model_len)
    images = check_images(rules, images)
    request = IntakeRequest(prompt, params, rules, session, priority, images)
    if request.is_token_ids:
        check_ids("input_ids", prompt, rules.vocab_size)
    if session is not None:
        check_turn_fields(params)
    return request


def check_images(rules: RequestRules, images: Any) -> tuple[bytes, ...]:
    """Encoded images: bytes each, only for a model that takes images, within max_images_per_request and
    max_image_bytes."""
    if images is None:
        return ()
    if isinstance(images, (bytes, bytearray)) or not isinstance(images, (list, tuple)):
        raise RequestError("image", f"image must be a list of encoded images, got {type(images).__name__}")
    if not images:
        return ()
    if not rules.images:
        raise RequestError("image", "this model does not take images (no vision tower loaded)")
    limits = rules.limits
    if len(images) > limits.max_images_per_request:
        raise _over("image", f"image has {len(images)} images; the limit (max_images_per_request) is "
                    f"{limits.max_images_per_request}", "max_images_per_request")
    for k, data in enumerate(images):
        if not isinstance(data, (bytes, bytearray)):
            raise RequestError(f"image[{k}]", f"image[{k}] must be bytes, got {type(data).__name__}")
        if len(data) > limits.max_image_bytes:
            raise _over(f"image[{k}]", f"image[{k}] has {len(data)} bytes; the limit (max_image_bytes) is "
                        f"{limits.max_image_bytes}", "max_image_bytes")
    return tuple(bytes(data) for data in images)


# ---------------------------------------------------------------------------------------------- values


def parse_bool(name: str, text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("true", "1", "yes", "on"):
        return True
    if lowered in ("false", "0", "no", "off"):
        return False
    raise RequestError(name, f"{name} must be true or false, got {text!r}")


def parse_json(name: str, text: str) -> Any:
    """json.loads with every failure a RequestError naming ``name``: Python's parser recurses per nesting level, so
    a deeply nested document ("[[[[...") raises RecursionError, not JSONDecodeError."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise RequestError(name, f"{name} is not valid JSON: {exc}") from None
    except RecursionError:
        raise RequestError(name, f"{name} is not valid JSON: nested too deeply") from None


def coerce(name: str, value: Any) -> Any:
    """Strings for typed sampling fields become numbers / booleans; anything else is left to SamplingParams."""
    if not isinstance(value, str):
        return value
    try:
        if name in _INT_FIELDS:
            return int(value.strip())
        if name in _FLOAT_FIELDS:
            return float(value.strip())
    except ValueError:
        kind = "an integer" if name in _INT_FIELDS else "a number"
        raise RequestError(name, f"{name} must be {kind}, got {value!r}") from None
    if name in _BOOL_FIELDS:
        return parse_bool(name, value)
    return value


def parse_priority(value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = int(value.strip())
        except ValueError:
            raise RequestError(PRIORITY, f"priority must be an integer, got {value!r}") from None
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(PRIORITY, f"priority must be an integer, got {type(value).__name__} {value!r}")
    low, high = PRIORITY_RANGE
    if not low <= value <= high:
        raise RequestError(PRIORITY, f"priority must be in [{low}, {high}] (lower runs earlier), got {value}")
    return value


def from_structured_output_error(exc: StructuredOutputError) -> RequestError:
    """structured_output/ sits below core and raises its own typed refusal: the same field, as a RequestError."""
    field = exc.field.split(".", 1)[0]  # structured_outputs.json -> the request field structured_outputs
    return RequestError(field, str(exc), limit=getattr(exc, "limit_name", None))  # limits and compile timeouts


def parse_sampling(fields: Mapping[str, Any], limits: RequestLimits) -> SamplingParams:
    """Sampling and structured-output fields (plain values; strings allowed for typed fields) -> SamplingParams."""
    values = {name: coerce(name, value) for name, value in fields.items()}
    constraint_fields = {name: values.pop(name) for name in REQUEST_FIELDS if name in values}
    try:
        constraint = parse_constraint(constraint_fields, limits.structured_output_limits())
        json_object = constraint_fields.get(GUIDED_JSON_OBJECT)
        if json_object is not None and not isinstance(json_object, bool):
            raise RequestError(GUIDED_JSON_OBJECT, f"{GUIDED_JSON_OBJECT} must be true or false, got {json_object!r}")
        if json_object:
            if constraint is not None:
                raise RequestError(GUIDED_JSON_OBJECT, f"{GUIDED_JSON_OBJECT} and {constraint.field} both "
                                   "constrain the output; send exactly one constraint")
            constraint = make_constraint(ConstraintKind.JSON_OBJECT, True, field_name=GUIDED_JSON_OBJECT)
    except StructuredOutputError as exc:
        raise from_structured_output_error(exc) from None
    if constraint is not None:
        values["structured_outputs"] = constraint
    return SamplingParams.from_dict(values, also_allowed=REQUEST_FIELDS + SESSION_PARAMETERS + (PRIORITY,))


# ---------------------------------------------------------------------------------------------- the prompt


def _is_chat(prompt: Any) -> bool:
    return isinstance(prompt, (list, tuple)) and bool(prompt) and isinstance(prompt[0], dict)


def parse_prompt(prompt: Any, field_name: str | None = None) -> Prompt:
    """Text, token ids or chat messages, by the front's field name or (Python callers) by the value's type."""
    if field_name == "messages" and isinstance(prompt, str):
        return parse_messages(field_name, prompt)
    if isinstance(prompt, str):
        return parse_text(field_name or "prompt", prompt)
    if not isinstance(prompt, (list, tuple)):
        raise RequestError(field_name or "prompt", f"{field_name or 'prompt'} must be text, a list of token ids or "
                           f"a list of chat messages, got {type(prompt).__name__}")
    if _is_chat(prompt):
        return check_messages(field_name or "messages", list(prompt))
    return parse_input_ids(field_name or "input_ids", list(prompt))


def parse_text(name: str, text: str) -> str:
    if not text:
        raise RequestError(name, f"{name} is empty: the prompt must have at least one character")
    return text


def parse_input_ids(name: str, ids: list[Any]) -> list[int]:
    if not ids:
        raise RequestError(name, f"{name} is empty: the prompt must have at least one token")
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise RequestError(name, f"{name} must be a list of integers")
    if min(ids) < 0:
        raise RequestError(name, f"{name} must be >= 0, got {min(ids)}")
    return ids


def parse_messages(name: str, text: str) -> list[dict[str, str]]:
    """A chat's messages from their JSON text: a non-empty list of {"role": str, "content": str}."""
    return check_messages(name, parse_json(name, text))


def check_messages(name: str, messages: Any) -> list[dict[str, str]]:
    if not isinstance(messages, list) or not messages:
        raise RequestError(name, f"{name} must be a non-empty JSON list of {{\"role\": ..., \"content\": ...}} "
                           "objects")
    for i, message in enumerate(messages):
        if (not isinstance(message, dict) or not isinstance(message.get("role"), str)
                or not isinstance(message.get("content"), str)):
            raise RequestError(name, f"{name}[{i}] must be an object with string fields role and content, got "
                               f"{message!r}")
    return messages


def parse_session(values: Mapping[str, Any], sequence_id: int | str = 0, start: bool = False,
                  end: bool = False) -> SessionControl | None:
    """Session parameters (``SESSION_PARAMETERS``, e.g. HTTP's) over the protocol's own (gRPC's correlation id and
    flags) -> a SessionControl, or None when the request is not a session turn."""
    sequence_id = values.get("sequence_id", sequence_id)
    for name in ("sequence_start", "sequence_end"):
        if name in values:
            value = values[name]
            value = parse_bool(name, value) if isinstance(value, str) else value
            if not isinstance(value, bool):
                raise RequestError(name, f"{name} must be a boolean, got {value!r}")
            if name == "sequence_start":
                start = start or value
            else:
                end = end or value
    if isinstance(sequence_id, bool) or not isinstance(sequence_id, (int, str)):
        raise RequestError("sequence_id", f"sequence_id must be an integer or a string, got {sequence_id!r}")
    if sequence_id in (0, ""):
        if start or end:
            raise RequestError("sequence_id", "sequence_start / sequence_end need a non-zero sequence_id")
        return None
    return SessionControl(session_id=str(sequence_id), start=start, end=end)


# ---------------------------------------------------------------------------------------------- limits


def _chars(value: Any) -> int:
    """Characters of every string in a JSON-like value (keys included); other scalars count one. Iterative: a
    deeply nested value must not exhaust the stack."""
    total, pending = 0, [value]
    while pending:
        item = pending.pop()
        if isinstance(item, str):
            total += len(item)
        elif isinstance(item, dict):
            pending.extend(item.keys())
            pending.extend(item.values())
        elif isinstance(item, (list, tuple)):
            pending.extend(item)
        else:
            total += 1
    return total


def _over(field: str, message: str, limit: str) -> RequestError:
    return RequestError(field, message, limit=limit)


def check_prompt(limits: RequestLimits, prompt: Any, max_model_len: int) -> None:
    """text_input characters, input_ids length (max_input_ids, or max_model_len when that is 0), messages count
    and size."""
    if isinstance(prompt, str):
        if len(prompt) > limits.max_prompt_chars:
            raise _over("text_input", f"text_input has {len(prompt)} characters; the limit (max_prompt_chars) is "
                        f"{limits.max_prompt_chars}", "max_prompt_chars")
        return
    if not isinstance(prompt, (list, tuple)) or not prompt:
        return  # the engine's tokenize names the problem
    if isinstance(prompt[0], dict):
        if len(prompt) > limits.max_messages:
            raise _over("messages", f"messages has {len(prompt)} messages; the limit (max_messages) is "
                        f"{limits.max_messages}", "max_messages")
        size = _chars(prompt)
        if size > limits.max_messages_chars:
            raise _over("messages", f"messages has {size} characters; the limit (max_messages_chars) is "
                        f"{limits.max_messages_chars}", "max_messages_chars")
    elif limits.max_input_ids and len(prompt) > limits.max_input_ids:
        raise _over("input_ids", f"input_ids has {len(prompt)} tokens; the limit (max_input_ids) is "
                    f"{limits.max_input_ids}", "max_input_ids")
    else:
        _check_room(len(prompt), max_model_len, "")


def _check_room(num_prompt_tokens: int, max_model_len: int, what: str) -> None:
    if num_prompt_tokens >= max_model_len:
        raise _over("prompt", f"prompt has {num_prompt_tokens} tokens{what}; max_model_len is {max_model_len}, "
                    "which must leave room for at least one new token", "max_model_len")


def check_params(limits: RequestLimits, params: SamplingParams, vocab_size: int) -> None:
    """Stop strings (count, length), stop_token_ids (count, within the vocabulary), logit_bias (count, ids within
    the vocabulary), logprobs and prompt_logprobs (top-n, also within the vocabulary)."""
    if len(params.stop) > limits.max_stop_strings:
        raise _over("stop", f"stop has {len(params.stop)} strings; the limit (max_stop_strings) is "
                    f"{limits.max_stop_strings}", "max_stop_strings")
    longest = max(params.stop, key=len, default="")
    if len(longest) > limits.max_stop_string_chars:
        raise _over("stop", f"stop has a string of {len(longest)} characters; the limit (max_stop_string_chars) "
                    f"is {limits.max_stop_string_chars}", "max_stop_string_chars")
    if len(params.stop_token_ids) > limits.max_stop_token_ids:
        raise _over("stop_token_ids", f"stop_token_ids has {len(params.stop_token_ids)} ids; the limit "
                    f"(max_stop_token_ids) is {limits.max_stop_token_ids}", "max_stop_token_ids")
    check_ids("stop_token_ids", params.stop_token_ids, vocab_size)
    if len(params.logit_bias) > limits.max_logit_bias:
        raise _over("logit_bias", f"logit_bias has {len(params.logit_bias)} entries; the limit (max_logit_bias) is "
                    f"{limits.max_logit_bias}", "max_logit_bias")
    beyond = [token for token in params.logit_bias if token >= vocab_size]
    if beyond:
        raise RequestError("logit_bias", f"logit_bias has token id {beyond[0]}, outside the vocabulary (size "
                           f"{vocab_size})")
    top_n = min(limits.max_logprobs, vocab_size)
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(params, name)
        if value is not None and value > top_n:
            raise _over(name, f"{name} must be in [0, {top_n}] (max_logprobs {limits.max_logprobs}, vocabulary "
                        f"{vocab_size}), got {value}", "max_logprobs")


def check_ids(field: str, ids: list[int], vocab_size: int) -> None:
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise RequestError(field, f"{field} contains token id {bad} outside the vocabulary [0, {vocab_size})")


def check_context(num_prompt_tokens: int, params: SamplingParams, max_model_len: int, what: str = "") -> None:
    """The prompt (``what`` says if a session's history is in it) must leave room for one new token, and for
    max_tokens when the client set it; an unset max_tokens is cut where max_model_len ends the request."""
    if num_prompt_tokens == 0:  # a text of control characters only can tokenize to nothing
        raise RequestError("prompt", f"the prompt{what} has no tokens: its text tokenizes to nothing")
    _check_room(num_prompt_tokens, max_model_len, what)
    if params.max_tokens_set and num_prompt_tokens + params.max_tokens > max_model_len:
        raise _over("max_tokens", f"max_tokens is {params.max_tokens}, but the prompt has {num_prompt_tokens} "
                    f"tokens{what} and max_model_len is {max_model_len}: at most {max_model_len - num_prompt_tokens} "
                    "new tokens fit; lower max_tokens or shorten the prompt", "max_model_len")


# ---------------------------------------------------------------------------------------------- sessions


def check_turn_fields(params: SamplingParams) -> None:
    """The fields a session turn cannot have."""
    if params.prompt_logprobs is not None:  # the history's positions are not computed again
        raise RequestError("prompt_logprobs", "prompt_logprobs is not available for a session turn (sequence_id); "
                           "send the whole prompt as a request of its own")


def check_session_room(sessions: SessionTable, max_sessions: int) -> None:
    """A new session beyond max_sessions is refused as busy (the caller closes idle ones first)."""
    if len(sessions) >= max_sessions:
        raise busy(f"server busy: {len(sessions)} sessions are open, the limit (max_sessions {max_sessions}); end "
                   "one or retry later", "max_sessions")
