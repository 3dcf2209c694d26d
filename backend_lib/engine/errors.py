"""Exceptions that tell a caller how a refusal differs from bad input.

A ValueError means the request itself is wrong (INVALID_ARG: do not retry it as is). EngineBusyError means the
request may be fine but the engine is at a limit on what it holds (waiting requests, open sessions): the Triton
model answers UNAVAILABLE, which clients treat as "retry later". It is deliberately not a ValueError, so no
handler of bad input reports it as the client's fault.

Its message starts with "server busy:" and names the limit, because that is all some clients see: Triton 2.51's
/generate answers HTTP 400 for every model error whatever its code (measured: INVALID_ARG, INTERNAL and
UNAVAILABLE alike; newer Triton maps UNAVAILABLE to 503), and a gRPC stream carries only the message.
"""
from __future__ import annotations


class EngineBusyError(Exception):
    """Refused at admission: ``limit`` (a config name) is reached; the message names it and its value."""

    def __init__(self, message: str, limit: str) -> None:
        super().__init__(message)
        self.limit = limit
