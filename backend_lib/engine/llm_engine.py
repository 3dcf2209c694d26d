"""LLMEngine (add_request / abort / step) and the per-request text state around it.

A step is: schedule -> run (prepare, forward, sample) -> update the scheduler -> detokenize and check stop
strings -> RequestOutputs. AsyncEngine (async_engine.py) runs this loop on a thread; LLM (offline.py) drives
it synchronously.

Structured output: a request whose ``SamplingParams.structured_outputs`` holds a constraint submits its grammar to
the engine's ``GrammarCompiler`` (built on first use, at the model's logits width) when it is prepared, so the
compile runs on the compiler's threads while the request queues; the scheduler takes it from there
(backend_lib/core/grammar.py).
"""
from __future__ import annotations

import logging
import random
import threading
import time
from concurrent.futures import FIRST_COMPLETED
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field
from functools import partial

import torch

from backend_lib.core.config import EngineConfig
from backend_lib.core.errors import RequestError
from backend_lib.core.grammar import RequestGrammar
from backend_lib.core.outputs import (EngineStats, PromptLogprobs, RequestMetrics, RequestOutput, RunnerOutput,
                                      SchedulerOutput, SessionControl, TokenLogprob)
from backend_lib.core.request import PromptImage, Request, RequestStatus, check_unused
from backend_lib.core.sampling_params import SEED_LIMIT, SamplingParams
from backend_lib.core.async_scheduler import AsyncScheduler
from backend_lib.core.scheduler import Scheduler
from backend_lib.engine.detokenizer import IncrementalDetokenizer, StopStringMatcher
from backend_lib.engine.images import image_prompts_for
from backend_lib.engine.overlap import DeviceThread, InFlight, continued_rows
from backend_lib.engine.intake import (IntakeRequest, Prompt, RequestRules, check_context, check_ids,
                                       check_session_room, take_in)
from backend_lib.engine.tokenizer import Tokenizer
from backend_lib.core.model_path import resolve_model_path
from backend_lib.structured_output.grammar_compiler import GrammarCompiler
from backend_lib.structured_output.matcher import GrammarMatcher
from backend_lib.worker.executor.executor import Executor
from backend_lib.worker.executor.rank import DTYPES

log = logging.getLogger("deepinfer.engine")

# With nothing to run but requests whose grammars compile, a step waits this long for one of them (not a busy loop).
GRAMMAR_WAIT_S = 0.01


def _ends_on_stop_token(request: Request) -> bool:
    """The request ended on a stop token (EOS, one of stop_token_ids, the token its grammar ended on): the
    scheduler's stop_reason is then that token's id (a stop string's, set later by the engine, is the string)."""
    return request.status is RequestStatus.FINISHED_STOPPED and isinstance(request.stop_reason, int)


@dataclass
class _TextState:
    """What the engine keeps per live request besides the scheduler's Request."""

    request: Request
    detokenizer: IncrementalDetokenizer
    stops: StopStringMatcher
    metrics: RequestMetrics
    session: SessionControl | None = None
    text_turn: bool = True  # a session turn whose prompt extends the session's token history
    cumulative_logprob: float = 0.0
    num_emitted_tokens: int = 0
    text: list[str] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # until the first output with tokens


