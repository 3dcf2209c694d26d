"""model.py's error codes, with a stand-in pb_utils: a RequestError's kind picks the code (invalid INVALID_ARG, busy
UNAVAILABLE, internal INTERNAL) and its field and kind travel in the message (core/errors.py's wire form).

The e2e tests cannot see the code: Triton 2.51's /generate answers 400 for every model error and a gRPC stream
carries only the message (see tests/e2e/test_limits_e2e.py). So the mapping itself is checked here.
"""
from __future__ import annotations

import enum
import importlib.util
import itertools
import queue
import sys
import threading
import types
from pathlib import Path

import pytest

from backend_lib.core.outputs import RequestOutput
from backend_lib.engine.intake import RequestRules, take_in
from backend_lib.core.errors import ErrorKind, RequestError, busy, from_wire
from backend_lib.frontend.triton import codec

MODEL_PY = Path(__file__).resolve().parents[2] / "model_repository/deepinfer/1/model.py"


class _Code(enum.Enum):
    INTERNAL, INVALID_ARG, UNAVAILABLE, CANCELLED = range(4)


class _TritonError:
    INTERNAL, INVALID_ARG, UNAVAILABLE, CANCELLED = _Code.INTERNAL, _Code.INVALID_ARG, _Code.UNAVAILABLE, _Code.CANCELLED

    def __init__(self, message: str, code: _Code = _Code.INTERNAL) -> None:
        self.message, self.code = message, code


class _Sender:
    def __init__(self) -> None:
        self.sent: list[tuple[object, int]] = []

    def send(self, response, flags: int = 0) -> None:
        self.sent.append((response, flags))


class _Request:
    def __init__(self) -> None:
        self.sender = _Sender()

    def get_response_sender(self) -> _Sender:
        return self.sender


@pytest.fixture(scope="module")
def model_module():
    pb = types.ModuleType("triton_python_backend_utils")
    pb.TritonError = _TritonError
    pb.InferenceResponse = lambda output_tensors=None, error=None: types.SimpleNamespace(error=error)
    pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1
    saved = sys.modules.get("triton_python_backend_utils")
    sys.modules["triton_python_backend_utils"] = pb
    try:
        spec = importlib.util.spec_from_file_location("deepinfer_model_under_test", MODEL_PY)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # its dataclasses look their module up there
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop("deepinfer_model_under_test", None)
        if saved is None:
            sys.modules.pop("triton_python_backend_utils")
        else:
            sys.modules["triton_python_backend_utils"] = saved


class _Engine:
    def __init__(self, error: Exception) -> None:
        self.error = error

    def submit(self, *args, **kwargs):
        raise self.error


def _model(module, error: Exception):
    model = module.TritonPythonModel()  # initialize() would build a real engine: set what execute() reads
    model._closing, model._stop_file, model._prefix, model._ids = threading.Event(), "", "m-", itertools.count()
    model._incoming, model._wake, model._engine = queue.Queue(), threading.Event(), _Engine(error)
    model._logger = types.SimpleNamespace(log_error=lambda message: None)
    model._decode = lambda request: codec.DecodedRequest(take_in(RequestRules(), "hi"))
    return model


@pytest.mark.parametrize("error, code", [
    (RequestError("max_tokens", "max_tokens is 9, but ..."), _Code.INVALID_ARG),
    (busy("server busy: 9 requests are waiting for a slot, the limit (max_waiting_requests 8)",
          "max_waiting_requests"), _Code.UNAVAILABLE),
    (RuntimeError("the engine is shut down"), _Code.INTERNAL),  # not a refusal: a server fault, never the client's
])
def test_execute_maps_refusals_to_their_codes_and_ends_the_request(model_module, error, code):
    request = _Request()
    _model(model_module, error).execute([request])
    [(response, flags)] = request.sender.sent
    assert flags == 1 and response.error.code is code
    wire = from_wire(response.error.message)
    if isinstance(error, RequestError):
        assert response.error.message.startswith(error.message)  # a person reads the message first
        assert (wire.kind, wire.field, wire.limit) == (error.kind, error.field, error.limit)
    else:
        assert wire.kind is ErrorKind.INTERNAL and "the engine is shut down" in wire.message


@pytest.mark.parametrize("kind, code", [(ErrorKind.INVALID, _Code.INVALID_ARG), (ErrorKind.BUSY, _Code.UNAVAILABLE)])
def test_a_rejected_session_turn_gets_the_code_of_its_kind(model_module, kind, code):
    model = _model(model_module, ValueError())
    sender = _Sender()
    item = types.SimpleNamespace(cancelled=False, sender=sender)
    refusal = RequestError("sequence_id", "refused", kind)
    output = RequestOutput("r", [], "", finished=True, finish_reason="error", num_prompt_tokens=0,
                           num_output_tokens=0, error="refused", refusal=refusal)
    model._send_final(item, output)
    [(response, flags)] = sender.sent
    assert flags == 1 and response.error.code is code
    assert from_wire(response.error.message).field == "sequence_id"
