"""The only types that cross layers: scheduler -> runner -> scheduler -> engine -> caller."""
from __future__ import annotations

from dataclasses import dataclass, field

from backend_lib.core.errors import RequestError
from backend_lib.core.request import Request


@dataclass
class ScheduledChunk:
    """One request's share of a step: tokens [start, start + num_tokens) of ``request.all_token_ids`` followed by
    ``draft_token_ids`` (speculative decoding: ``num_tokens`` counts them; the runner verifies them)."""

    request: Request
    start: int  # == request.num_computed_tokens when scheduled
    num_tokens: int  # drafts included
    block_ids: list[int]  # the request's block table after allocation for this chunk (lookahead slots included)
    draft_token_ids: list[int] = field(default_factory=list)
    state_slot: int | None = None  # the request's fixed state slot (hybrid cache models only)

    @property
    def num_draft_tokens(self) -> int:
        return len(self.draft_token_ids)

    @property
    def samples(self) -> bool:
        """True when the chunk reaches the sequence's last token, so the runner samples (or verifies) new ones."""
        return self.start + self.num_tokens - self.num_draft_tokens == self.request.num_tokens


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
class PromptLogprobs:
    """A prompt's logprobs (SamplingParams.prompt_logprobs): nothing predicts its first token, so that has none."""

    first_token_id: int
    entries: list[TokenLogprob]  # prompt tokens 1 .. n-1 in order, each with its top-n


@dataclass
class RunnerOutput:
    """Aligned with ``SchedulerOutput.chunks``: empty lists for chunks that did not sample. A chunk with drafts gets
    its accepted drafts followed by the recovered or bonus token (so ``len - 1`` drafts were accepted)."""

    sampled_token_ids: list[list[int]]
    logprobs: list[list[TokenLogprob]] | None = None
    # Proposals for each sampling chunk's next step (speculative decoding); None when the runner proposes nothing.
    draft_token_ids: list[list[int]] | None = None
    # Per chunk, the logprobs of the prompt tokens it predicts (prompt_logprobs requests), in prompt order.
    prompt_logprobs: list[list[TokenLogprob]] | None = None


@dataclass
class RequestMetrics:
    arrival_time: float
    priority: int = 0  # the request's scheduling priority (lower runs earlier)
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
    prompt_logprobs: PromptLogprobs | None = None  # on a prompt_logprobs request's first output with tokens
    stop_reason: int | str | None = None  # the stop token id or stop string that ended the request
    error: str | None = None
    # Ended before it ran because the engine refused it when it took it in (a session protocol error, max_sessions):
    # the typed refusal, whose kind says whose fault it is.
    refusal: RequestError | None = None
    metrics: RequestMetrics | None = None

    @property
    def rejected(self) -> bool:
        return self.refusal is not None

    @property
    def busy(self) -> bool:
        """Refused at an admission limit, not for its input: retry later."""
        return self.refusal is not None and self.refusal.busy


@dataclass(frozen=True)
class EplbStats:
    """Expert-parallel load balancing, as the driver measured it (worker/eplb.py)."""

    # per MoE layer (module order): the window's busiest rank's tokens / the mean under the current placement
    layer_imbalance: list[float]
    rebalances: int  # re-placements done (cumulative)
    last_pause_s: float  # the last re-placement's pause between two steps (placement + weight moves)
    moved_slots: int  # slots whose expert changed (cumulative, over the ranks)

    @property
    def worst_imbalance(self) -> float:
        return max(self.layer_imbalance, default=1.0)


@dataclass(frozen=True)
class SpecSurvivalStats:
    """DSpark's survival calibration (cumulative, worker/spec_decode/block_stats.py): per draft position j, over the
    drafts verified there, the mean survival the confidence head predicted and the share accepted (empty until the
    first verification)."""

    predicted: list[float]
    observed: list[float]


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
    spec_draft_tokens: int = 0  # drafts verified (cumulative)
    spec_accepted_tokens: int = 0  # of which accepted (cumulative)
    spec_num_drafts: int = 0  # verifications of at least one draft, i.e. request-steps with drafts (cumulative)
    # Per draft position j (0-based): drafts verified there, and accepted there (cumulative).
    spec_drafts_per_position: list[int] = field(default_factory=list)
    spec_accepted_per_position: list[int] = field(default_factory=list)
    # Index L: request-steps whose proposer chose L drafts for the next step, 0 included (cumulative).
    spec_chosen_lengths: list[int] = field(default_factory=list)
    # Admission refusals (AsyncEngine, cumulative): past max_waiting_requests, and session STARTs past max_sessions.
    num_refused_waiting: int = 0
    num_refused_sessions: int = 0
    eplb: EplbStats | None = None  # None: enable_eplb off
    spec_survival: SpecSurvivalStats | None = None  # None: no block drafter (DFlash: empty, it has no head)

    @property
    def spec_acceptance_rate(self) -> float:
        return self.spec_accepted_tokens / self.spec_draft_tokens if self.spec_draft_tokens else 0.0

    @property
    def spec_acceptance_rate_per_position(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.spec_accepted_per_position, self.spec_drafts_per_position)]

    @property
    def spec_mean_accepted_length(self) -> float:
        """Tokens emitted per verification step: accepted drafts + the recovered / bonus token (vLLM's definition)."""
        return 1.0 + self.spec_accepted_tokens / self.spec_num_drafts if self.spec_num_drafts else 0.0

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
