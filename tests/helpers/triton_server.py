"""The e2e tests' server and its clients: one real tritonserver per test module (the triton fixture, new_server),
gRPC streaming, HTTP generate, /metrics parsing."""
from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from backend_lib.core.processes import free_port
from backend_lib.frontend.triton.server import TritonServer

MODEL = "deepinfer"
_DTYPES = {"BYTES": np.object_, "BOOL": np.bool_, "INT32": np.int32, "FP32": np.float32}


# Small enough to load fast, large enough for 16 concurrent streams of the tests' requests.
SERVER_PARAMETERS = {
    "max_model_len": "512",
    "num_blocks": "256",
    "block_size": "16",
    "max_num_seqs": "16",
    "max_num_batched_tokens": "256",
    "session_idle_timeout_s": "600",
    # the file's exact weights: the tests' expected answers (Paris, EOS endings) are the dequantized model's; the
    # default (auto: packed, int8 activations) is tested offline and by tests/e2e/test_packed_e2e.py
    "weight_format": "dequantize",
}


def child_processes(pid: int) -> list[tuple[int, list[str]]]:
    """(pid, argv) of each live process whose parent is ``pid`` (Linux /proc)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) == pid:
                cmdline = (stat.parent / "cmdline").read_bytes().split(b"\0")
                found.append((int(stat.parent.name), [a.decode(errors="replace") for a in cmdline if a]))
        except (FileNotFoundError, ProcessLookupError, IndexError):  # it exited while we read
            continue
    return found


def new_server(workdir: Any, overrides: dict[str, str], exit_timeout_s: float = 15,
               openai: bool = False) -> TritonServer:
    """A tritonserver on free ports (with ``openai``, its OpenAI front too); ``with new_server(...) as server``
    starts it and always stops it."""
    return TritonServer(http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(),
                        openai_port=free_port() if openai else None, overrides=overrides, workdir=workdir,
                        exit_timeout_s=exit_timeout_s)


def make_inputs(values: dict[str, Any], dtypes: dict[str, str] | None = None) -> list[grpcclient.InferInput]:
    """Strings -> BYTES [1], bools -> BOOL [1], int lists -> INT32 [n]; ``dtypes`` overrides the Triton type."""
    inputs = []
    for name, value in values.items():
        dtype = (dtypes or {}).get(name)
        if dtype is None:
            dtype = "BYTES" if isinstance(value, str) else "BOOL" if isinstance(value, bool) else "INT32"
        if dtype == "BYTES" and isinstance(value, list):  # several elements (the image input)
            array = np.array([v.encode("utf-8") if isinstance(v, str) else v for v in value], dtype=np.object_)
        elif dtype == "BYTES":
            array = np.array([value.encode("utf-8")], dtype=np.object_)
        elif isinstance(value, list):
            array = np.array(value, dtype=_DTYPES[dtype])
        else:
            array = np.array([value], dtype=_DTYPES[dtype])
        item = grpcclient.InferInput(name, list(array.shape), dtype)
        item.set_data_from_numpy(array)
        inputs.append(item)
    return inputs


@dataclass
class Result:
    """Everything one request received: one entry per response."""

    texts: list[str] = field(default_factory=list)
    ids: list[list[int]] = field(default_factory=list)
    finish_reasons: list[str] = field(default_factory=list)
    num_output_tokens: list[int] = field(default_factory=list)
    num_input_tokens: int | None = None
    prompt_logprobs: list[dict[str, dict[str, Any]]] | None = None  # the JSON output, when a response had it
    error: str | None = None

    @property
    def text(self) -> str:
        return "".join(self.texts)

    @property
    def all_ids(self) -> list[int]:
        return [i for chunk in self.ids for i in chunk]

    @property
    def finish_reason(self) -> str | None:
        return self.finish_reasons[-1] if self.finish_reasons else None


def _absorb(result: Result, response: Any) -> None:
    text = response.as_numpy("text_output")
    if text is not None:
        result.texts.append(text.reshape(-1)[0].decode("utf-8"))
    ids = response.as_numpy("output_ids")
    if ids is not None:
        result.ids.append([int(i) for i in ids.reshape(-1)])
    reason = response.as_numpy("finish_reason")
    if reason is not None:
        result.finish_reasons.append(reason.reshape(-1)[0].decode())
    count = response.as_numpy("num_output_tokens")
    if count is not None:
        result.num_output_tokens.append(int(count.reshape(-1)[0]))
    n_in = response.as_numpy("num_input_tokens")
    if n_in is not None:
        result.num_input_tokens = int(n_in.reshape(-1)[0])
    prompt_logprobs = response.as_numpy("prompt_logprobs")
    if prompt_logprobs is not None:
        result.prompt_logprobs = json.loads(prompt_logprobs.reshape(-1)[0])


class StreamClient:
    """One gRPC bidirectional stream; requests are told apart by request id."""

    def __init__(self, url: str) -> None:
        self.client = grpcclient.InferenceServerClient(url=url)
        self._responses: queue.Queue = queue.Queue()
        self.client.start_stream(callback=lambda result, error: self._responses.put((result, error)))
        self._counter = 0

    def send(self, values: dict[str, Any], dtypes: dict[str, str] | None = None, **kwargs: Any) -> str:
        self._counter += 1
        request_id = f"req-{self._counter}"
        self.client.async_stream_infer(MODEL, make_inputs(values, dtypes), request_id=request_id,
                                       enable_empty_final_response=True, **kwargs)
        return request_id

    def collect(self, request_ids: list[str], timeout_s: float = 300.0) -> dict[str, Result]:
        results = {rid: Result() for rid in request_ids}
        pending = set(request_ids)
        while pending:
            response, error = self._responses.get(timeout=timeout_s)
            if error is not None:
                # A request's error arrives without its id when it fails early; attribute it to the oldest one.
                rid = getattr(error, "request_id", None) or sorted(pending)[0]
                results[rid].error = str(error)
                pending.discard(rid)
                continue
            rid = response.get_response().id
            _absorb(results[rid], response)
            if response.get_response().parameters["triton_final_response"].bool_param:
                pending.discard(rid)
        return results

    def next_response(self, timeout_s: float = 60.0) -> tuple[Any, Any]:
        return self._responses.get(timeout=timeout_s)

    def generate(self, values: dict[str, Any], dtypes: dict[str, str] | None = None, **kwargs: Any) -> Result:
        request_id = self.send(values, dtypes, **kwargs)
        return self.collect([request_id])[request_id]

    def close(self, cancel: bool = False) -> None:
        self.client.stop_stream(cancel_requests=cancel)
        self.client.close()


def stream_request(prompt: str, sampling: dict[str, Any], **extra: Any) -> dict[str, Any]:
    """A streamed text request's inputs (the prompt left out of the output), with ``extra`` inputs over them."""
    return {"text_input": prompt, "sampling_parameters": json.dumps(sampling), "stream": True,
            "exclude_input_in_output": True, **extra}


