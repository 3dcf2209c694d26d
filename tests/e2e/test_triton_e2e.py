"""A real tritonserver (from the nvidia-pytriton wheel) serving the DeepInfer model with the bundled SmolLM2; then
perf_analyzer (tritonclient 2.41.0) drives it over gRPC streaming at concurrency 4, and stopping it ends the streams
in flight (one server start for all of it)."""
from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from tests.helpers.triton_server import StreamClient, http_generate, metric, metrics, server_ready, wait_for

pytestmark = pytest.mark.e2e

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = json.dumps({"temperature": 0, "max_tokens": 32})
RETURN_ALL = {"return_finish_reason": True, "return_num_input_tokens": True, "return_num_output_tokens": True}
FAMILIES = ["deepinfer_prompt_tokens_total", "deepinfer_generation_tokens_total",
            "deepinfer_prompt_tokens_computed_total", "deepinfer_requests_total",
            "deepinfer_time_to_first_token_seconds_count", "deepinfer_time_per_output_token_seconds_count",
            "deepinfer_e2e_request_latency_seconds_count", "deepinfer_request_prompt_tokens_count",
            "deepinfer_request_generation_tokens_count", "deepinfer_num_requests_running",
            "deepinfer_num_requests_waiting", "deepinfer_kv_blocks_used", "deepinfer_kv_blocks_free",
            "deepinfer_prefix_cache_hit_rate", "deepinfer_spec_decode_draft_tokens_total",
            "deepinfer_spec_decode_accepted_tokens_total", "deepinfer_spec_decode_num_drafts_total",
            "deepinfer_spec_decode_acceptance_rate", "deepinfer_spec_decode_mean_accepted_length"]


@pytest.fixture(scope="module")
def tokenizer():
    from backend_lib.engine.tokenizer import Tokenizer
    from backend_lib.core.model_path import default_model_path
    return Tokenizer.load(default_model_path())


@pytest.fixture()
def grpc(triton):
    client = StreamClient(triton.grpc_url)
    yield client
    client.close()


def _settled(metrics_url: str, name: str, timeout_s: float = 30.0) -> float:
    """A metric's value once two reads a refresh period apart agree."""
    value = metric(metrics(metrics_url), name)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        time.sleep(0.6)
        value, previous = metric(metrics(metrics_url), name), value
        if value == previous:
            return value
    raise AssertionError(f"{name} kept changing for {timeout_s} s")


def _ask(grpc: StreamClient, stream: bool):
    return grpc.generate({"messages": json.dumps(QUESTION), "sampling_parameters": GREEDY, "stream": stream,
                          "exclude_input_in_output": True, **RETURN_ALL})


def test_grpc_streaming_chat_answers_paris(grpc, tokenizer):
    streamed = _ask(grpc, stream=True)
    assert streamed.error is None
    assert "Paris" in streamed.text
    assert streamed.finish_reason == "stop"
    assert len(streamed.texts) > 1  # really streamed
    assert sum(streamed.num_output_tokens) == len(streamed.all_ids) > 0
    assert streamed.num_input_tokens == len(tokenizer.apply_chat_template(QUESTION))
    assert tokenizer.decode(streamed.all_ids) == streamed.text

    whole = _ask(grpc, stream=False)
    assert len(whole.texts) == 1
    assert whole.text == streamed.text
    assert whole.all_ids == streamed.all_ids
    assert whole.num_output_tokens == [len(whole.all_ids)] and whole.finish_reason == "stop"


def test_http_generate_and_generate_stream_match_grpc(triton, grpc):
    reference = _ask(grpc, stream=True).text
    body = {"messages": json.dumps(QUESTION), "temperature": 0, "max_tokens": 32, "exclude_input_in_output": True,
            "return_finish_reason": True}
    status, [single] = http_generate(triton.http_url, body)
    assert status == 200, single
    assert single["text_output"] == reference and single["finish_reason"] == "stop"

    status, events = http_generate(triton.http_url, {**body, "stream": True}, stream=True)
    assert status == 200 and len(events) > 1
    assert "".join(e["text_output"] for e in events) == reference
    assert events[-1]["finish_reason"] == "stop"

    # vLLM-backend default: without exclude_input_in_output a non-streamed text prompt is repeated first.
    status, [plain] = http_generate(triton.http_url, {"text_input": "The capital of France is", "max_tokens": 4,
                                                      "temperature": 0})
    assert status == 200 and plain["text_output"].startswith("The capital of France is")


