"""Every failure as an OpenAI error: an HTTP status and {"error": {"message", "type", "param", "code"}}.

A gRPC stream carries only the model's error message, not its Triton code, so the model's own wording tells
them apart: a busy refusal starts with "server busy:" (README "Limits"), a shutdown says so, an internal failure
starts with "internal error" or is the engine's generic failure; everything else is the request's fault.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from backend_lib.core.sampling_params import SamplingParams
from backend_lib.frontend.openai.schema import ErrorBody, ErrorResponse

_BUSY_PREFIXES = ("server busy:", "the server is shutting down")
_SERVER_FAULT_PREFIXES = ("internal error", "the engine failed")
_LEADING_NAME = re.compile(r"^([a-z_]+)\b")


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
    """The Triton model's error message -> an OpenAIError with the right status.

    The engine's message starts with the field it refuses, which becomes ``param``; ``known_fields`` maps the
    engine's names to the ones the client used where they differ (e.g. logprobs -> top_logprobs)."""
    if message.startswith(_BUSY_PREFIXES):
        return OpenAIError(503, message, "server_busy", code="server_busy")
    if message.startswith(_SERVER_FAULT_PREFIXES):
        return OpenAIError(500, message, "server_error")
    match = _LEADING_NAME.match(message)
    name = match.group(1) if match else ""
    param = known_fields.get(name, name if name in SamplingParams.field_names() else None)
    return OpenAIError(400, message, "invalid_request_error", param)


def unreachable(detail: str) -> OpenAIError:
    return OpenAIError(503, f"the Triton server is not reachable: {detail}", "server_unavailable",
                       code="upstream_unavailable")
