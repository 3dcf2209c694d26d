"""The only types that cross layers: scheduler -> runner -> scheduler -> engine -> caller."""
from __future__ import annotations

from dataclasses import dataclass, field

from backend_lib.request import Request


@dataclass
class ScheduledChunk:
    """One request's share of a step: tokens [start, start + num_tokens) of ``request.all_token_ids``."""

    request: Request
    start: int  # == request.num_computed_tokens when scheduled
    num_tokens: int
    block_ids: list[int]  # the request's block table after allocation for this chunk

    @property
    def samples(self) -> bool:
        """True when the chunk reaches the sequence's last token, so the runner samples a new one."""
        return self.start + self.num_tokens == self.request.num_tokens


@dataclass
class SchedulerOutput:
    # Decode chunks (one token, request already past its prompt) come first, then prefill chunks.
    chunks: list[ScheduledChunk]
    preempted_ids: list[str] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # the top-n (token id, logprob), best first


@dataclass
class RunnerOutput:
    """Aligned with ``SchedulerOutput.chunks``: empty lists for chunks that did not sample."""

    sampled_token_ids: list[list[int]]
    logprobs: list[list[TokenLogprob]] | None = None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class RequestOutput:
    """What a caller receives after a step: the delta since the previous output of the same request."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | "error" once finished
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int = 0
    cumulative_logprob: float = 0.0
    new_logprobs: list[TokenLogprob] | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string that ended the request
    error: str | None = None
    metrics: RequestMetrics | None = None


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_blocks_total: int
    kv_blocks_used: int
    prefix_cache_queries: int  # prompt tokens looked up in the prefix cache (cumulative)
    prefix_cache_hits: int  # of which found (cumulative)
    num_prompt_tokens: int  # cumulative
    num_generation_tokens: int  # cumulative
    num_computed_prompt_tokens: int  # prompt tokens actually run through the model (cumulative)
    num_preemptions: int
    num_sessions: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0

    @property
    def kv_blocks_free(self) -> int:
        return self.kv_blocks_total - self.kv_blocks_used

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0


@dataclass
class SessionControl:
    """Triton's sequence protocol for one request: correlation id plus START / END flags."""

    session_id: str
    start: bool = False
    end: bool = False