def test_16_concurrent_streams_equal_each_request_alone(grpc):
    subjects = ["France", "Spain", "Italy", "Germany", "Japan", "Egypt", "Canada", "Peru"]
    requests = [{"messages": json.dumps([{"role": "user", "content": f"Tell me one fact about {s}."}]),
                 "sampling_parameters": json.dumps({"temperature": 0, "max_tokens": 24}), "stream": True,
                 "exclude_input_in_output": True} for s in subjects]
    alone = [grpc.generate(r) for r in requests]
    assert all(r.error is None and r.all_ids for r in alone)
    ids = [grpc.send(requests[i % len(requests)]) for i in range(16)]
    together = grpc.collect(ids)
    for i, request_id in enumerate(ids):
        got = together[request_id]
        assert got.error is None
        assert got.all_ids == alone[i % len(requests)].all_ids, f"stream {i} differs when batched"
        assert got.text == alone[i % len(requests)].text


def test_two_turn_session_prefills_only_new_tokens(triton, grpc, tokenizer):
    turn1 = tokenizer.apply_chat_template([{"role": "user", "content": "My name is Ada. Say hello."}])
    turn2 = tokenizer.encode("\n<|im_start|>user\nWhat is my name?<|im_end|>\n<|im_start|>assistant\n",
                             add_special_tokens=False)
    greedy = json.dumps({"temperature": 0, "max_tokens": 24})
    sid = 424242
    first = grpc.generate({"input_ids": turn1, "sampling_parameters": greedy, "stream": True, **RETURN_ALL},
                          sequence_id=sid, sequence_start=True)
    assert first.error is None and first.num_input_tokens == len(turn1)

    # The model refreshes engine counters just after it sends a FINAL (and every 0.5 s): let the first turn land.
    before = _settled(triton.metrics_url, "deepinfer_prompt_tokens_computed_total")
    second = grpc.generate({"input_ids": turn2, "sampling_parameters": greedy, "stream": True, **RETURN_ALL},
                           sequence_id=sid, sequence_end=True)
    assert second.error is None and second.all_ids
    history = turn1 + first.all_ids
    assert second.num_input_tokens == len(history) + len(turn2)

    def computed() -> float:
        return metric(metrics(triton.metrics_url), "deepinfer_prompt_tokens_computed_total") - before
    wait_for(lambda: computed() > 0, what="the computed-prompt-tokens counter to move")
    # Only the new turn (plus at most the last history token, sampled but never fed) runs through the model.
    assert computed() <= len(turn2) + 1 < second.num_input_tokens

    stateless = grpc.generate({"input_ids": history + turn2, "sampling_parameters": greedy, "stream": True})
    assert stateless.error is None
    assert stateless.all_ids == second.all_ids and stateless.text == second.text

    # The session ended with the second turn: a third turn is refused.
    third = grpc.generate({"input_ids": turn2, "sampling_parameters": greedy}, sequence_id=sid)
    assert third.error is not None and "unknown session" in third.error


def test_cancel_mid_stream_frees_blocks(triton, grpc):
    values = metrics(triton.metrics_url)
    used_before = metric(values, "deepinfer_kv_blocks_used")
    aborted_before = metric(values, "deepinfer_requests_total", finish_reason="abort")
    canceller = StreamClient(triton.grpc_url)
    try:
        canceller.send({"text_input": "Count from one to one thousand:", "stream": True,
                        "sampling_parameters": json.dumps({"max_tokens": 400, "ignore_eos": True,
                                                           "temperature": 0})})
        for _ in range(3):  # a few deltas arrive: the request is running and holds blocks
            response, error = canceller.next_response()
            assert error is None
        wait_for(lambda: metric(metrics(triton.metrics_url), "deepinfer_num_requests_running") >= 1,
                  what="the request to show as running")
    finally:
        canceller.close(cancel=True)

    def settled() -> bool:
        values = metrics(triton.metrics_url)
        return (metric(values, "deepinfer_num_requests_running") == 0
                and metric(values, "deepinfer_kv_blocks_used") <= used_before
                and metric(values, "deepinfer_requests_total", finish_reason="abort") == aborted_before + 1)
    wait_for(settled, what="the cancelled request's blocks to return to the pool")
    after = grpc.generate({"messages": json.dumps(QUESTION), "sampling_parameters": GREEDY,
                           "exclude_input_in_output": True})
    assert after.error is None and "Paris" in after.text


BAD_HTTP = [
    ({"text_input": "hi", "sampling_parameters": "{max_tokens: 3"}, "sampling_parameters is not valid JSON"),
    ({"text_input": "hi", "sampling_parameters": '{"colour": 1}'}, "unknown sampling field 'colour'"),
    ({"text_input": "hi", "max_tokens": -1}, "max_tokens must be >= 1"),
    ({"text_input": "hi", "top_p": 2}, "top_p must be in (0, 1]"),
    ({"text_input": ""}, "text_input is empty"),
    ({"text_input": "hi", "sequence_id": 99999}, "unknown session 99999"),
]


