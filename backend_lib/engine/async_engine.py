"""AsyncEngine: the LLMEngine step loop on a background thread, with a thread-safe output stream per request.

The Triton model calls submit / abort from its own threads and reads each RequestStream from a response
thread. One lock guards the engine; the step loop holds it for a whole step. A new request does not wait for
it: it goes into an inbox that the loop empties before each step. Without the inbox, a burst of N requests (one
Triton execute() each) got in one per step, and the last one's first token came N steps late. A request that is
not a session turn is taken in (the intake) and tokenized on the caller's thread first (LLMEngine.prepare_request),
so bad input still fails the call. A session turn's checks read the session (exists, busy, history), so they run when
the loop takes it in; a refused turn ends its stream with a ``rejected`` error output. Aborts and stats take the
lock and wait for the current step at most. Python's locks are not fair, so the step loop lets waiting callers
in before it takes the lock for the next step; otherwise a busy loop could starve an abort for a generation.

Admission control: a request that would make more than ``max_waiting_requests`` wait for a slot (the inbox, the
requests being taken in from it, and the scheduler's waiting queue) is refused at once with a busy RequestError, as is
a session START past ``max_sessions`` (checked by the engine when the loop takes the turn in; its stream ends with
a ``busy`` rejected output). Both refusals are counted in ``stats()``.

The engine is built on the step thread, not the caller's: GNU OpenMP keeps one worker pool per thread that
runs parallel regions, and once two pools exist (caller + step thread) on a machine with as many cores as one
pool's threads, it throttles every worker's spin-wait, so each parallel op pays a sleep / wake-up. Measured
here: oneDNN's batch-32 GEMM 134 us on the only pool, 182 us with a second pool alive; the whole engine ~20%
slower. Caller threads only tokenize and queue, so the step thread's pool stays the only one.

A step that raises ends every live request with an error output (never a hang). The engine then goes on, unless
it cannot: the error says so (FatalEngineError, MemoryError), ending the requests failed too, the KV pool lost
its integrity, or several steps in a row failed. Then the engine is dead for good: the loop stops, every request
waiting in the inbox ends with the error, add_request raises EngineDeadError naming the cause, and
``on_failure(reason)`` tells the owner (the Triton model unloads itself, so Triton reports it not ready).
"""
from __future__ import annotations

import collections
import functools
import logging
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager

from backend_lib.core.config import EngineConfig
from backend_lib.core.errors import RequestError, busy
from backend_lib.core.outputs import EngineStats, RequestOutput, SessionControl
from backend_lib.core.request import check_unused
from backend_lib.core.sampling_params import SamplingParams
from backend_lib.engine.faults import FaultConfig
from backend_lib.engine.intake import IntakeRequest, Prompt, RequestRules
from backend_lib.engine.llm_engine import LLMEngine
from backend_lib.worker.failures import FatalEngineError

logger = logging.getLogger(__name__)

# Failed steps in a row after which the engine is declared dead: each failure already ended every live request,
# so a run of them means nothing can be served (e.g. a device that fails every launch).
_MAX_CONSECUTIVE_STEP_FAILURES = 3


class EngineDeadError(RuntimeError):
    """The engine failed and cannot serve any more; the message names the cause."""


