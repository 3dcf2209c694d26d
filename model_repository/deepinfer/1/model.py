"""Triton Python-backend model: lifecycle and translation only.

Lifecycle: initialize builds the engine through ``parameters.build_engine``; execute decodes each request
with ``codec.decode_request`` (which runs the engine's intake, once) and submits it to the engine (returning None:
decoupled); a refusal is a RequestError, sent with its kind's Triton code and ``to_wire``'s message. One response
thread drains every request's stream, sends the deltas, polls cancellation (-> engine.abort) and ends
every request, errors included, with TRITONSERVER_RESPONSE_COMPLETE_FINAL; finalize shuts the engine
down (each stream then ends) and joins the thread, so unload never hangs.

Faults: if the engine dies (AsyncEngine.on_failure), every request has already ended with the error; the model
logs why and unloads itself (pb_utils.unload_model, which needs --model-control-mode=explicit, as `deepinfer
serve` runs it), so Triton reports it not ready and answers new requests with an error: in Triton 2.51 nothing
else a Python model does (not even its stub exiting) turns its ready endpoint false. A sidecar process ends this
stub, and removes its shm region, if tritonserver dies (lifeline.StubGuard).
"""
from __future__ import annotations

import itertools
import json
import logging
import os
import queue
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any


def _use_site_dirs() -> None:
    """Put DEEPINFER_SITE_DIRS (set by `deepinfer serve`: the project's venv) first on sys.path.

    The stub's interpreter runs isolated (PYTHONPATH is ignored) with its own site-packages; addsitedir also
    reads the venv's .pth files, which is how an editable install of backend_lib is found. This must run
    before anything imports numpy (pb_utils does): the 2.51 stub mis-reads BYTES tensors with numpy 2.
    """
    import site
    import sys

    before = list(sys.path)
    for path in os.environ.get("DEEPINFER_SITE_DIRS", "").split(os.pathsep):
        if path:
            site.addsitedir(path)
    sys.path[:] = [p for p in sys.path if p not in before] + before


_use_site_dirs()

import triton_python_backend_utils as pb_utils  # noqa: E402
from backend_lib.core.errors import ErrorKind, RequestError, internal, to_wire  # noqa: E402
from backend_lib.frontend.triton import codec, lifeline, parameters as triton_parameters  # noqa: E402
from backend_lib.frontend.triton.responses import DeltaCoalescer, ResponseEncoder  # noqa: E402
from backend_lib.frontend.triton.metrics import TritonMetrics  # noqa: E402

# Poll periods of the response thread (outputs and new requests wake it at once): each is_cancelled() is a round
# trip to the Triton process, so it is polled rarely.
_CANCEL_POLL_S = 0.2
_STATS_POLL_S = 0.5
_JOIN_TIMEOUT_S = 60.0


@dataclass
class _Active:
    request_id: str
    request: Any  # pb_utils.InferenceRequest, kept for is_cancelled()
    sender: Any  # its response sender
    stream: Any  # backend_lib.engine.async_engine.RequestStream
    encoder: ResponseEncoder
    coalescer: DeltaCoalescer
    cancel_checked: float = 0.0
    cancelled: bool = False
    done: bool = field(default=False)