def http_generate(http_url: str, body: dict[str, Any], stream: bool = False,
                  timeout_s: float = 300.0) -> tuple[int, list[dict[str, Any]]]:
    """POST /generate (or /generate_stream): (status, list of JSON responses)."""
    endpoint = "generate_stream" if stream else "generate"
    request = urllib.request.Request(f"http://{http_url}/v2/models/{MODEL}/{endpoint}",
                                     data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            payload = response.read().decode()
            status = response.status
    except urllib.error.HTTPError as exc:
        payload, status = exc.read().decode(), exc.code
        if not (stream and payload.startswith("data: ")):  # /generate_stream sends a refusal as an event
            return status, [json.loads(payload or "{}")]
    if not stream:
        return status, [json.loads(payload)]
    events = [json.loads(line[len("data: "):]) for line in payload.splitlines() if line.startswith("data: ")]
    return status, events


def metrics(metrics_url: str) -> dict[str, float]:
    """Prometheus text -> {"name{labels}": value} (label order as the server prints it)."""
    with urllib.request.urlopen(metrics_url, timeout=10) as response:
        text = response.read().decode()
    values = {}
    for line in text.splitlines():
        match = re.match(r"^([a-zA-Z_:][\w:]*(?:\{[^}]*\})?)\s+(\S+)$", line)
        if match:
            values[match.group(1)] = float(match.group(2))
    return values


def metric(values: dict[str, float], name: str, **labels: str) -> float:
    """Sum of the series of ``name`` whose labels include ``labels``."""
    total, found = 0.0, False
    for key, value in values.items():
        base, _, rest = key.partition("{")
        if base != name:
            continue
        if all(f'{k}="{v}"' in rest for k, v in labels.items()):
            total += value
            found = True
    if not found:
        raise KeyError(f"metric {name} {labels} not exported")
    return total


def server_ready(http_url: str) -> bool:
    try:
        with urllib.request.urlopen(f"http://{http_url}/v2/models/{MODEL}/ready", timeout=5) as response:
            return response.status == 200
    except urllib.error.URLError:
        return False


def wait_for(condition, timeout_s: float = 30.0, what: str = "condition", poll_s: float = 0.2) -> float:
    """Seconds until ``condition()`` held; an AssertionError naming ``what`` after ``timeout_s``."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if condition():
            return time.monotonic() - start
        time.sleep(poll_s)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def worker_pids(session: int | None = None) -> set[int]:
    """Live worker ranks, or only those in one tritonserver's session (its pid: it starts its own, and ranks keep
    it even when orphaned): the suite runs on two pytest workers, so another test's ranks may be alive."""
    session_filter = ["-s", str(session)] if session is not None else []
    out = subprocess.run(["pgrep", *session_filter, "-f", "backend_lib.worker.executor.worker"], capture_output=True,
                         text=True).stdout
    return {int(p) for p in out.split()}


def lose_a_rank(server: Any, request: dict[str, Any], rank_name: str) -> None:
    """Kill the server's one worker rank while ``request`` streams: the stream ends with an error naming
    ``rank_name`` within 10 s, the model goes not ready, and no rank outlives the server (checked after it stops:
    call inside the ``new_server`` block, then ``assert_no_rank_left``)."""
    (worker,) = worker_pids(session=server.process.pid)
    client = StreamClient(server.grpc_url)
    try:
        client.send(request)
        _, error = client.next_response()  # running: the first token came back
        assert error is None
        os.kill(worker, signal.SIGKILL)
        killed = time.monotonic()
        while True:
            _, error = client.next_response(timeout_s=30)
            if error is not None:
                break
        assert time.monotonic() - killed < 10
        assert rank_name in str(error)
    finally:
        client.close()
    deadline = time.monotonic() + 10
    while server_ready(server.http_url):
        assert time.monotonic() < deadline, "the model still reports ready after losing a rank"
        time.sleep(0.2)
    status, body = http_generate(server.http_url, {"text_input": "hi", "max_tokens": 2}, timeout_s=10)
    assert status != 200, body


@pytest.fixture(scope="module")
def triton(tmp_path_factory) -> TritonServer:
    """One real tritonserver per test module (tests/e2e/conftest.py registers it), on free ports, small KV cache and
    context (fast load); always stopped."""
    with new_server(tmp_path_factory.mktemp("triton"), dict(SERVER_PARAMETERS)) as server:
        yield server
