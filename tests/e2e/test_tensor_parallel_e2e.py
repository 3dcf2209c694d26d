"""Tensor parallelism through a real tritonserver: `tensor_parallel_size=2` (the Triton stub is rank 0 and starts
rank 1) on a tiny fp8 DeepSeek-V3 with expert parallelism and MTP drafts. Streams, HTTP, sessions and cancellation
behave as with one rank, greedy output equals the one-rank offline engine, and no worker outlives the server."""
from __future__ import annotations

import json
import time

import pytest
from tests.helpers.triton_server import (StreamClient, http_generate, lose_a_rank, metric, metrics, new_server,
                                         stream_request, worker_pids)

from backend_lib.core.sampling_params import SamplingParams
from backend_lib.engine.offline import LLM
from backend_lib.tools.tiny import make_tiny

pytestmark = pytest.mark.e2e

SETTINGS = {"max_model_len": "256", "num_blocks": "128", "block_size": "16", "max_num_seqs": "8",
            "max_num_batched_tokens": "128", "spec_method": "mtp", "num_speculative_tokens": "2"}
PROMPTS = ["What is the capital of France?", "Once upon a time there was a tiny model",
           "Mixture of experts routes every token"]
GREEDY = {"temperature": 0, "max_tokens": 16, "ignore_eos": True}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny("deepseek_v3", tmp_path_factory.mktemp("tp_e2e") / "ds", fp8=True, mtp_layers=1)


@pytest.fixture(scope="module")
def reference(model_dir):
    with LLM(str(model_dir), **{k: int(v) for k, v in SETTINGS.items() if v.isdigit()}) as llm:
        return llm.generate(PROMPTS, SamplingParams(**GREEDY))


@pytest.fixture(scope="module")
def tp_server(model_dir, tmp_path_factory):
    overrides = {**SETTINGS, "model": str(model_dir), "tensor_parallel_size": "2", "enable_expert_parallel": "true"}
    with new_server(tmp_path_factory.mktemp("triton_tp"), overrides) as server:
        yield server


def _request(prompt: str, **extra) -> dict:
    return stream_request(prompt, GREEDY, **extra)


def test_streams_equal_the_one_rank_engine(tp_server, reference):
    client = StreamClient(tp_server.grpc_url)
    try:
        ids = [client.send(_request(p)) for p in PROMPTS]  # concurrent: batched across both ranks
        results = client.collect(ids)
    finally:
        client.close()
    for request_id, expected in zip(ids, reference):
        assert results[request_id].error is None
        assert results[request_id].all_ids == expected.token_ids
    body = {"text_input": PROMPTS[0], **GREEDY, "exclude_input_in_output": True}
    status, (response,) = http_generate(tp_server.http_url, body)
    assert status == 200 and response["text_output"] == reference[0].text


def test_session_turns_and_cancellation(tp_server, reference):
    client = StreamClient(tp_server.grpc_url)
    try:
        first = client.generate(_request(PROMPTS[1]), sequence_id=777, sequence_start=True)
        second = client.generate(_request(" and then"), sequence_id=777, sequence_end=True)
        assert first.error is None and first.all_ids == reference[1].token_ids
        assert second.error is None and len(second.all_ids) == GREEDY["max_tokens"]
        used_before = metric(metrics(tp_server.metrics_url), "deepinfer_kv_blocks_used")
        client.send(_request("Count to one thousand:", sampling_parameters=json.dumps(
            {"temperature": 0, "max_tokens": 200, "ignore_eos": True})))
        for _ in range(3):
            _, error = client.next_response()
            assert error is None
    finally:
        client.close(cancel=True)
    deadline = time.monotonic() + 30
    while metric(metrics(tp_server.metrics_url), "deepinfer_kv_blocks_used") > used_before:
        assert time.monotonic() < deadline, "the cancelled request's blocks did not return"
        time.sleep(0.3)


def test_no_worker_outlives_the_server(tp_server):
    """Runs after the tests above, on their server (one start fewer): it stops it."""
    started = worker_pids(session=tp_server.process.pid)
    assert len(started) == 1
    client = StreamClient(tp_server.grpc_url)
    try:
        assert client.generate(_request(PROMPTS[2])).error is None
    finally:
        client.close()
    tp_server.stop()
    deadline = time.monotonic() + 15
    while started & worker_pids():
        assert time.monotonic() < deadline, "a worker rank outlived tritonserver"
        time.sleep(0.2)


def test_killed_worker_fails_the_request_and_the_model_goes_not_ready(model_dir, tmp_path):
    overrides = {**SETTINGS, "model": str(model_dir), "tensor_parallel_size": "2", "distributed_timeout_s": "30"}
    with new_server(tmp_path, overrides) as server:
        started = worker_pids(session=server.process.pid)
        lose_a_rank(server, _request("Count to one thousand:", sampling_parameters=json.dumps(
            {"temperature": 0, "max_tokens": 200, "ignore_eos": True})), "tensor-parallel rank 1")
        ranks = worker_pids(session=server.process.pid) | started
    assert not ranks & worker_pids()
