"""perf_analyzer (tritonclient 2.41.0) drives the model over gRPC streaming at concurrency 4."""
from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "perf_analyzer.sh"


@pytest.fixture(scope="module")
def perf_analyzer() -> str:
    install = subprocess.run(["bash", str(SCRIPT), "--install-only"], capture_output=True, text=True, timeout=600)
    if install.returncode == 3:  # the script's "could not install" code: nothing else may skip
        pytest.skip(f"perf_analyzer could not be installed: {install.stderr.strip().splitlines()[-1]}")
    assert install.returncode == 0, install.stderr
    return install.stdout.strip().splitlines()[-1]


def test_perf_analyzer_streaming_concurrency_4(perf_analyzer, triton):
    run = subprocess.run(["bash", str(SCRIPT), "-u", triton.grpc_url, "-c", "4", "-n", "8"],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    out = run.stdout
    assert re.search(r"Concurrency: 4, throughput: [0-9.]+ infer/sec", out), out[-3000:]
    assert int(re.search(r"Request count: (\d+)", out).group(1)) >= 8
    # Every request streamed (max_tokens 8, ignore_eos): several responses, at most one per token (deltas that
    # wait while the machine is busy go out as one response).
    requests = float(re.search(r"\n\s+Throughput: ([0-9.]+) infer/sec", out).group(1))
    responses = float(re.search(r"Response Throughput: ([0-9.]+) infer/sec", out).group(1))
    assert 2 <= responses / requests <= 8 * 1.1, out[-3000:]


def test_stopping_the_server_ends_in_flight_streams(triton):
    """Runs last in this module: stop() makes the model abort in-flight requests (FINAL with "abort"), then
    Triton unloads the model (finalize) and exits cleanly."""
    import threading

    from triton_helpers import StreamClient

    client = StreamClient(triton.grpc_url)
    closed = False
    try:
        client.send({"text_input": "Count from one to one thousand:", "stream": True, "return_finish_reason": True,
                     "sampling_parameters": json.dumps({"max_tokens": 480, "ignore_eos": True, "temperature": 0})})
        response, error = client.next_response()
        assert error is None  # streaming has begun
        started = time.monotonic()
        outcome = {}
        stopper = threading.Thread(target=lambda: outcome.update(rc=triton.stop(timeout_s=90)))
        stopper.start()
        reasons = []
        while True:  # the stream ends with a final response, never silence
            response, error = client.next_response(timeout_s=30)
            assert error is None, error
            reason = response.as_numpy("finish_reason")
            reasons.append(reason.reshape(-1)[0].decode() if reason is not None else None)
            if response.get_response().parameters["triton_final_response"].bool_param:
                break
        assert reasons[-1] == "abort"
        # Triton 2.51 keeps a model loaded while a client's gRPC stream stays open, so the client goes now.
        client.close()
        closed = True
        stopper.join(timeout=120)
        assert outcome.get("rc") == 0, triton.log_tail()
        assert time.monotonic() - started < 30, "shutdown took too long"
        assert "[deepinfer] finalize: done" in triton.log_path.read_text()
    finally:
        if not closed:
            client.close()
