"""Per-request state shared by the scheduler, the model runner and the engine. No torch here.

The one invariant (vLLM v1): ``num_computed_tokens`` catches up with ``len(all_token_ids)``. A step
feeds tokens ``all_token_ids[num_computed_tokens : num_computed_tokens + n]``; when that reaches the
last token the runner samples a new one. Prefill, chunked prefill, prefix-cache hits, preemption
(reset to 0) and session turns (start where the history's KV ends) are all cases of this rule.
"""
from __future__ import annotations

import enum
import time
from collections.abc import Container
from dataclasses import dataclass, field
from typing import Any

from backend_lib.core.errors import RequestError
from backend_lib.core.grammar import RequestGrammar
from backend_lib.core.sampling_params import SamplingParams


def check_unused(request_id: str, *live: Container[str]) -> None:
    """The one rule for request ids: none names a live request (in any of ``live``). The scheduler checks its own
    table; the engine checks first, before a session turn opens anything, and AsyncEngine its inbox and streams."""
    if any(request_id in ids for ids in live):
        raise RequestError("request_id", f"request id {request_id!r} is already in use")


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_GRAMMAR = "waiting_for_grammar"  # queued; its structured-output grammar is still compiling
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"

    @property
    def finished(self) -> bool:
        return self.value in ("stop", "length", "abort", "error")


@dataclass(frozen=True)
class PromptImage:
    """An image's span in a prompt: positions [start, start + num_tokens) carry the model's image token id and take
    their input embeddings from ``embeddings`` (the encoder's output, computed once before the request is queued:
    a chunk may cut the span, a preemption recomputes from it, and it is freed with the request)."""

    start: int
    num_tokens: int
    digest: str  # sha256 of the image bytes and the preprocessing settings
    embeddings: Any  # [num_tokens, hidden] tensor (core holds it, never reads it)


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    seed: int  # the request's own or one drawn by the engine: every sampled request is seeded
    eos_token_ids: frozenset[int] = frozenset()
    session_id: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0  # scheduling_policy "priority": lower runs earlier (core/priority.py)

    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache / session history
    block_ids: list[int] = field(default_factory=list)
    state_slot: int | None = None  # hybrid cache only (backend_lib/core/hybrid_kv.py): the request's fixed state
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    error: str | None = None  # why the request ended with FINISHED_ERROR
    refusal: RequestError | None = None  # FINISHED_ERROR before it ran, for its input (a grammar that does not compile)
    num_preemptions: int = 0
    # The session history this turn continues (prompt_token_ids starts with it); its KV may be reused.
    num_history_tokens: int = 0
    # Speculative decoding: proposals for the tokens after the last one, verified by the next step (never part of
    # all_token_ids until accepted).
    draft_token_ids: list[int] = field(default_factory=list)
    # prompt_logprobs: prompt tokens 1 .. this whose logprobs the engine holds (a recomputed prefill skips them).
    num_prompt_logprobs: int = 0
    # Structured output (backend_lib/core/grammar.py): the grammar's compile, then its matcher while running.
    grammar: RequestGrammar | None = None
    images: tuple[PromptImage, ...] = ()  # image spans of the prompt, in order

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.status.finished else None