@dataclass
class PreparedRequest:
    """A request that is not a session turn, tokenized and checked (LLMEngine.prepare_request)."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)  # when it came in, not when a step took it
    priority: int = 0  # scheduling_policy "priority": lower runs earlier
    grammar: RequestGrammar | None = None  # structured output: its grammar, compiling since preparation
    images: tuple[PromptImage, ...] = ()  # image spans, encoded (engine/images.py)


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None) -> None:
        self.config = config = config or EngineConfig()
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.device = torch.device(config.model.device)
        self.dtype = DTYPES[config.model.dtype]
        self.tokenizer = Tokenizer.load(resolve_model_path(config.model.model))
        self.executor = Executor(config)
        self.model, self.runner = self.executor.model, self.executor.runner
        self.vocab_size = self.model.arch.vocab_size
        self.image_prompts = image_prompts_for(self.model, config)  # None: no images
        self.rules = RequestRules(config.limits, self.vocab_size, config.model.max_model_len,
                                  images=self.image_prompts is not None)
        num_blocks = self.executor.num_blocks
        # Zero-overhead scheduling (engine/overlap.py) for steps without drafts: with a proposer every step may
        # verify drafts, whose acceptance decides where the next step starts. A hybrid cache's fixed state
        # (DeepSeek-V4) would take the step after a request's end in place (a session keeps that state). Those
        # engines step in turn.
        why_not = (f"spec method {self.runner.spec_method!r} verifies drafts every step"
                   if self.runner.spec_method != "none" else
                   "the hybrid cache's fixed state advances in place" if self.executor.num_state_slots else None)
        overlap = config.scheduler.async_scheduling and why_not is None
        if config.scheduler.async_scheduling and not overlap:
            log.info("async_scheduling: %s; steps run one after the other", why_not)
        self.scheduler = (AsyncScheduler if overlap else Scheduler)(
            config.scheduler, config.cache, num_blocks, config.model.max_model_len,
            num_lookahead_slots=self.runner.num_lookahead_slots, num_state_slots=self.executor.num_state_slots)
        self._device = DeviceThread() if overlap else None
        if self.executor.num_state_slots and config.cache.enable_prefix_caching:
            log.info("prefix caching is off for this model: its hybrid KV cache keeps per-request state (sliding "
                     "window, open compressor windows) that is valid only at the position its request reached")
        self.num_blocks = num_blocks
        self._seeds = random.Random(config.seed)
        self._states: dict[str, _TextState] = {}
        self.num_steps = 0
        self._grammar_compiler: GrammarCompiler | None = None  # built by the first constrained request
        self._grammar_lock = threading.Lock()  # prepare_request runs on callers' threads

    # ---- requests -------------------------------------------------------------------------------
    def take_in(self, prompt: Prompt, params: SamplingParams | None = None, session: SessionControl | None = None,
                priority: int | None = None, images: list[bytes] | None = None) -> IntakeRequest:
        """The intake (engine/intake.py) for callers in Python: a prompt and SamplingParams under this engine's
        rules; raises RequestError naming the field."""
        return take_in(self.rules, prompt, params or SamplingParams(), session=session, priority=priority,
                       images=images)

    def tokenize(self, prompt: Prompt, add_special_tokens: bool = True) -> list[int]:
        """The ids of a prompt the intake checked; text and chat prompts' ids must fit the model's vocabulary too (a
        tokenizer with more entries than the model's embedding)."""
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        elif prompt and isinstance(prompt[0], dict):
            ids = self.tokenizer.apply_chat_template(prompt, add_generation_prompt=True)
        else:
            return list(prompt)  # the intake checked them
        check_ids("input_ids", ids, self.vocab_size)
        return ids

    def prepare_request(self, request_id: str, request: IntakeRequest) -> PreparedRequest:
        """Tokenizes a request that is not a session turn and checks its context room; raises RequestError.

        Reads nothing a step changes (tokenizer, vocabulary, rules), so another thread may call it while a step
        runs: AsyncEngine does, so that a new request never waits for the step in flight."""
        assert request.rules == self.rules, "the request was taken in under another engine's rules"
        assert request.session is None, "a session turn is tokenized against its history (submit)"
        images: tuple[PromptImage, ...] = ()
        if self.image_prompts is None:
            prompt_ids = self.tokenize(request.prompt)
        else:  # placeholders -> image spans, the images encoded here (off the step loop)
            ids = self.image_prompts.tokenize(self.tokenizer, request.prompt)
            prompt_ids, images = self.image_prompts.expand(ids, request.images)
            check_ids("input_ids", prompt_ids, self.vocab_size)
        check_context(len(prompt_ids), request.params, self.config.model.max_model_len)
        return PreparedRequest(request_id, prompt_ids, request.params, priority=request.priority or 0,
                               grammar=self._submit_grammar(request.params), images=images)

    def add_prepared(self, prepared: PreparedRequest) -> None:
        """Queue a request from ``prepare_request``; raises RequestError (nothing queued) if its id is in use."""
        try:
            check_unused(prepared.request_id, self._states)
        except RequestError:
            if prepared.grammar is not None:
                prepared.grammar.release()
            raise
        self._queue(prepared.request_id, prepared.prompt_ids, prepared.params, arrival_time=prepared.arrival_time,
                    grammar=prepared.grammar, priority=prepared.priority, images=prepared.images)

    @property
    def grammar_compiler(self) -> GrammarCompiler:
        """The engine's grammar compiler: xgrammar's view of the tokenizer at the model's logits width (built once,
        on first use: a 49k vocabulary takes a while), compiles on its own threads."""
        with self._grammar_lock:
            if self._grammar_compiler is None:
                limits = self.config.limits.structured_output_limits()
                self._grammar_compiler = GrammarCompiler.from_tokenizer(self.tokenizer, self.vocab_size, limits=limits)
            return self._grammar_compiler

    def _submit_grammar(self, params: SamplingParams) -> RequestGrammar | None:
        constraint = params.structured_outputs
        if constraint is None:
            return None
        # A verification rolls back at most the drafts of one step.
        drafts = self.config.spec.num_speculative_tokens if self.config.spec.method != "none" else 0
        return RequestGrammar(constraint, self.grammar_compiler.submit(constraint),
                              partial(GrammarMatcher, max_rollback_tokens=drafts))

    def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams | None = None,
                    session: SessionControl | None = None, priority: int | None = None,
                    images: list[bytes] | None = None) -> None:
        """Take in and queue a request; raises RequestError (nothing queued, no session opened) for bad input, a
        session protocol error or max_sessions. ``images``: encoded images, one per placeholder of the prompt."""
        self.submit(request_id, self.take_in(prompt, params, session, priority, images))

    def submit(self, request_id: str, request: IntakeRequest) -> None:
        """Queue a request the intake took in; raises RequestError as add_request."""
        if request.session is None:
            self.add_prepared(self.prepare_request(request_id, request))
            return
        assert request.rules == self.rules, "the request was taken in under another engine's rules"
        session, params, prompt = request.session, request.params, request.prompt
        check_unused(request_id, self._states)
        sessions, sid = self.scheduler.sessions, session.session_id
        sessions.check_turn(sid, session.start)
        if session.start and sessions.get(sid) is None:
            self._check_session_room()
        previous = None if session.start else sessions.get(sid)  # START begins a fresh conversation
        chat = request.is_chat
        history: list[int] = []
        if chat:
            prompt = (previous.messages if previous is not None else []) + list(prompt)
        elif previous is not None:
            history = sessions.history(sid)
        images: tuple[PromptImage, ...] = ()
        image_data = (previous.image_data if previous is not None and chat else ()) + request.images
        if self.image_prompts is None:
            prompt_ids = history + self.tokenize(prompt, add_special_tokens=not history)
        else:  # the earlier turns' spans ride along: a recompute of the history needs them (engine/images.py)
            kept = previous.images if previous is not None and not chat else ()
            prompt_ids, images = self.image_prompts.turn(self.tokenizer, prompt, history, kept, image_data)
            check_ids("input_ids", prompt_ids, self.vocab_size)
        check_context(len(prompt_ids), params, self.config.model.max_model_len, " (session history included)")
        if session.start:
            if sessions.get(sid) is not None:  # START again, no turn running (check_turn): a new conversation
                self.scheduler.close_session(sid)
            self.scheduler.open_session(sid)
        # A session keeps its priority: a turn that gives one sets it for itself and the turns after it.
        priority = request.priority if request.priority is not None else (previous.priority if previous else 0)
        sessions.get(sid).priority = priority
        # The constraint applies to this turn only: the next turn's params carry their own (or none).
        self._queue(request_id, prompt_ids, params, session=session, num_history_tokens=len(history),
                    text_turn=not chat, grammar=self._submit_grammar(params),  # a text turn: marked in flight
                    priority=priority, images=images)
        if chat:
            turn = sessions.begin_turn(sid, request_id)
            turn.messages, turn.image_data = list(prompt), image_data

    def _queue(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
               session: SessionControl | None = None, num_history_tokens: int = 0, text_turn: bool = True,
               arrival_time: float | None = None, grammar: RequestGrammar | None = None, priority: int = 0,
               images: tuple[PromptImage, ...] = ()) -> None:
        seed = params.seed if params.seed is not None else self._seeds.randrange(SEED_LIMIT)
        request = Request(request_id=request_id, prompt_token_ids=prompt_ids, sampling_params=params, seed=seed,
                          arrival_time=time.monotonic() if arrival_time is None else arrival_time,
                          eos_token_ids=self.tokenizer.eos_token_ids,
                          session_id=session.session_id if session is not None and text_turn else None,
                          num_history_tokens=num_history_tokens, grammar=grammar, priority=priority, images=images)
        try:
            self.scheduler.add_request(request)  # first: a refusal there leaves no text state behind
        except Exception:  # released, then raised on
            if grammar is not None:
                grammar.release()
            raise
        self._states[request_id] = _TextState(
            request=request,
            detokenizer=IncrementalDetokenizer(self.tokenizer, prompt_ids, params.skip_special_tokens,
                                               params.include_stop_str_in_output),
            stops=StopStringMatcher(list(params.stop), params.include_stop_str_in_output),
            metrics=RequestMetrics(arrival_time=request.arrival_time, priority=priority),
            session=session, text_turn=text_turn)

    def _check_session_room(self) -> None:
        """max_sessions, after closing the idle sessions: the step loop closes them only when it idles, and a busy
        engine must not refuse sessions for expired ones."""
        if self.scheduler.num_sessions >= self.config.max_sessions:
            self.close_idle_sessions()
        check_session_room(self.scheduler.sessions, self.config.max_sessions)

    def close_idle_sessions(self, now: float | None = None) -> list[str]:
        now = time.monotonic() if now is None else now
        return self.scheduler.close_idle_sessions(now, self.config.session_idle_timeout_s)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Abort at any time; returns the request's final output, or None if it is unknown or already done."""
        state = self._states.get(request_id)
        if state is None:
            return None
        self.scheduler.abort_request(request_id)
        return self._finish_output(state, [], [])

    def has_unfinished_requests(self) -> bool:
        """Also True while a step is in flight (async_scheduling): the loop steps on to commit it."""
        in_flight = self._device is not None and self._device.in_flight is not None
        return in_flight or self.scheduler.has_unfinished_requests()

    # ---- the step -------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One step's outputs; with async_scheduling, those of the step that was in flight (engine/overlap.py)."""
        if self._device is not None:
            return self._overlapped_step()
        scheduler_output = self._scheduled(self.scheduler.schedule())
        # Nothing to run (e.g. every request waits for blocks or its grammar, or errors found while scheduling).
        runner_output = (RunnerOutput(sampled_token_ids=[]) if scheduler_output.is_empty
                         else self.executor.execute(scheduler_output))
        updated = self.scheduler.update_from_output(scheduler_output, runner_output)
        return self._outputs(scheduler_output, runner_output, updated)

    def _scheduled(self, scheduler_output: SchedulerOutput) -> SchedulerOutput:
        now = time.monotonic()
        for chunk in scheduler_output.chunks:
            metrics = self._states[chunk.request.request_id].metrics
            if metrics.first_scheduled_time is None:
                metrics.first_scheduled_time = now
        if scheduler_output.is_empty:
            pending = self.scheduler.pending_grammars()
            if pending and not self.scheduler.num_running:  # only compiles to wait for: no busy loop meanwhile
                wait_futures(pending, timeout=GRAMMAR_WAIT_S, return_when=FIRST_COMPLETED)
        return scheduler_output

    def _overlapped_step(self) -> list[RequestOutput]:
        """Schedule and prepare the next step, submit it behind the step in flight, then commit the step in flight
        and stream it (engine/overlap.py)."""
        device = self._device
        previous = device.in_flight
        scheduler_output = self._scheduled(
            self.scheduler.schedule_ahead(None if previous is None else previous.scheduler_output))
        current = None
        if not scheduler_output.is_empty:
            with torch.inference_mode():  # the tensors the runner would make in its step (compiled regions' guards)
                inputs = self.runner.prepare(scheduler_output)
                rows = continued_rows(scheduler_output, inputs, previous, self.device)
            current = device.submit(self.executor.execute, scheduler_output, inputs, rows)
        device.in_flight = current
        if previous is None:
            # Nothing was in flight: report what scheduling ended, and let the new step sample at once.
            updated = self.scheduler.update_from_output(SchedulerOutput(chunks=[]), RunnerOutput([]))
            self._hand_sampling(current)
            return self._outputs(SchedulerOutput(chunks=[]), RunnerOutput([]), updated)
        try:
            runner_output = previous.result.result()
            updated = self.scheduler.update_from_output(previous.scheduler_output, runner_output)
        except BaseException as exc:
            if current is not None:  # its forward waits for this: fail it too
                current.sampling.set_exception(RuntimeError(f"the step before it failed: {exc}"))
            raise
        self._hand_sampling(current)
        return self._outputs(previous.scheduler_output, runner_output, updated)

    def _hand_sampling(self, step: InFlight | None) -> None:
        """The step's sampling metadata, from the committed tokens (its forward may be running meanwhile)."""
        if step is None:
            return
        try:
            with torch.inference_mode():
                metadata = self.runner.sampling_metadata(step.scheduler_output.chunks, step.inputs)
            step.sampling.set_result(metadata)
        except BaseException as exc:
            step.sampling.set_exception(exc)
            raise

    def _outputs(self, scheduler_output: SchedulerOutput, runner_output: RunnerOutput,
                 updated: list[Request]) -> list[RequestOutput]:
        """A committed step's outputs: detokenized, stop strings checked, and what the scheduler ended."""
        logprobs_by_id = {}
        if runner_output.logprobs is not None:
            logprobs_by_id = {c.request.request_id: lp
                              for c, lp in zip(scheduler_output.chunks, runner_output.logprobs) if lp}
        for chunk, entries in zip(scheduler_output.chunks, runner_output.prompt_logprobs or []):
            state = self._states.get(chunk.request.request_id)
            if entries and state is not None:
                state.prompt_logprobs += entries
                chunk.request.num_prompt_logprobs += len(entries)
        self.num_steps += 1
        outputs = []
        for request in updated:
            state = self._states.get(request.request_id)
            if state is not None:
                outputs.append(self._make_output(state, logprobs_by_id.get(request.request_id, [])))
        # Requests the scheduler ended without new tokens (e.g. can never fit in the pool).
        for request_id, state in list(self._states.items()):
            if state.request.is_finished:
                outputs.append(self._finish_output(state, [], []))
        return outputs

    def _make_output(self, state: _TextState, new_logprobs: list[TokenLogprob]) -> RequestOutput:
        request = state.request
        new_ids = request.output_token_ids[state.num_emitted_tokens:]
        state.num_emitted_tokens = request.num_output_tokens
        state.cumulative_logprob += sum(lp.logprob for lp in new_logprobs)
        if state.metrics.first_token_time is None and new_ids:
            state.metrics.first_token_time = time.monotonic()
        text, stop = state.stops.feed(state.detokenizer.add(new_ids, stop_terminated=_ends_on_stop_token(request)))
        self._stop_at_string(request, stop)
        if request.is_finished:
            return self._finish_output(state, new_ids, new_logprobs, text, stopped_by_string=stop is not None)
        state.text.append(text)
        return self._output(state, new_ids, text, new_logprobs, finished=False)

    def _stop_at_string(self, request: Request, stop: str | None) -> None:
        """A stop string matched in the request's text: it ends the request, and it is the reason even when a stop
        token or the length ended it in the same step (several tokens a step with drafts; the text ends at the
        string), as in vLLM."""
        if stop is None:
            return
        if not request.is_finished:
            self.scheduler.finish_request(request.request_id, RequestStatus.FINISHED_STOPPED, stop)
        elif request.status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH):
            request.status, request.stop_reason = RequestStatus.FINISHED_STOPPED, stop

    def _finish_output(self, state: _TextState, new_ids: list[int], new_logprobs: list[TokenLogprob],
                       text: str = "", stopped_by_string: bool = False) -> RequestOutput:
        request = state.request
        if not request.is_finished:  # aborted by the caller
            request.status = RequestStatus.FINISHED_ABORTED
        if not stopped_by_string:
            tail, stop = state.stops.feed(state.detokenizer.flush())
            text += tail + (state.stops.flush() if stop is None else "")
            self._stop_at_string(request, stop)
        state.text.append(text)
        state.metrics.finished_time = time.monotonic()
        del self._states[request.request_id]
        self._end_turn(state)
        return self._output(state, new_ids, text, new_logprobs, finished=True)

    def _end_turn(self, state: _TextState) -> None:
        """A session turn's end: a chat turn's answer joins the conversation; END closes the session (a text turn's
        KV went back to its session when the scheduler released it)."""
        control = state.session
        sessions = self.scheduler.sessions
        if control is None or sessions.get(control.session_id) is None:
            return
        if not state.text_turn:
            if state.request.status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH):
                sessions.get(control.session_id).messages.append({"role": "assistant",
                                                                  "content": "".join(state.text)})
            sessions.end_turn(control.session_id, state.request.request_id)
        if control.end:
            self.scheduler.close_session(control.session_id)

    def _output(self, state: _TextState, new_ids: list[int], text: str, new_logprobs: list[TokenLogprob],
                finished: bool) -> RequestOutput:
        request = state.request
        prompt_logprobs = None
        first = (new_ids or finished) and state.num_emitted_tokens == len(new_ids)  # its first output with tokens
        if first and request.sampling_params.prompt_logprobs is not None and \
                len(state.prompt_logprobs) == request.num_prompt_tokens - 1:  # complete (not cut by an abort)
            prompt_logprobs = PromptLogprobs(request.prompt_token_ids[0], state.prompt_logprobs)
        return RequestOutput(
            request_id=request.request_id, new_token_ids=list(new_ids), new_text=text, finished=finished,
            finish_reason=request.finish_reason if finished else None,
            num_prompt_tokens=request.num_prompt_tokens, num_output_tokens=request.num_output_tokens,
            num_cached_tokens=request.num_cached_tokens, cumulative_logprob=state.cumulative_logprob,
            new_logprobs=new_logprobs or None, prompt_logprobs=prompt_logprobs,
            stop_reason=request.stop_reason if finished else None, refusal=request.refusal if finished else None,
            error=request.error if finished else None, metrics=state.metrics)

    def fail_all(self, message: str) -> list[RequestOutput]:
        """End every live request with finish_reason "error" (after an exception in a step); frees their blocks."""
        if self._device is not None:  # a step still in flight behind the failed one: its results are not wanted
            failure = self._device.drop()
            if failure is not None:
                log.warning("the step in flight when the requests were failed failed too: %s", failure)
        outputs = []
        for request_id, state in list(self._states.items()):
            self.scheduler.abort_request(request_id)
            state.request.status = RequestStatus.FINISHED_ERROR
            state.request.error = message
            outputs.append(self._finish_output(state, [], []))
        return outputs

    # ---- introspection --------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the worker ranks (tensor parallelism) and the grammar compiler; idempotent. The engine cannot step
        afterwards."""
        if self._device is not None:
            self._device.close()
        self.executor.close()
        with self._grammar_lock:
            if self._grammar_compiler is not None:
                self._grammar_compiler.shutdown()

    def stats(self) -> EngineStats:
        counters = self.scheduler.stats_counters()
        return EngineStats(num_running=self.scheduler.num_running, num_waiting=self.scheduler.num_waiting,
                           kv_blocks_total=self.num_blocks, num_sessions=self.scheduler.num_sessions,
                           eplb=self.executor.eplb_stats(), spec_survival=self.executor.spec_survival_stats(),
                           **counters)
