"""Every failure as an OpenAI error: an HTTP status and {"error": {"message", "type", "param", "code"}}.

A model error arrives as its message only (a gRPC stream carries no Triton code); the Triton model puts the typed
refusal's kind and field after the text (core/errors.py ``to_wire``), which ``from_model_error`` decodes: invalid
-> 400 with ``param`` the client's name of the field, busy -> 503, internal -> 500. No prose is parsed.
"""
from __future__ import annotations

from dataclasses import dataclass

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


def unreachable(detail: str) -> OpenAIError:
    return OpenAIError(503, f"the Triton server is not reachable: {detail}", "server_unavailable",
                       code="upstream_unavailable")
