"""Every failure as an OpenAI error: an HTTP status and {"error": {"message", "type", "param", "code"}}.

A model error arrives as its message only (a gRPC stream carries no Triton code); the Triton model puts the typed
refusal's kind and field after the text (core/errors.py ``to_wire``), which ``from_model_error`` decodes: invalid
-> 400 with ``param`` the client's name of the field, busy -> 503, internal -> 500. No prose is parsed.
"""
from __future__ import annotations

from dataclasses import dataclass

from backend_lib.core.errors import ErrorKind, from_wire
from backend_lib.frontend.openai.schema import ErrorBody, ErrorResponse


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
    param = known_fields.get(error.field, error.field) if error.field is not None else None
    return OpenAIError(400, error.message, "invalid_request_error", param)


def unreachable(detail: str) -> OpenAIError:
    return OpenAIError(503, f"the Triton server is not reachable: {detail}", "server_unavailable",
                       code="upstream_unavailable")
