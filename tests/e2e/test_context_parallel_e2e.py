"""Context parallelism through a real tritonserver: `context_parallel_size=2` (the Triton stub is context rank 0 and
starts rank 1, each holding every other KV block) on a tiny Llama: streamed greedy output equals the one-rank
offline engine for short and long prompts (long ones' prefill rows split across the ranks), sessions keep their
split KV between turns, and a killed context rank fails the model (not ready) with the rank named, leaving no
process behind."""
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

SETTINGS = {"max_model_len": "1024", "num_blocks": "24", "block_size": "16", "max_num_seqs": "8",
            "max_num_batched_tokens": "128", "context_parallel_min_tokens": "32"}
STORY = "Once upon a time there was a lighthouse keeper who counted the ships. "
PROMPTS = ["What is the capital of France?", STORY * 9, "0123456789 + - * / ="]
GREEDY = {"temperature": 0, "max_tokens": 12, "ignore_eos": True}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny("llama", tmp_path_factory.mktemp("cp_e2e") / "llama")


@pytest.fixture(scope="module")
def reference(model_dir):
    settings = {k: int(v) for k, v in SETTINGS.items() if not k.startswith("context")}
    with LLM(str(model_dir), **{**settings, "num_blocks": 48}) as llm:  # one rank holding both ranks' pools
        return llm.generate(PROMPTS, SamplingParams(**GREEDY))


@pytest.fixture(scope="module")
def cp_server(model_dir, tmp_path_factory):
    # distributed_timeout_s: the last test kills a rank, and the step fails within it at most
    overrides = {**SETTINGS, "model": str(model_dir), "context_parallel_size": "2", "distributed_timeout_s": "30"}
    with new_server(tmp_path_factory.mktemp("triton_cp"), overrides) as server:
        yield server


def _request(prompt: str, **extra) -> dict:
    return stream_request(prompt, GREEDY, **extra)


def test_streams_equal_the_one_rank_engine(cp_server, reference):
    assert reference[1].num_prompt_tokens > 24 * 16  # more than one rank's pool holds
    client = StreamClient(cp_server.grpc_url)
    try:
        ids = [client.send(_request(p)) for p in PROMPTS]
        results = client.collect(ids)
    finally:
        client.close()
    for request_id, expected in zip(ids, reference):
        assert results[request_id].error is None
        assert results[request_id].all_ids == expected.token_ids
    status, (response,) = http_generate(cp_server.http_url, {"text_input": PROMPTS[0], **GREEDY,
                                                             "exclude_input_in_output": True})
    assert status == 200 and response["text_output"] == reference[0].text


def test_session_turns_keep_their_split_kv(cp_server, reference):
    client = StreamClient(cp_server.grpc_url)
    try:
        used_before = metric(metrics(cp_server.metrics_url), "deepinfer_kv_blocks_used")
        first = client.generate(_request(PROMPTS[2]), sequence_id=4242, sequence_start=True)
        second = client.generate(_request(" and then"), sequence_id=4242, sequence_end=True)
        assert first.error is None and first.all_ids == reference[2].token_ids
        assert second.error is None and len(second.all_ids) == GREEDY["max_tokens"]
    finally:
        client.close()
    deadline = time.monotonic() + 30
    while metric(metrics(cp_server.metrics_url), "deepinfer_kv_blocks_used") > used_before:
        assert time.monotonic() < deadline, "the ended session's blocks did not return"
        time.sleep(0.3)


def test_killed_context_rank_fails_the_model_naming_it(cp_server):
    """Runs last, on the server the tests above share (one start fewer): it kills a rank, then stops the server."""
    started = worker_pids(session=cp_server.process.pid)
    lose_a_rank(cp_server, _request("Count to one thousand:", sampling_parameters=json.dumps(
        {"temperature": 0, "max_tokens": 400, "ignore_eos": True})), "context-parallel rank 1")
    ranks = worker_pids(session=cp_server.process.pid) | started
    cp_server.stop()
    assert not ranks & worker_pids()
