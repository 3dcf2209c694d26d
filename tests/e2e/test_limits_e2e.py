"""Limits through a real tritonserver: max_tokens beyond the context is a 400 naming it; a burst past
max_waiting_requests and a session START past max_sessions are refused at once ("server busy", Triton's
UNAVAILABLE) while the admitted requests complete; /metrics counts both refusals. The same server (one start) has
stream_interval 4: the first token streams alone, later deltas come 4 tokens at a time (the last may be shorter), and
the streamed text equals the same greedy request sent non-streaming. It schedules by priority
(scheduling_policy=priority, which keeps equal priorities first come, first served): a late high-priority request
takes the first seat that frees, ahead of a low-priority one waiting before it.

Triton 2.51's /generate answers 400 for every model error whatever its Triton code (measured here with
INVALID_ARG, INTERNAL and UNAVAILABLE); newer servers map UNAVAILABLE to 503. So a refusal is told apart by its
message here, and 503 is accepted for when the server is upgraded."""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
from tests.helpers.triton_server import (SERVER_PARAMETERS, StreamClient, http_generate, metric, metrics, new_server,
                                         server_ready, wait_for)

from backend_lib.frontend.triton.server import TritonServer

pytestmark = pytest.mark.e2e

MAX_MODEL_LEN = 256
BURST = 12
NEW_TOKENS = 24
BUSY = (400, 503)  # 503 where the server maps UNAVAILABLE to it (see above)
INTERVAL = 4
MAX_TOKENS = 21


@pytest.fixture(scope="module")
def small_triton(tmp_path_factory) -> TritonServer:
    # 2 running + 2 waiting at most: a burst of 12 must be partly refused. stream_interval changes only how the
    # streamed deltas are grouped (the limits test's requests are not streamed).
    overrides = {**SERVER_PARAMETERS, "max_model_len": str(MAX_MODEL_LEN), "max_num_seqs": "2",
                 "max_waiting_requests": "2", "max_sessions": "1", "stream_interval": str(INTERVAL),
                 "scheduling_policy": "priority"}
    with new_server(tmp_path_factory.mktemp("triton_limits"), overrides) as server:
        yield server


def test_limits_refuse_clearly_and_the_admitted_requests_complete(small_triton):
    url = small_triton.http_url
    status, [answer] = http_generate(url, {"text_input": "Hello", "max_tokens": 1_000_000_000})
    error = answer.get("error", "")
    assert status == 400 and "max_tokens is 1000000000" in error, answer
    assert f"max_model_len is {MAX_MODEL_LEN}" in error
    assert "prompt has" in error

    body = {"text_input": "Count: one, two, three,", "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True,
            "return_num_output_tokens": True}
    with ThreadPoolExecutor(max_workers=BURST) as pool:
        results = list(pool.map(lambda _: http_generate(url, body), range(BURST)))
    refused = [answer for status, [answer] in results if status in BUSY]
    done = [answer for status, [answer] in results if status == 200]
    assert len(refused) + len(done) == BURST, [(status, answer.get("error")) for status, [answer] in results]
    assert refused and done, [status for status, _ in results]
    assert all(answer["error"].startswith("server busy:") and "(max_waiting_requests 2)" in answer["error"]
               for answer in refused), refused
    assert all(answer["num_output_tokens"] == NEW_TOKENS for answer in done), done

    status, _ = http_generate(url, {"text_input": "Hi", "max_tokens": 2, "sequence_id": 41, "sequence_start": True})
    assert status == 200
    status, [answer] = http_generate(url, {"text_input": "Hi", "max_tokens": 2, "sequence_id": 42,
                                           "sequence_start": True})
    assert status in BUSY and answer["error"].startswith("server busy:") and "(max_sessions 1)" in answer["error"]
    status, _ = http_generate(url, {"text_input": " Bye", "max_tokens": 2, "sequence_id": 41, "sequence_end": True})
    assert status == 200

    def counted() -> bool:
        values = metrics(small_triton.metrics_url)
        return (metric(values, "deepinfer_requests_refused_waiting_total") == len(refused)
                and metric(values, "deepinfer_sessions_refused_total") == 1)
    wait_for(counted, what="the refusal counters to reach what was refused")
    assert server_ready(url)
    status, [ok] = http_generate(url, {"text_input": "Hello", "max_tokens": 2})
    assert status == 200 and ok["text_output"].startswith("Hello")


def test_stream_interval_groups_tokens_after_the_first(small_triton):
    client = StreamClient(small_triton.grpc_url)
    try:
        request = {"text_input": "Count from one to twenty:", "exclude_input_in_output": True,
                   "sampling_parameters": json.dumps({"temperature": 0, "max_tokens": MAX_TOKENS,
                                                      "ignore_eos": True})}
        streamed = client.generate({**request, "stream": True})
        whole = client.generate({**request, "stream": False})
    finally:
        client.close()
    assert streamed.error is None and whole.error is None
    sizes = [len(ids) for ids in streamed.ids if ids]
    assert sizes[0] == 1 and sum(sizes) == MAX_TOKENS
    assert all(size >= INTERVAL for size in sizes[1:-1]), sizes  # held until INTERVAL tokens wait
    assert len(sizes) <= 2 + MAX_TOKENS // INTERVAL, sizes
    assert streamed.text == whole.text and [t for ids in streamed.ids for t in ids] == whole.ids[0]


def test_a_late_high_priority_request_takes_the_first_free_seat(small_triton):
    """Both seats held (short, long), low waiting; high (priority 0 < 5) comes later and still ends before low. Queue
    time is on /metrics by priority."""
    url, finished = small_triton.http_url, []

    def run(name: str, priority: int, max_tokens: int) -> int:
        status, _ = http_generate(url, {"text_input": "Count: one, two, three,", "max_tokens": max_tokens,
                                        "temperature": 0, "ignore_eos": True, "priority": priority})
        finished.append(name)
        return status

    def gauge(name: str) -> float:
        return metric(metrics(small_triton.metrics_url), name)

    with ThreadPoolExecutor(max_workers=4) as pool:
        futures = [pool.submit(run, "short", 5, 64), pool.submit(run, "long", 5, 128)]
        wait_for(lambda: gauge("deepinfer_num_requests_running") == 2, what="both seats taken")
        futures.append(pool.submit(run, "low", 5, 8))
        wait_for(lambda: gauge("deepinfer_num_requests_waiting") == 1, what="low waiting")
        futures.append(pool.submit(run, "high", 0, 8))
        assert [future.result() for future in futures] == [200] * 4
    assert finished.index("short") < finished.index("high") < finished.index("low"), finished
    values = metrics(small_triton.metrics_url)
    for priority in ("0", "5"):
        assert metric(values, "deepinfer_request_queue_time_seconds_count", priority=priority) >= 1
