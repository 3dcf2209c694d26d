"""Continuous batching over a paged KV cache: token budget, chunked prefill, preemption, sessions. No torch.

A request's life (vLLM v1's one invariant: ``num_computed_tokens`` catches up with ``num_tokens``):
  1. ``add_request`` queues it (WAITING).
  2. ``schedule`` admits it (FCFS, or by priority: core/scheduling_policy.py) when its first chunk's blocks fit;
     prefix-cache hits (or a session's pinned blocks) start it at ``num_computed_tokens > 0``. Long prompts run in
     chunks.
  3. Each step: decodes first (1 token each, never starved), then prefill chunks, then admissions.
  4. ``update_from_output`` advances ``num_computed_tokens``, appends sampled tokens, hashes newly full
     blocks, checks stops; finished requests give their blocks back (a session turn pins them instead).
  5. Out of blocks: idle sessions' blocks go first (LRU), then the newest running request (by priority: the
     lowest-priority one) is preempted (blocks freed, ``num_computed_tokens = 0``, front of the queue) and
     recomputed later.

Hybrid cache (``num_state_slots`` > 0, ``backend_lib/core/hybrid_kv.py``): a request also holds a fixed state slot
(``request.state_slot``) from admission to release; a session keeps its slot with its blocks between turns.

Speculative decoding: a decode request with drafts (``request.draft_token_ids``, set from the runner's proposals)
is scheduled with ``1 + k`` tokens; its blocks also cover ``num_lookahead_slots`` positions past them (the MTP
proposer writes its draft chain there). After verification ``num_computed_tokens`` stops at the last accepted token
(the rejected positions roll back: their KV is simply overwritten later) and only those computed tokens are hashed
into the prefix cache.

Structured output (``request.grammar``, backend_lib/core/grammar.py): a request whose grammar still compiles waits
in WAITING_FOR_GRAMMAR and admission passes over it (the others run); one whose compile failed or timed out is failed
before any step (``refusal``: a RequestError naming the request field). Admission builds the matcher (a request back
from preemption re-accepts its output); every emitted token advances it, a terminated matcher finishes the request
("stop"), drafts are cut at the first token the grammar refuses, and finish / abort / preemption release it.
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future

from backend_lib.core.config import CacheConfig, SchedulerConfig
from backend_lib.core.errors import RequestError
from backend_lib.core.hybrid_kv import HybridKVManager
from backend_lib.core.kv_cache import KVCacheManager
from backend_lib.core.outputs import RunnerOutput, ScheduledChunk, SchedulerOutput
from backend_lib.core.request import Request, RequestStatus, check_unused
from backend_lib.core.scheduling_policy import scheduling_order
from backend_lib.core.sessions import SessionTable
from backend_lib.core.spec_counters import SpecCounters

_KEEPS_SESSION = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH)


class Scheduler:
    """Counters (cumulative, see ``stats_counters``): ``num_preemptions``, ``num_prompt_tokens`` (added),
    ``num_generation_tokens`` (sampled), ``num_computed_prompt_tokens`` (prompt tokens fed to the model,
    recomputation included), ``num_session_evictions``; prefix-cache counters live on ``kv_cache``."""

    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig, num_blocks: int,
                 max_model_len: int, clock: Callable[[], float] = time.monotonic,
                 num_lookahead_slots: int = 0, num_state_slots: int = 0) -> None:
        if max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {max_model_len}")
        self.config = scheduler_config
        self.max_model_len = max_model_len
        self.block_size = cache_config.block_size
        # num_state_slots > 0: the model keeps fixed per-request state next to its blocks (core/hybrid_kv.py)
        self.kv_cache = (HybridKVManager(num_blocks, cache_config.block_size, num_state_slots) if num_state_slots
                         else KVCacheManager(num_blocks, cache_config.block_size, cache_config.enable_prefix_caching))
        # Every running request must always get its decode token, so seats never exceed the token budget.
        self.max_num_seqs = min(scheduler_config.max_num_seqs, scheduler_config.max_num_batched_tokens)
        self._clock = clock
        self._order = scheduling_order(scheduler_config)  # fcfs or priority (core/scheduling_policy.py)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order: the last one is the newest
        self._requests: dict[str, Request] = {}
        self.sessions = SessionTable(self.kv_cache, clock)
        self._finished_in_schedule: list[Request] = []  # errors found by schedule(), reported by the next update
        self.num_preemptions = 0
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.num_computed_prompt_tokens = 0
        if num_lookahead_slots < 0:
            raise ValueError(f"num_lookahead_slots must be >= 0, got {num_lookahead_slots}")
        self.num_lookahead_slots = num_lookahead_slots
        self.spec = SpecCounters()

    # ---- requests -------------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        rid = request.request_id
        check_unused(rid, self._requests)
        if request.status is not RequestStatus.WAITING or request.num_computed_tokens or request.block_ids:
            raise ValueError(f"request {rid!r} must be new (WAITING, no computed tokens, no blocks)")
        if not request.prompt_token_ids:
            raise ValueError(f"request {rid!r} has an empty prompt")
        if request.num_tokens >= self.max_model_len:
            raise ValueError(f"request {rid!r} has {request.num_tokens} tokens; max_model_len is "
                             f"{self.max_model_len}, so at most {self.max_model_len - 1} fit with one new token")
        if request.session_id is not None:
            self.sessions.check_turn(request.session_id)
            self.sessions.begin_turn(request.session_id, rid)
        if request.grammar is not None:  # until schedule() sees its compile done (and fails it if it failed)
            request.status = RequestStatus.WAITING_FOR_GRAMMAR
        self._requests[rid] = request
        self.waiting.append(request)
        self.num_prompt_tokens += request.num_prompt_tokens

    def abort_request(self, request_id: str) -> Request | None:
        """Abort a waiting, running or preempted request; None if it is unknown or already finished."""
        return self.finish_request(request_id, RequestStatus.FINISHED_ABORTED)

    def finish_request(self, request_id: str, status: RequestStatus,
                       stop_reason: int | str | None = None) -> Request | None:
        """End a live request from outside (stop strings, aborts); its blocks are released."""
        if not status.finished:
            raise ValueError(f"finish_request needs a finished status, got {status}")
        request = self._requests.get(request_id)
        if request is None:
            return None
        request.status = status
        if stop_reason is not None:
            request.stop_reason = stop_reason
        self._remove_from_queues(request)
        self._release(request)
        return request

    def get_request(self, request_id: str) -> Request | None:
        return self._requests.get(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests) or bool(self._finished_in_schedule)

    def pending_grammars(self) -> list[Future]:
        """The compiles that waiting requests wait for (the engine waits on them when nothing else can run)."""
        return [r.grammar.future for r in self.waiting
                if r.status is RequestStatus.WAITING_FOR_GRAMMAR and r.grammar is not None]

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # ---- the step -------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        self._resolve_grammars()
        budget = self.config.max_num_batched_tokens
        decodes: list[ScheduledChunk] = []
        prefills: list[ScheduledChunk] = []
        scheduled: set[str] = set()
        preempted: list[str] = []
        running = self._order.reserve_order(self.running, self._clock())
        for decode_pass in (True, False):
            for request in running:
                if request.status is not RequestStatus.RUNNING or request.request_id in scheduled:
                    continue  # preempted earlier in this step
                if self._is_decode(request) != decode_pass:
                    continue
                n = min(request.num_tokens - request.num_computed_tokens, budget)
                drafts = self._drafts(request, budget - n) if decode_pass else []
                if n <= 0 or not self._reserve(request, n + len(drafts), scheduled, preempted):
                    continue
                n += len(drafts)
                (decodes if decode_pass else prefills).append(self._chunk(request, n, drafts))
                scheduled.add(request.request_id)
                budget -= n
        # After a preemption the pool is short: admitting now would only be preempted again (vLLM v1 rule).
        while not preempted and budget > 0 and len(self.running) < self.max_num_seqs:
            head = self._order.next_to_admit(
                (r for r in self.waiting if r.status is not RequestStatus.WAITING_FOR_GRAMMAR), self._clock())
            if head is None:
                break
            n = self._admit(head, budget)
            if n is None:
                break  # nobody overtakes the head of the queue (but a request still compiling its grammar)
            if n == 0:
                continue  # the head could never run and was failed; look at the next one
            request = self.running[-1]
            (decodes if self._is_decode(request) and n == 1 else prefills).append(self._chunk(request, n))
            scheduled.add(request.request_id)
            budget -= n
        return SchedulerOutput(chunks=decodes + prefills, preempted_ids=preempted)

    def update_from_output(self, scheduler_output: SchedulerOutput, runner_output: RunnerOutput) -> list[Request]:
        """Apply a step's results; returns the requests that got tokens or finished (schedule()'s errors too)."""
        chunks = scheduler_output.chunks
        if len(runner_output.sampled_token_ids) != len(chunks):
            raise ValueError(f"runner returned {len(runner_output.sampled_token_ids)} sampled lists for "
                             f"{len(chunks)} scheduled chunks")
        proposals = runner_output.draft_token_ids
        if proposals is not None and len(proposals) != len(chunks):
            raise ValueError(f"runner returned {len(proposals)} draft lists for {len(chunks)} scheduled chunks")
        changed, self._finished_in_schedule = self._finished_in_schedule, []
        for i, (chunk, sampled) in enumerate(zip(chunks, runner_output.sampled_token_ids)):
            request = chunk.request
            if request.status is not RequestStatus.RUNNING:
                continue  # finished from outside since schedule()
            if chunk.start != request.num_computed_tokens:
                raise ValueError(f"chunk of request {request.request_id!r} starts at {chunk.start}, but "
                                 f"{request.num_computed_tokens} tokens are computed")
            if chunk.samples and not sampled:
                raise ValueError(f"runner sampled nothing for request {request.request_id!r}, whose chunk "
                                 f"reaches its last token")
            num_drafts = chunk.num_draft_tokens
            if len(sampled) > num_drafts + 1:
                raise ValueError(f"runner returned {len(sampled)} tokens for request {request.request_id!r}, which "
                                 f"had {num_drafts} drafts (at most {num_drafts + 1})")
            # Rejected drafts roll back: only the accepted ones (len(sampled) - 1) count as computed.
            accepted = max(0, len(sampled) - 1) if num_drafts else 0
            end = chunk.start + chunk.num_tokens - num_drafts + accepted
            self.spec.record(num_drafts, accepted)
            self.num_computed_prompt_tokens += max(0, min(end, request.num_prompt_tokens) - chunk.start)
            for token in sampled:
                request.output_token_ids.append(token)
                self.num_generation_tokens += 1
                if self._advance_grammar(request, token) or self._check_stop(request, token):
                    break
            # A stop among the accepted drafts drops the tokens after it: their KV is no longer the request's.
            request.num_computed_tokens = min(end, request.num_tokens - 1) if sampled else end
            self.kv_cache.cache_blocks(request, request.num_computed_tokens)
            request.draft_token_ids = list(proposals[i]) if proposals is not None and sampled else []
            if proposals is not None and sampled and request.sampling_params.speculative:
                self.spec.record_choice(len(request.draft_token_ids))
            if request.is_finished:
                self._remove_from_queues(request)
                self._release(request)
            if sampled or request.is_finished:
                changed.append(request)
        return changed

    @staticmethod
    def _advance_grammar(request: Request, token: int) -> bool:
        """The matcher takes the emitted token; True when that ends the request (the grammar terminated: "stop")."""
        outcome = request.grammar.advance(token) if request.grammar is not None else None
        if outcome == "terminated":
            request.status, request.stop_reason = RequestStatus.FINISHED_STOPPED, token
        elif outcome == "refused":  # the mask forbade it: a bug, not the client's fault
            request.status = RequestStatus.FINISHED_ERROR
            request.error = f"internal error: the grammar refused token {token}, which its mask allowed"
        return outcome is not None

    def _check_stop(self, request: Request, token: int) -> bool:
        params = request.sampling_params
        if request.num_output_tokens >= params.min_tokens and (
                token in params.stop_token_ids or (not params.ignore_eos and token in request.eos_token_ids)):
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = token
            return True
        if request.num_output_tokens >= params.max_tokens or request.num_tokens >= self.max_model_len:
            request.status = RequestStatus.FINISHED_LENGTH
            return True
        return False

    @staticmethod
    def _is_decode(request: Request) -> bool:
        return (request.num_computed_tokens >= request.num_prompt_tokens
                and request.num_tokens - request.num_computed_tokens == 1)

    @staticmethod
    def _chunk(request: Request, n: int, drafts: list[int] | None = None) -> ScheduledChunk:
        return ScheduledChunk(request=request, start=request.num_computed_tokens, num_tokens=n,
                              block_ids=list(request.block_ids), draft_token_ids=list(drafts or []),
                              state_slot=request.state_slot)

    def _drafts(self, request: Request, room: int) -> list[int]:
        """The request's drafts that can still matter: within the step's remaining budget, max_model_len and
        max_tokens (one token after the drafts is always emitted)."""
        if not request.draft_token_ids or not request.sampling_params.speculative:
            return []
        limit = min(room, self.max_model_len - request.num_tokens - 1,
                    request.sampling_params.max_tokens - request.num_output_tokens - 1)
        drafts = request.draft_token_ids[:max(0, limit)]
        return request.grammar.cut(drafts) if request.grammar is not None else drafts

    def _lookahead(self, request: Request) -> int:
        return self.num_lookahead_slots if request.sampling_params.speculative else 0

    # ---- blocks for running requests ------------------------------------------------------------
    def _reserve(self, request: Request, n: int, scheduled: set[str], preempted: list[str]) -> bool:
        """Find blocks for ``n`` more tokens of a running request: evict session KV, then preempt the newest
        request not yet scheduled this step. False when the request itself was preempted or failed."""
        n += self._lookahead(request)
        while not self.kv_cache.can_append(request, n):
            if self.sessions.evict_kv():
                continue
            victim = self._order.victim([r for r in self.running if r.request_id not in scheduled], self._clock())
            if victim is request and len(self.running) == 1:
                # Every block not free is its own: the pool is too small for this request.
                self._fail(request, f"needs {self.kv_cache.blocks_needed(request.num_computed_tokens + n)} KV "
                                    f"blocks of {self.block_size} tokens; the pool has {self.kv_cache.num_blocks}")
                return False
            self._preempt(victim, preempted)
            if victim is request:
                return False
        self.kv_cache.append_slots(request, n)
        return True

    def _preempt(self, request: Request, preempted: list[str]) -> None:
        self.running = [r for r in self.running if r is not request]
        self.kv_cache.free(request)
        if request.grammar is not None:  # rebuilt at re-admission from the output so far
            request.grammar.release()
        request.draft_token_ids = []
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
        preempted.append(request.request_id)

    def _fail(self, request: Request, message: str) -> None:
        request.status = RequestStatus.FINISHED_ERROR
        request.error = message
        self._remove_from_queues(request)
        self._release(request)
        self._finished_in_schedule.append(request)

    # ---- admission ------------------------------------------------------------------------------
    def _resolve_grammars(self) -> None:
        """Requests whose grammar is done compiling: ready for admission, or failed before any step."""
        for request in [r for r in self.waiting if r.status is RequestStatus.WAITING_FOR_GRAMMAR]:
            if not request.grammar.ready:
                continue  # still compiling: others run meanwhile
            failure = request.grammar.failure()
            if failure is None:
                request.status = RequestStatus.WAITING
            else:
                message, refused = failure
                if refused:  # the request's constraint is at fault: INVALID_ARG naming its field
                    request.refusal = RequestError(request.grammar.constraint.field.split(".", 1)[0], message)
                self._fail(request, message)

    def _admit(self, request: Request, budget: int) -> int | None:
        """Try to start the head of the queue. Returns its first chunk's size, None when it does not fit now,
        0 when it can never run (it is then failed)."""
        limit = self._never_fits(request)
        if limit is not None:
            self._fail(request, limit)
            return 0
        session = self.sessions.get(request.session_id)
        if session is not None and session.block_ids and not self.sessions.kv_usable(session, request):
            self.sessions.drop_kv(session)
        exclude = session.session_id if session is not None else None
        if session is not None and session.block_ids:
            computed = session.num_computed_tokens
            n = self._first_chunk(request.num_tokens - computed, budget)
            if n is None:
                return None
            extra = self._lookahead(request)
            needed = self.kv_cache.blocks_needed(computed + n + extra) - len(session.block_ids)
            while needed > self.kv_cache.num_free_blocks:
                if not self.sessions.evict_kv(exclude=exclude):
                    return None
            request.block_ids, session.block_ids = session.block_ids, []
            request.state_slot, session.state_slot = session.state_slot, None
            session.num_computed_tokens = 0
            request.num_computed_tokens = computed
            self.kv_cache.append_slots(request, n + extra)
        else:
            computed_blocks, computed = self.kv_cache.get_computed_blocks(request)
            n = self._first_chunk(request.num_tokens - computed, budget)
            if n is None:
                return None
            extra = self._lookahead(request)
            while not self.kv_cache.can_allocate(request, n + extra, computed_blocks):
                if not self.sessions.evict_kv(exclude=exclude):
                    return None
            self.kv_cache.allocate(request, n + extra, computed_blocks)
            request.num_computed_tokens = computed
        if request.status is RequestStatus.WAITING:  # first admission, not a return from preemption
            request.num_cached_tokens = computed
        request.status = RequestStatus.RUNNING
        if self.waiting[0] is request:
            self.waiting.popleft()
        else:  # it passed requests still compiling their grammars
            self.waiting = deque(r for r in self.waiting if r is not request)
        self.running.append(request)
        if request.grammar is not None and request.grammar.matcher is None:
            try:
                request.grammar.start(request.output_token_ids)
            except RuntimeError as exc:
                self._fail(request, f"internal error: {exc}")
                return 0
        return n

    def _first_chunk(self, remaining: int, budget: int) -> int | None:
        if self.config.enable_chunked_prefill:
            return min(remaining, budget)
        return remaining if remaining <= budget else None

    def _never_fits(self, request: Request) -> str | None:
        need = self.kv_cache.blocks_needed(request.num_tokens)
        if need > self.kv_cache.num_blocks:
            return (f"needs {need} KV blocks of {self.block_size} tokens for its {request.num_tokens} tokens; "
                    f"the pool has {self.kv_cache.num_blocks}")
        if not self.config.enable_chunked_prefill and request.num_tokens > self.config.max_num_batched_tokens:
            return (f"has {request.num_tokens} tokens to prefill but max_num_batched_tokens is "
                    f"{self.config.max_num_batched_tokens} and chunked prefill is off")
        return None

    # ---- release --------------------------------------------------------------------------------
    def _remove_from_queues(self, request: Request) -> None:
        # Identity, not ==: Request is a dataclass whose equality compares every field.
        if any(r is request for r in self.running):
            self.running = [r for r in self.running if r is not request]
        elif any(r is request for r in self.waiting):
            self.waiting = deque(r for r in self.waiting if r is not request)

    def _release(self, request: Request) -> None:
        """A finished request's blocks go back to the pool, or to its session when the turn completed."""
        self._requests.pop(request.request_id, None)
        if request.grammar is not None:
            request.grammar.release()
        session = self.sessions.get(request.session_id)
        if session is None or session.turn_request_id != request.request_id:
            self.kv_cache.free(request)
            return
        session.turn_request_id = None
        session.last_used = self._clock()
        if request.status in _KEEPS_SESSION:
            self.sessions.drop_kv(session)  # only non-empty if the turn never took the blocks over
            slot, request.state_slot = request.state_slot, None
            blocks = self.kv_cache.detach(request)
            session.token_ids = request.all_token_ids
            session.images = request.images  # the history's image spans, with it
            self.sessions.store_kv(session, blocks, request.num_computed_tokens, slot)
        elif session.block_ids:  # aborted before admission: the session still has its previous state
            self.kv_cache.free(request)
        else:
            # Aborted after taking the session's blocks: keep what still holds the previous history's KV.
            history = len(session.token_ids)
            valid = min(history, request.num_computed_tokens) \
                if request.prompt_token_ids[:history] == session.token_ids else 0
            if request.state_slot is not None and valid != request.num_computed_tokens:
                self.kv_cache.free(request)  # fixed state cannot rewind to the history's end: recompute it
                valid = 0
            slot, request.state_slot = request.state_slot, None
            self.sessions.store_kv(session, self.kv_cache.detach(request), valid, slot)
        if session.closing:
            self.sessions.remove(session)

    # ---- sessions (backend_lib/core/sessions.py) ----------------------------------------------------------
    def open_session(self, session_id: str) -> None:
        self.sessions.open(session_id)

    def close_session(self, session_id: str) -> None:
        """Free the session's KV. With a turn in flight, the session closes when that turn ends."""
        self.sessions.close(session_id)

    def has_session(self, session_id: str) -> bool:
        return self.sessions.get(session_id) is not None

    def session_busy(self, session_id: str) -> bool:
        return self.sessions.busy(session_id)

    def session_history(self, session_id: str) -> list[int]:
        return self.sessions.history(session_id)

    def session_num_cached_tokens(self, session_id: str) -> int:
        return self.sessions.num_cached_tokens(session_id)

    @property
    def num_sessions(self) -> int:
        return len(self.sessions)

    @property
    def num_session_evictions(self) -> int:
        return self.sessions.num_evictions

    def close_idle_sessions(self, now: float, idle_timeout_s: float) -> list[str]:
        return self.sessions.close_idle(now, idle_timeout_s)

    # ---- introspection --------------------------------------------------------------------------
    def stats_counters(self) -> dict[str, int | list[int]]:
        """The EngineStats fields the scheduler owns (the engine adds running/waiting/total/sessions)."""
        return dict(kv_blocks_used=self.kv_cache.num_used_blocks,
                    prefix_cache_queries=self.kv_cache.prefix_cache_queries,
                    prefix_cache_hits=self.kv_cache.prefix_cache_hits,
                    num_prompt_tokens=self.num_prompt_tokens,
                    num_generation_tokens=self.num_generation_tokens,
                    num_computed_prompt_tokens=self.num_computed_prompt_tokens,
                    num_preemptions=self.num_preemptions,
                    spec_num_drafts=self.spec.num_drafts,
                    spec_draft_tokens=self.spec.draft_tokens,
                    spec_accepted_tokens=self.spec.accepted_tokens,
                    spec_drafts_per_position=list(self.spec.drafts_per_position),
                    spec_accepted_per_position=list(self.spec.accepted_per_position),
                    spec_chosen_lengths=list(self.spec.chosen_lengths))

    def check_integrity(self) -> None:
        """Every block is held exactly as often as its ref count says (running requests and sessions are
        the only holders) and the pool agrees with itself; raises AssertionError otherwise."""
        for request in self.waiting:
            assert not request.block_ids, f"waiting request {request.request_id!r} holds blocks {request.block_ids}"
            assert request.status in (RequestStatus.WAITING, RequestStatus.WAITING_FOR_GRAMMAR,
                                      RequestStatus.PREEMPTED), \
                f"waiting request {request.request_id!r} has status {request.status}"
            assert request.grammar is None or request.grammar.matcher is None, \
                f"waiting request {request.request_id!r} holds a grammar matcher"
        for request in self.running:
            assert request.status is RequestStatus.RUNNING, \
                f"running request {request.request_id!r} has status {request.status}"
            assert request.grammar is None or request.grammar.matcher is not None, \
                f"running request {request.request_id!r} has no grammar matcher"
        holders = [r.block_ids for r in self.running] + self.sessions.held_blocks()
        if isinstance(self.kv_cache, HybridKVManager):
            for request in self.waiting:
                assert request.state_slot is None, \
                    f"waiting request {request.request_id!r} holds state slot {request.state_slot}"
            slots = [r.state_slot for r in self.running] + self.sessions.held_state_slots()
            assert None not in slots, "a running request has no state slot"
            self.kv_cache.check_integrity(holders, slots)
        else:
            self.kv_cache.check_integrity(holders)
