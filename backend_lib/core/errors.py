"""``RequestError``: the one typed refusal of a request, and its wire form across Triton.

Every layer that refuses a request raises it (core's SamplingParams and scheduler, the engine's intake and admission
control); the fronts map ``kind`` to their codes and never parse prose:

- ``invalid``: the request itself is wrong (Triton INVALID_ARG, OpenAI 400); ``field`` names the request field.
- ``busy``: the request may be fine but the server is at a limit on what it holds (UNAVAILABLE, 503: retry later);
  ``limit`` is the config name of that limit and the message starts with "server busy:".
- ``internal``: the server failed (INTERNAL, 500).

It is a ValueError whatever its kind: SamplingParams' refusals were ValueErrors for every caller (offline LLM, tests,
``pytest.raises(ValueError)``), and every handler of requests catches RequestError first and reads ``kind``, so a
busy refusal is never reported as the client's fault.

The wire form (``to_wire`` / ``from_wire``; the Triton model encodes, the OpenAI front decodes): a gRPC stream
carries only an error's message and Triton 2.51's HTTP /generate answers 400 whatever the code, so the kind and
field travel in the message, after the human-readable text: ``temperature must be >= 0, got -1
[deepinfer-error {"kind": "invalid", "field": "temperature"}]``.
"""
from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from typing import Any

_WIRE_MARK = " [deepinfer-error "


class ErrorKind(str, enum.Enum):
    INVALID = "invalid"
    BUSY = "busy"
    INTERNAL = "internal"


class RequestError(ValueError):
    """A request refused: ``field`` (the engine's name of the request field, None when no one field is at fault),
    ``message`` (what a client reads), ``kind``, and for busy (or a limit refusal) ``limit``, the config name."""

    def __init__(self, field: str | None, message: str, kind: ErrorKind = ErrorKind.INVALID,
                 limit: str | None = None) -> None:
        super().__init__(message)
        self.field = field
        self.message = message
        self.kind = ErrorKind(kind)
        self.limit = limit

    @property
    def busy(self) -> bool:
        return self.kind is ErrorKind.BUSY

    def __reduce__(self):  # pickling and copy keep the attributes (the default would call cls(message))
        return type(self), (self.field, self.message, self.kind, self.limit)


def busy(message: str, limit: str) -> RequestError:
    """A refusal at an admission limit; ``message`` must start with "server busy:" (what some clients only see)."""
    return RequestError(None, message, ErrorKind.BUSY, limit)


def internal(message: str) -> RequestError:
    return RequestError(None, message, ErrorKind.INTERNAL)


def to_wire(error: RequestError) -> str:
    """The message, then the structured detail a front decodes with ``from_wire``."""
    detail: dict[str, Any] = {"kind": error.kind.value}
    if error.field is not None:
        detail["field"] = error.field
    if error.limit is not None:
        detail["limit"] = error.limit
    return f"{error.message}{_WIRE_MARK}{json.dumps(detail)}]"


@dataclass(frozen=True)
class WireError:
    message: str  # the human-readable part
    kind: ErrorKind
    field: str | None = None
    limit: str | None = None


def from_wire(text: str) -> WireError:
    """A model error message -> its parts. A message without the detail (Triton's own errors: an unknown model, a
    malformed request it refused itself) is ``internal`` when it says so, else ``invalid`` with no field."""
    at = text.rfind(_WIRE_MARK)
    if at >= 0 and text.endswith("]"):
        try:
            detail = json.loads(text[at + len(_WIRE_MARK):-1])
            kind = ErrorKind(detail["kind"])
        except (ValueError, KeyError, TypeError):
            detail = None
        if isinstance(detail, dict):
            field, limit = detail.get("field"), detail.get("limit")
            return WireError(text[:at], kind, field if isinstance(field, str) else None,
                             limit if isinstance(limit, str) else None)
    kind = ErrorKind.INTERNAL if text.startswith("internal error") else ErrorKind.INVALID
    return WireError(text, kind)
