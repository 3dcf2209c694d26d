"""Every failure as an OpenAI error: an HTTP status and {"error": {"message", "type", "param", "code"}}.

A model error arrives as its message only (a gRPC stream carries no Triton code); the Triton model puts the typed
refusal's kind and field after the text (core/errors.py ``to_wire``), which ``from_model_error`` decodes: invalid
-> 400 with ``param`` the client's name of the field, busy -> 503, internal -> 500. No prose is parsed. A body the
HTTP layer cannot read (``body_error``): not JSON -> 415, malformed JSON -> 400 naming the position, ``param`` null.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from backend_lib.core.errors import ErrorKind, from_wire
from backend_lib.frontend.openai.schema import ErrorBody, ErrorResponse


# The engine's names of request fields every call names otherwise (a request's own renames come with it).
_CLIENT_NAMES = {"text_input": "prompt", "input_ids": "prompt", "sequence_id": "X-Session-Id",
                 "sequence_start": "X-Session-Start", "sequence_end": "X-Session-End"}


@dataclass
class OpenAIError(Exception):
    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None

    def __str__(self) -> str:
        return self.message

    def body(self) -> dict:
        return ErrorResponse(error=ErrorBody(message=self.message, type=self.type, param=self.param,
                                             code=self.code)).model_dump()


def bad_request(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, "invalid_request_error", param)


def from_model_error(message: str, known_fields: dict[str, str]) -> OpenAIError:
    """The Triton model's error message -> an OpenAIError with the status of its kind; ``known_fields`` maps the
    engine's field names to the ones the client used where they differ (e.g. logprobs -> top_logprobs)."""
    error = from_wire(message)
    if error.kind is ErrorKind.BUSY:
        return OpenAIError(503, error.message, "server_busy", code="server_busy")
    if error.kind is ErrorKind.INTERNAL:
        return OpenAIError(500, error.message, "server_error")
    param = None if error.field is None else known_fields.get(error.field, _CLIENT_NAMES.get(error.field, error.field))
    return OpenAIError(400, error.message, "invalid_request_error", param)


def _is_json(content_type: str | None) -> bool:
    """FastAPI reads a body as JSON only under these media types (``application/json``, ``application/*+json``)."""
    media_type = (content_type or "").split(";")[0].strip().lower()
    return media_type == "application/json" or (media_type.startswith("application/") and
                                                 media_type.endswith("+json"))


def _json_kind(value: Any) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(value), "a number")


def body_error(errors: Sequence[Mapping[str, Any]], content_type: str | None) -> OpenAIError:
    """The request body's validation errors (FastAPI's, pydantic's layout) -> one OpenAI error: a body that is not
    JSON (415, the media type expected), not valid JSON (the position), not an object, or a field it refuses
    (``param`` its dotted place)."""
    first = errors[0] if errors else {"loc": (), "msg": "invalid request body"}
    in_body = tuple(first.get("loc", ()))[:1] == ("body",)
    if in_body and not _is_json(content_type):
        return OpenAIError(415, f"the request body must be JSON: send it with Content-Type: application/json "
                                f"(got {content_type or 'no Content-Type'})", "invalid_request_error",
                           code="unsupported_media_type")
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    if first.get("type") == "json_invalid":  # loc is ("body", the character where decoding failed)
        reason = (first.get("ctx") or {}).get("error", "invalid JSON")
        where = f" at character {loc[0]}" if loc else ""
        return bad_request(f"the request body is not valid JSON: {reason}{where}")
    if in_body and not loc:  # the body as a whole
        if first.get("type") == "missing":
            return bad_request("the request body is empty: send a JSON object")
        return bad_request(f"the request body must be a JSON object, got {_json_kind(first.get('input'))}")
    param = ".".join(loc) or None
    return bad_request(f"{param}: {first.get('msg')}" if param else str(first.get("msg")), param)


def unreachable(detail: str) -> OpenAIError:
    return OpenAIError(503, f"the Triton server is not reachable: {detail}", "server_unavailable",
                       code="upstream_unavailable")
