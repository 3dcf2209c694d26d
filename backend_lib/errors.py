"""Exceptions that tell a caller how a refusal differs from bad input.

A ValueError means the request itself is wrong (INVALID_ARG: do not retry it as is). EngineBusyError means the
request may be fine but the engine is at a limit on what it holds (waiting requests, open sessions): the Triton
model answers UNAVAILABLE (HTTP 503), which clients treat as "retry later". It is deliberately not a ValueError,
so no handler of bad input reports it as the client's fault.
"""
from __future__ import annotations


class EngineBusyError(Exception):
    """Refused at admission: ``limit`` (a config name) is reached; the message names it and its value."""

    def __init__(self, message: str, limit: str) -> None:
        super().__init__(message)
        self.limit = limit