class TritonPythonModel:
    def initialize(self, args: dict[str, str]) -> None:
        self._logger = pb_utils.Logger
        logging.basicConfig(level=logging.INFO, format="%(message)s")  # the engine's load log, in the server's log
        config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(config):
            raise ValueError("deepinfer needs model_transaction_policy { decoupled: true } in config.pbtxt")
        parameters = {name: value["string_value"] for name, value in config.get("parameters", {}).items()}
        self._options = triton_parameters.serving_options_from_parameters(parameters)
        self._guard = lifeline.StubGuard(lifeline.stub_shm_region())  # before the (long) engine build
        self._engine = triton_parameters.build_engine(parameters)
        self._model_name = args["model_name"]
        tokenizer = self._engine.tokenizer
        self._decode_token = lambda token_id: tokenizer.decode([token_id], skip_special_tokens=False)
        self._decode_ids = lambda ids: tokenizer.decode(ids, skip_special_tokens=False)
        self._metrics = self._make_metrics(args)
        self._prefix = f"{args['model_name']}-{args['model_instance_name']}-"
        self._stop_file = os.environ.get("DEEPINFER_STOP_FILE", "")
        self._ids = itertools.count()
        self._incoming: queue.Queue[_Active] = queue.Queue()
        self._closing = threading.Event()
        # Set when the engine delivered outputs or a request came in: the response thread sleeps until then.
        self._wake = threading.Event()
        self._engine.on_outputs = self._wake.set
        self._engine.on_failure = self._engine_failed
        self._thread = threading.Thread(target=self._response_loop, name="deepinfer-responses", daemon=True)
        self._thread.start()

    def _make_metrics(self, args: dict[str, str]) -> TritonMetrics | None:
        try:
            return TritonMetrics(pb_utils, {"model": args["model_name"], "version": args["model_version"]},
                                 kv_cache_dtype=self._engine.config.kv_dtype_name)
        except pb_utils.TritonModelException as exc:
            if "metrics not supported" not in str(exc):
                raise
            self._logger.log_warn("[deepinfer] Triton metrics are disabled on this server; no engine metrics")
            return None

    def execute(self, requests: list[Any]) -> None:
        for request in requests:
            sender = request.get_response_sender()
            request_id = f"{self._prefix}{next(self._ids)}"
            try:
                if self._closing.is_set() or self._server_stopping():
                    raise RequestError(None, "the server is shutting down", ErrorKind.BUSY)
                decoded = self._decode(request)
                stream = self._engine.submit(request_id, decoded.request)
            except RequestError as exc:  # the intake or admission refused it: its kind says whose fault
                self._send_error(sender, exc)
                continue
            except Exception as exc:
                self._logger.log_error(f"[deepinfer] request {request_id} failed: {traceback.format_exc()}")
                self._send_error(sender, internal(f"internal error: {exc}"))
                continue
            encoder = ResponseEncoder(decoded, self._decode_token, self._decode_ids)
            coalescer = DeltaCoalescer(self._options.stream_interval if decoded.stream else 1)
            self._incoming.put(_Active(request_id, request, sender, stream, encoder, coalescer))
            self._wake.set()
        return None

    def _decode(self, request: Any) -> codec.DecodedRequest:
        inputs = {}
        for name in codec.INPUT_NAMES:
            tensor = pb_utils.get_input_tensor_by_name(request, name)
            if tensor is not None:
                inputs[name] = tensor.as_numpy()
        return codec.decode_request(inputs, request.parameters(), request.correlation_id(), request.flags(),
                                    request.requested_output_names(), self._engine.rules)

    def _send_error(self, sender: Any, error: RequestError, code: Any = None) -> None:
        """The error as its kind's Triton code (or ``code``), its field and kind in the message (core/errors.py's
        wire form, which the OpenAI front decodes: a gRPC stream and Triton 2.51's /generate carry no code)."""
        codes = {ErrorKind.INVALID: pb_utils.TritonError.INVALID_ARG, ErrorKind.BUSY: pb_utils.TritonError.UNAVAILABLE,
                 ErrorKind.INTERNAL: pb_utils.TritonError.INTERNAL}
        triton_error = pb_utils.TritonError(to_wire(error), codes[error.kind] if code is None else code)
        sender.send(pb_utils.InferenceResponse(error=triton_error),
                    flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    # -- the response thread ------------------------------------------------------------------------

    def _response_loop(self) -> None:
        active: dict[str, _Active] = {}
        stats_at = 0.0
        while not (self._closing.is_set() and not active and self._incoming.empty()):
            self._wake.clear()  # before draining: whatever arrives after this sets it again
            while True:
                try:
                    item = self._incoming.get_nowait()
                except queue.Empty:
                    break
                active[item.request_id] = item
            progressed = False
            now = time.monotonic()
            for item in list(active.values()):
                try:
                    progressed |= self._pump(item, now)
                except Exception as exc:
                    self._fail(item, exc)
                if item.done:
                    del active[item.request_id]
            if now - stats_at >= _STATS_POLL_S or (progressed and not active):
                stats_at = now
                self._housekeeping(active)
            if not progressed:
                # Cancellation is polled, not signalled: wake at least that often while requests are active.
                self._wake.wait(timeout=_CANCEL_POLL_S if active else _STATS_POLL_S)

    def _pump(self, item: _Active, now: float) -> bool:
        """Send what the stream has ready, as one response; True when something arrived."""
        if not item.cancelled and now - item.cancel_checked >= _CANCEL_POLL_S:
            item.cancel_checked = now
            if item.request.is_cancelled():
                item.cancelled = True
                self._engine.abort(item.request_id)  # the stream then ends with finish_reason "abort"
        ready = item.stream.take_ready()
        final = ready[-1] if ready and ready[-1].finished else None
        if final is not None and (item.cancelled or final.finish_reason == "error"):
            text_so_far = item.coalescer.push(ready[:-1], flush=True)  # the text before an error FINAL still goes
            if text_so_far is not None:
                self._send_delta(item, text_so_far)
            output = final
        else:
            output = item.coalescer.push(ready)  # one response for every delta that is due
        if output is None:
            return bool(ready)
        if output.finished:
            # Counted before the client can have its final response: a client that reads /metrics after it finds
            # its request there (the soak test once read the counters between the two).
            if self._metrics is not None and not output.rejected:  # refused input is not counted as a request
                self._metrics.on_finished(output)
            self._send_final(item, output)  # if this raises, _fail still sends an error FINAL
            item.done = True
        else:
            self._send_delta(item, output)
        return True

    def _send_delta(self, item: _Active, output: Any) -> None:
        tensors = item.encoder.encode(output)
        if tensors is not None:
            item.sender.send(self._response(tensors), flags=0)

    def _send_final(self, item: _Active, output: Any) -> None:
        if item.cancelled:
            self._send_error(item.sender, internal("request cancelled"), pb_utils.TritonError.CANCELLED)
        elif output.refusal is not None:  # e.g. a session protocol error or max_sessions, found when it was taken in
            self._send_error(item.sender, output.refusal)
        elif output.finish_reason == "error":
            self._send_error(item.sender, internal(output.error or "the engine failed this request"))
        else:
            tensors = item.encoder.encode(output)
            response = self._response(tensors) if tensors is not None else None
            item.sender.send(response, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    @staticmethod
    def _response(tensors: dict[str, Any]) -> Any:
        return pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(n, a) for n, a in tensors.items()])

    def _fail(self, item: _Active, exc: Exception) -> None:
        """A send or encode failed: log it, stop the engine work, and still close the client's stream."""
        self._logger.log_error(f"[deepinfer] response for {item.request_id} failed: {traceback.format_exc()}")
        if not item.done:
            item.done = True
            self._engine.abort(item.request_id)
            try:
                self._send_error(item.sender, internal(f"internal error: {exc}"))
            except Exception:
                self._logger.log_error(f"[deepinfer] could not send the final error: {traceback.format_exc()}")

    def _housekeeping(self, active: dict[str, _Active]) -> None:
        # Logged, never raised: if this thread died, every client would wait forever.
        try:
            if self._metrics is not None:
                self._metrics.refresh(self._engine.stats())
            if active and self._server_stopping():
                self._logger.log_info(f"[deepinfer] server is stopping: aborting {len(active)} requests")
                for item in active.values():
                    self._engine.abort(item.request_id)
        except Exception:
            self._logger.log_error(f"[deepinfer] response-thread housekeeping failed: {traceback.format_exc()}")

    def _server_stopping(self) -> bool:
        """`deepinfer serve` creates DEEPINFER_STOP_FILE before it signals tritonserver to stop.

        Triton calls finalize only after every decoupled request has sent FINAL, so without this signal a
        shutdown lets in-flight requests run on (to max_tokens or Triton's exit timeout). Asking Triton
        (pb_utils.is_model_ready) is no substitute: during shutdown that call can block forever.
        """
        return bool(self._stop_file) and os.path.exists(self._stop_file)

    # -- lifecycle: faults ----------------------------------------------------------------------------

    def _engine_failed(self, reason: str) -> None:
        """The engine cannot go on (called on its thread, after every request got the error): go not ready."""
        self._logger.log_error(f"[deepinfer] the engine failed and cannot go on; unloading the model so that "
                               f"Triton reports it not ready. Cause: {reason}")
        try:
            pb_utils.unload_model(self._model_name)
        except Exception:
            self._logger.log_error("[deepinfer] could not unload the model (Triton needs "
                                   "--model-control-mode=explicit): it stays ready, but every request gets the "
                                   f"engine's error: {traceback.format_exc()}")

    def finalize(self) -> None:
        self._logger.log_info("[deepinfer] finalize: aborting in-flight requests")
        self._closing.set()
        self._wake.set()
        self._engine.shutdown()  # every stream gets a final output, which the thread sends as FINAL
        self._thread.join(timeout=_JOIN_TIMEOUT_S)
        if self._thread.is_alive():
            self._logger.log_error("[deepinfer] response thread did not stop within "
                                   f"{_JOIN_TIMEOUT_S:.0f} s; unloading anyway")
        self._guard.stop()
        self._logger.log_info("[deepinfer] finalize: done")