@pytest.mark.parametrize("body, needle", BAD_HTTP, ids=[n.split()[0] + "-" + str(i) for i, (_, n) in enumerate(BAD_HTTP)])
def test_bad_http_request_is_an_error_and_the_server_keeps_serving(triton, body, needle):
    status, [answer] = http_generate(triton.http_url, body)
    assert status == 400 and needle in answer.get("error", ""), answer
    assert server_ready(triton.http_url)
    status, [ok] = http_generate(triton.http_url, {"text_input": "Hello", "max_tokens": 2})
    assert status == 200 and ok["text_output"].startswith("Hello")


@pytest.mark.parametrize("values, dtypes, needle", [
    ({"input_ids": list(range(600))}, None, "max_model_len is 512"),
    ({"input_ids": [1, 49152]}, None, "token id 49152 outside the vocabulary"),
    ({"input_ids": [1.0, 2.0]}, {"input_ids": "FP32"}, "input_ids"),
    ({"text_input": "hi"}, None, "unknown session"),
], ids=["over-max-model-len", "out-of-vocab", "wrong-dtype", "unknown-session"])
def test_bad_grpc_request_is_an_error_and_the_server_keeps_serving(triton, grpc, values, dtypes, needle):
    kwargs = {"sequence_id": 31337} if needle == "unknown session" else {}
    bad = grpc.generate(values, dtypes, **kwargs)
    assert bad.error is not None and needle in bad.error, bad.error
    if dtypes:
        assert "FP32" in bad.error or "datatype" in bad.error
    assert server_ready(triton.http_url)
    ok = grpc.generate({"text_input": "Hello", "sampling_parameters": json.dumps({"max_tokens": 2})})
    assert ok.error is None and ok.all_ids


def test_metrics_families_present_and_moving(triton, grpc):
    before = metrics(triton.metrics_url)
    for name in FAMILIES:
        metric(before, name)  # raises KeyError naming the missing family
    result = _ask(grpc, stream=True)
    assert result.error is None

    def moved() -> bool:
        after = metrics(triton.metrics_url)
        return all(metric(after, name) > metric(before, name) for name in (
            "deepinfer_prompt_tokens_total", "deepinfer_generation_tokens_total",
            "deepinfer_e2e_request_latency_seconds_count", "deepinfer_time_to_first_token_seconds_count"))
    wait_for(moved, what="the counters to move")
    after = metrics(triton.metrics_url)
    assert metric(after, "deepinfer_requests_total", finish_reason="stop") > metric(
        before, "deepinfer_requests_total", finish_reason="stop")
    assert metric(after, "deepinfer_kv_blocks_used") + metric(after, "deepinfer_kv_blocks_free") == 256
    # No speculation on this server: the spec families exist and stay at zero (tests/e2e/test_spec_e2e.py: > 0).
    assert metric(after, "deepinfer_spec_decode_draft_tokens_total") == 0
    assert metric(after, "deepinfer_spec_decode_mean_accepted_length") == 0


def test_concurrent_http_and_grpc_do_not_interfere(triton, grpc):
    """Requests arriving on both frontends at once are batched together and still answer correctly."""
    answers: list[str] = []

    def http_call() -> None:
        status, [out] = http_generate(triton.http_url, {"messages": json.dumps(QUESTION), "temperature": 0,
                                                        "max_tokens": 32, "exclude_input_in_output": True})
        answers.append(out["text_output"] if status == 200 else f"HTTP {status}")
    thread = threading.Thread(target=http_call)
    thread.start()
    result = _ask(grpc, stream=True)
    thread.join(timeout=300)
    assert answers == [result.text] and "Paris" in result.text


def test_deepinfer_chat_keeps_the_conversation(triton):
    """`deepinfer chat` (stdin piped): the second turn only makes sense with the first one's history."""
    run = subprocess.run([sys.executable, "-m", "backend_lib.frontend.cli.main", "chat", "--url", triton.grpc_url,
                          "--temperature", "0", "--max-tokens", "40"],
                         input="What is the capital of France?\nAnd of Italy?\n", capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr
    replies = [line for line in run.stdout.splitlines() if line.startswith("assistant> ")]
    assert len(replies) == 2, run.stdout
    assert "Paris" in replies[0] and "Rome" in replies[1], run.stdout


# ---- perf_analyzer, then the server's stop (last: it ends the module's server) ----------------------------------

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
    """Runs last in this module (it stops the server the tests above share): stop() makes the model abort in-flight
    requests (FINAL with "abort"), then Triton unloads the model (finalize) and exits cleanly."""
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
