"""Tiny DeepSeek-V3, DeepSeek-V4 and DeepSeek-V4.1 models served through a real tritonserver (the same model.py, no
per-arch code) stream the same tokens as the offline engine, over gRPC streaming and HTTP, and in two-turn sessions."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from tests.helpers.triton_server import StreamClient, http_generate, new_server

from backend_lib.core.outputs import SessionControl
from backend_lib.core.sampling_params import SamplingParams
from backend_lib.engine.offline import LLM
from backend_lib.frontend.triton.server import TritonServer
from backend_lib.tools.tiny import make_tiny

pytestmark = pytest.mark.e2e

# Small KV and context: the tiny model loads in seconds and three 32-token requests fit many times over.
ENGINE_SETTINGS = {"max_model_len": "256", "num_blocks": "64", "block_size": "16", "max_num_seqs": "4",
                   "max_num_batched_tokens": "128"}
GREEDY = {"temperature": 0, "max_tokens": 32, "ignore_eos": True}
TEXT_PROMPTS = ("The quick brown fox", "Mixture of experts routes every token")
ID_PROMPT = [5, 17, 42, 99, 150, 7, 211, 64]


@pytest.fixture(scope="module", params=["deepseek_v3", "deepseek_v4", "deepseek_v4_engram", "deepseek_v41"])
def deepseek_dir(request, tmp_path_factory) -> Path:
    if request.param == "deepseek_v4_engram":  # Engram on layers 1 and 3 (host tables, conv state per session)
        return make_tiny("deepseek_v4", tmp_path_factory.mktemp("tiny_engram"), engram_layers=[1, 3])
    return make_tiny(request.param, tmp_path_factory.mktemp(f"tiny_{request.param}"))


@pytest.fixture(scope="module")
def deepseek_triton(tmp_path_factory, deepseek_dir) -> TritonServer:
    overrides = {**ENGINE_SETTINGS, "model": str(deepseek_dir)}
    with new_server(tmp_path_factory.mktemp("triton_deepseek"), overrides, exit_timeout_s=5) as server:
        yield server

@pytest.fixture(scope="module")
def offline(deepseek_dir):
    """What the in-process engine gives for each prompt, with the server's engine settings."""
    llm = LLM(str(deepseek_dir), **{k: int(v) for k, v in ENGINE_SETTINGS.items()})
    prompts = [*TEXT_PROMPTS, ID_PROMPT]
    results = llm.generate(prompts, SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True))
    return {repr(p): r for p, r in zip(prompts, results)}


@pytest.fixture()
def grpc(deepseek_triton):
    client = StreamClient(deepseek_triton.grpc_url)
    yield client
    client.close()


def _request(prompt: str | list[int]) -> dict:
    key = "text_input" if isinstance(prompt, str) else "input_ids"
    return {key: prompt, "sampling_parameters": json.dumps(GREEDY), "stream": True,
            "exclude_input_in_output": True, "return_finish_reason": True, "return_num_output_tokens": True}


def _assert_same(result, expected) -> None:
    assert result.error is None, result.error
    assert len(expected.token_ids) == 32 and expected.finish_reason == "length"
    assert result.all_ids == expected.token_ids
    assert result.text == expected.text
    assert result.finish_reason == "length"
    assert sum(result.num_output_tokens) == 32
    assert len(result.ids) > 1  # really streamed, not one final response


def test_text_prompt_streams_offline_tokens(grpc, offline):
    prompt = TEXT_PROMPTS[0]
    _assert_same(grpc.generate(_request(prompt)), offline[repr(prompt)])


def test_concurrent_text_and_input_ids_stream_offline_tokens(grpc, offline):
    prompts = [TEXT_PROMPTS[1], ID_PROMPT]
    # Both sent before either is collected: the engine batches them in the same steps.
    request_ids = [grpc.send(_request(p)) for p in prompts]
    results = grpc.collect(request_ids)
    for request_id, prompt in zip(request_ids, prompts):
        _assert_same(results[request_id], offline[repr(prompt)])


def test_http_generate_and_generate_stream_give_offline_tokens(deepseek_triton, offline):
    prompt = TEXT_PROMPTS[0]
    expected = offline[repr(prompt)]
    body = {"text_input": prompt, **GREEDY, "exclude_input_in_output": True, "return_finish_reason": True}
    status, [single] = http_generate(deepseek_triton.http_url, body)
    assert status == 200, single
    assert single["text_output"] == expected.text and single["finish_reason"] == "length"
    status, events = http_generate(deepseek_triton.http_url, {**body, "stream": True}, stream=True)
    assert status == 200 and len(events) > 1
    assert "".join(e["text_output"] for e in events) == expected.text


def test_session_turns_stream_what_the_offline_engine_gives(grpc, deepseek_dir):
    """Two turns of one sequence: the second prefills only its new tokens on the kept state (KV, rings and, with
    Engram, the ShortConv history) and streams what the offline engine's session gives."""
    first = grpc.generate(_request(ID_PROMPT), sequence_id=4242, sequence_start=True)
    second = grpc.generate(_request([9, 8, 7]), sequence_id=4242, sequence_end=True)
    assert first.error is None and second.error is None
    engine = LLM(str(deepseek_dir), **{k: int(v) for k, v in ENGINE_SETTINGS.items()}).engine
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    expected = []
    for rid, prompt, control in (("a", ID_PROMPT, SessionControl("s", start=True)),
                                 ("b", [9, 8, 7], SessionControl("s", end=True))):
        engine.add_request(rid, prompt, params, session=control)
        ids = []
        while engine.has_unfinished_requests():
            ids += [t for out in engine.step() for t in out.new_token_ids]
        expected.append(ids)
    engine.close()
    assert [first.all_ids, second.all_ids] == expected