class RequestStream:
    """The outputs of one request, in order; the last one has ``finished=True``."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self._ready: collections.deque[RequestOutput] = collections.deque()
        self._arrived = threading.Condition(threading.Lock())

    def put(self, output: RequestOutput) -> None:
        with self._arrived:
            self._ready.append(output)
            self._arrived.notify()

    def get(self, timeout: float | None = None) -> RequestOutput:
        """Blocks for the next output; raises TimeoutError after ``timeout`` seconds."""
        with self._arrived:
            if not self._arrived.wait_for(lambda: self._ready, timeout):
                raise TimeoutError(f"no output for request {self.request_id} within {timeout} s")
            return self._ready.popleft()

    def take_ready(self) -> list[RequestOutput]:
        """Every output that has arrived and was not taken yet, without waiting (a response thread polling many
        streams calls this once per stream and wake-up)."""
        with self._arrived:
            ready = list(self._ready)
            self._ready.clear()
        return ready

    def __iter__(self):
        while True:
            output = self.get()
            yield output
            if output.finished:
                return


class AsyncEngine:
    def __init__(self, config: EngineConfig | None = None, idle_poll_s: float = 1.0,
                 faults: FaultConfig | None = None) -> None:
        self._idle_poll_s = idle_poll_s
        self._faults = FaultConfig.from_env() if faults is None else faults  # read once, here
        self._failed_steps = 0  # consecutive
        self.failure: str | None = None  # why the engine is dead; None while it serves
        # Called once (on the engine thread) when the engine dies, with the reason.
        self.on_failure: Callable[[str], None] | None = None
        self._lock = threading.Lock()
        self._wakeup = threading.Event()  # set when there is work for an idle loop (or it must stop)
        self._callers_lock = threading.Lock()
        self._callers_waiting = 0
        self._streams: dict[str, RequestStream] = {}
        # New requests waiting for the loop to queue them in the engine (each with the call that does it).
        self._inbox_lock = threading.Lock()
        self._inbox: dict[str, tuple[Callable[[], None], RequestStream]] = {}
        # Requests the loop took from the inbox and has not queued in the engine yet: they still wait for a slot.
        # Written by the loop only; callers read it (an int read is atomic) under the inbox lock.
        self._admitting = 0
        self._refused_waiting = 0  # under the inbox lock
        self._refused_sessions = 0  # written by the loop only
        self._stopped = False
        # Called (on the engine's threads) after outputs were put on streams: lets a consumer block instead of
        # polling every stream.
        self.on_outputs: Callable[[], None] | None = None
        self._built = threading.Event()
        self._build_error: BaseException | None = None
        self.engine: LLMEngine | None = None
        self._thread = threading.Thread(target=self._run, args=(config,), name="deepinfer-engine", daemon=True)
        self._thread.start()
        self._built.wait()
        if self._build_error is not None:
            self._thread.join()
            raise self._build_error

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def config(self) -> EngineConfig:
        return self.engine.config

    @property
    def rules(self) -> RequestRules:
        """What the intake checks this engine's requests against (the fronts take requests in under them)."""
        return self.engine.rules

    def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams | None = None,
                    session: SessionControl | None = None, priority: int | None = None) -> RequestStream:
        """``submit`` after the intake (``LLMEngine.take_in``), for callers in Python."""
        with self._inbox_lock:  # first before the intake: an overloaded server refuses at the least cost
            self._check_waiting_room()
        return self.submit(request_id, self.engine.take_in(prompt, params, session, priority))

    def submit(self, request_id: str, request: IntakeRequest) -> RequestStream:
        """Raises RequestError (nothing queued): invalid input, or busy past max_waiting_requests;
        RuntimeError after shutdown. A session turn the engine refuses (unknown session, a turn still running,
        max_sessions, ...) ends its stream with a rejected output."""
        with self._inbox_lock:  # first before tokenizing: an overloaded server refuses at the least cost
            self._check_waiting_room()
        if request.session is None:
            prepared = self.engine.prepare_request(request_id, request)
            admit = functools.partial(self.engine.add_prepared, prepared)
        else:
            admit = functools.partial(self.engine.submit, request_id, request)
        stream = RequestStream(request_id)
        with self._inbox_lock:
            if self.failure is not None:
                raise EngineDeadError(f"the engine failed and cannot serve requests: {self.failure}")
            if self._stopped:
                raise RuntimeError("the engine is shut down")
            # The live ids are those of the streams and the inbox (a dict read is atomic under the GIL).
            check_unused(request_id, self._inbox, self._streams)
            self._check_waiting_room()  # again: others may have come in while this one was tokenized
            self._inbox[request_id] = (admit, stream)
        self._wakeup.set()
        return stream

    def _check_waiting_room(self) -> None:
        """Inbox lock held. The scheduler's count is read without the engine lock (a len(), atomic): a step in
        flight must not delay the answer, and a count one step old only moves the bound by that step's change."""
        limit = self.engine.config.max_waiting_requests
        waiting = len(self._inbox) + self._admitting + self.engine.scheduler.num_waiting
        if waiting >= limit:
            self._refused_waiting += 1
            raise busy(f"server busy: {waiting} requests are waiting for a slot, the limit (max_waiting_requests "
                       f"{limit}); retry later", "max_waiting_requests")

    def abort(self, request_id: str) -> None:
        with self._caller():
            self._admit_inbox()  # the request may still wait there
            output = self.engine.abort(request_id)
            if output is not None:
                self._deliver([output])

    def stats(self) -> EngineStats:
        with self._caller():
            stats = self.engine.stats()
        stats.num_refused_waiting = self._refused_waiting
        stats.num_refused_sessions = self._refused_sessions
        return stats

    def shutdown(self) -> None:
        """Stops the loop; every live request gets a final "abort" output."""
        with self._caller(), self._inbox_lock:
            self._stopped = True
        self._wakeup.set()
        self._thread.join()
        with self._caller():
            self._admit_inbox()
            for request_id in list(self._streams):
                output = self.engine.abort(request_id)
                if output is not None:
                    self._deliver([output])
            self.engine.close()

    @contextmanager
    def _caller(self):
        """The engine lock for a caller thread, announced so the step loop yields to it."""
        with self._callers_lock:
            self._callers_waiting += 1
        with self._lock:
            with self._callers_lock:
                self._callers_waiting -= 1
            yield

    def _let_callers_in(self) -> None:
        while self._callers_waiting:
            time.sleep(0.0002)

    def _admit_inbox(self) -> None:
        """Queue the inbox's requests in the engine (engine lock held), in arrival order."""
        with self._inbox_lock:
            waiting, self._inbox = self._inbox, {}
            self._admitting = len(waiting)
        refused = False
        for request_id, (admit, stream) in waiting.items():
            try:
                admit()
            except RequestError as exc:  # the engine refused it (a session turn's checks run here)
                self._refused_sessions += exc.busy
                stream.put(RequestOutput(request_id, [], "", finished=True, finish_reason="error",
                                         num_prompt_tokens=0, num_output_tokens=0, error=str(exc), refusal=exc))
                refused = True
                continue
            except Exception as exc:  # a bug, not the client's fault: this request fails, the others go on
                logger.exception("admitting request %s failed", request_id)
                stream.put(RequestOutput(request_id, [], "", finished=True, finish_reason="error",
                                         num_prompt_tokens=0, num_output_tokens=0,
                                         error=f"internal error: {type(exc).__name__}: {exc}"))
                refused = True
                continue
            finally:
                self._admitting -= 1
            self._streams[request_id] = stream
        if refused and self.on_outputs is not None:
            self.on_outputs()

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            stream.put(output)
            if output.finished:
                del self._streams[output.request_id]
        if outputs and self.on_outputs is not None:
            self.on_outputs()

    def _run(self, config: EngineConfig | None) -> None:
        try:
            self.engine = LLMEngine(config)  # model load, packing, KV cache and compiled regions: this thread's pool
            self._faults.install(self.engine)
        except BaseException as exc:
            self._build_error = exc
            return
        finally:
            self._built.set()
        try:
            self._loop()
        except Exception as exc:  # outside a step (admitting, closing sessions): a bug; never leave streams hanging
            logger.exception("the engine loop failed")
            with self._lock:
                self._die(f"the engine loop failed: {type(exc).__name__}: {exc}")

    def _loop(self) -> None:
        while True:
            self._let_callers_in()
            self._wakeup.clear()  # before looking for work: whatever comes in after this sets it again
            with self._lock:
                if self._stopped:
                    return
                self._admit_inbox()
                idle = not self.engine.has_unfinished_requests()
                if idle:
                    self.engine.close_idle_sessions()
                else:
                    try:
                        outputs = self.engine.step()
                        self._failed_steps = 0
                    except Exception as exc:
                        if not self._step_failed(exc):
                            return  # dead: every request has ended; add_request now raises EngineDeadError
                        continue
                    self._deliver(outputs)
            if idle:
                self._wakeup.wait(timeout=self._idle_poll_s)

    def _step_failed(self, exc: Exception) -> bool:
        """End every live request with the step's error (engine lock held); False when the engine cannot go on."""
        self._failed_steps += 1
        reason = f"engine step failed: {type(exc).__name__}: {exc}"
        logger.error("%s (%d in a row)", reason, self._failed_steps, exc_info=exc)
        fatal = None
        if isinstance(exc, (FatalEngineError, MemoryError)):
            fatal = reason
        elif self._failed_steps >= _MAX_CONSECUTIVE_STEP_FAILURES:
            fatal = f"{self._failed_steps} engine steps in a row failed; the last: {reason}"
        try:
            self._deliver(self.engine.fail_all(reason))
            self.engine.scheduler.kv_cache.check_integrity()  # the failed step may have left blocks half-taken
        except Exception as cleanup:  # noqa: BLE001 - logged, and the engine is declared dead below
            logger.exception("could not end the failed step's requests cleanly")
            fatal = fatal or f"{reason}; then ending its requests failed: {type(cleanup).__name__}: {cleanup}"
        if fatal is None:
            return True
        self._die(fatal)
        return False

    def _die(self, reason: str) -> None:
        """The engine cannot go on (engine lock held): refuse new requests, end every waiting one, tell the owner."""
        logger.error("the engine cannot go on: %s", reason)
        with self._inbox_lock:
            self.failure = reason
            waiting, self._inbox = self._inbox, {}
        message = f"the engine failed and cannot serve requests: {reason}"
        for request_id, (_, stream) in waiting.items():
            stream.put(RequestOutput(request_id, [], "", finished=True, finish_reason="error",
                                     num_prompt_tokens=0, num_output_tokens=0, error=message))
        try:  # anything the failed cleanup left behind still gets its final output
            self._deliver(self.engine.fail_all(message))
        except Exception:  # noqa: BLE001
            logger.exception("could not end the remaining requests")
            for request_id in list(self._streams):
                self._deliver([RequestOutput(request_id, [], "", finished=True, finish_reason="error",
                                             num_prompt_tokens=0, num_output_tokens=0, error=message)])
        if self.on_outputs is not None:
            self.on_outputs()
        if self.on_failure is not None:
            try:
                self.on_failure(reason)
            except Exception:  # noqa: BLE001 - the owner's handler must not take the requests' errors with it
                logger.exception("on_failure handler failed")
