"""Speculative decoding served by a real tritonserver: greedy streams equal the offline engine without speculation
(alone and 4 concurrent), and /metrics exports the spec counters. Two servers: n-gram drafts with compiled regions
(compile_backend=aot_eager: compiled greedy output through Triton equals the eager engine's), and DSpark drafts
(spec_method=dspark, a random drafter: lossless is what counts, it accepts little) with the OpenAI front, whose
chat completions give the same text, and /metrics' chosen lengths and survival calibration."""
from __future__ import annotations

import json
import re
import time

import openai
import pytest
from tests.helpers.triton_server import StreamClient, metric, metrics, new_server

from backend_lib.core.model_path import default_model_path
from backend_lib.core.sampling_params import SamplingParams
from backend_lib.engine.offline import LLM
from backend_lib.frontend.triton.server import TritonServer
from backend_lib.tools.drafter import write_random_drafter

pytestmark = pytest.mark.e2e

# Small KV and context: fast load; 4 requests of <= 100 + 32 tokens fit. One width bucket (16 blocks = 256
# tokens) and batch buckets 1 and 4 (2 or 3 rows pad to 4) keep the compiled variant's warm-up to a handful of graphs.
ENGINE_SETTINGS = {"max_model_len": "256", "num_blocks": "96", "block_size": "16", "max_num_seqs": "4",
                   "max_num_batched_tokens": "256"}
SPEC_SETTINGS = {"spec_method": "ngram", "num_speculative_tokens": "3", "ngram_min": "1", "ngram_max": "4"}
DSPARK_SETTINGS = {"spec_method": "dspark", "num_speculative_tokens": "3", "spec_schedule": "fixed"}
COMPILE_SETTINGS = {"compile_backend": "aot_eager", "batch_buckets": "1,4", "width_buckets": "16"}
MAX_TOKENS = 32
# the file's exact weights on both sides: a compiled server's packed int8 GEMMs need not round as the eager ones
EXACT_WEIGHTS = {"weight_format": "dequantize"}
GREEDY = {"temperature": 0, "max_tokens": MAX_TOKENS}

TEXT = ("The lighthouse keeper climbed the spiral stairs every evening at dusk, lit the great lamp, and wrote the "
        "names of passing ships in a worn leather book.")
# Copy-heavy prompts: the output repeats the prompt, so n-gram drafts are accepted several tokens a step.
PROMPTS = [
    [{"role": "user", "content": f"Repeat the following text exactly.\n\n{TEXT}"}],
    [{"role": "user", "content": f"Rewrite this text, replacing 'lighthouse keeper' with 'old sailor':\n\n{TEXT}"}],
    [{"role": "user", "content": f"Copy this sentence twice: {TEXT[:60]}"}],
    [{"role": "user", "content": "Name three colours."}],
]
COMPILED_LINE = re.compile(r"deepinfer: compiled (\d+) model and (\d+) sampler graphs with aot_eager in ([\d.]+) s")


@pytest.fixture(scope="module")
def reference() -> list:
    """The offline engine, eager and without speculation, with the server's engine settings."""
    llm = LLM("", weight_format=EXACT_WEIGHTS["weight_format"], **{k: int(v) for k, v in ENGINE_SETTINGS.items()})
    return llm.generate(PROMPTS, SamplingParams(**GREEDY))


@pytest.fixture(scope="module", params=["dspark", "aot_eager"])
def spec_triton(request, tmp_path_factory) -> TritonServer:
    compiled = request.param == "aot_eager"
    workdir = tmp_path_factory.mktemp(f"triton_spec_{request.param}")
    if compiled:
        spec = {**SPEC_SETTINGS, **COMPILE_SETTINGS}
    else:  # eager (block drafters run eager), with the OpenAI front
        drafter = write_random_drafter(default_model_path(), str(workdir / "drafter"), seed=3, block_size=4,
                                       markov_rank=32, num_draft_layers=1)
        spec = {**DSPARK_SETTINGS, "speculative_model": drafter}
    started = time.monotonic()
    with new_server(workdir, {**ENGINE_SETTINGS, **EXACT_WEIGHTS, **spec}, exit_timeout_s=5,
                    openai=not compiled) as server:
        load_s = time.monotonic() - started
        if compiled:
            found = COMPILED_LINE.search(server.log_path.read_text(errors="replace"))
            # regions.py prints this line after the warm-up (compile_progress); without it the engine ran eager.
            assert found, ("compile_backend=aot_eager had no effect: no compiled-regions report in the server log "
                           f"(loaded in {load_s:.0f} s); does LLMEngine pass config.compile to ModelRunner?\n"
                           f"{server.log_tail()}")
            assert int(found.group(1)) > 0
        yield server

def _method(server: TritonServer) -> str:
    return server.overrides["spec_method"]


@pytest.fixture()
def grpc(spec_triton):
    client = StreamClient(spec_triton.grpc_url)
    yield client
    client.close()


def _request(messages: list[dict]) -> dict:
    return {"messages": json.dumps(messages), "sampling_parameters": json.dumps(GREEDY), "stream": True,
            "exclude_input_in_output": True, "return_finish_reason": True}


def _assert_same(result, expected) -> None:
    assert result.error is None, result.error
    assert result.all_ids == expected.token_ids
    assert result.text == expected.text
    assert result.finish_reason == expected.finish_reason
    assert len(result.ids) > 1  # really streamed, not one final response


def test_single_request_streams_the_plain_greedy_tokens(spec_triton, grpc, reference):
    assert len(reference[0].token_ids) >= 16  # a long enough copy for drafts to matter
    result = grpc.generate(_request(PROMPTS[0]))
    _assert_same(result, reference[0])
    if _method(spec_triton) == "ngram":  # accepted copies: several tokens in one response
        assert max(len(chunk) for chunk in result.ids) > 1


def test_four_concurrent_requests_stream_the_plain_greedy_tokens(grpc, reference):
    # All sent before any is collected: the engine verifies their drafts in the same steps.
    request_ids = [grpc.send(_request(p)) for p in PROMPTS]
    results = grpc.collect(request_ids)
    for request_id, expected in zip(request_ids, reference):
        _assert_same(results[request_id], expected)


def test_metrics_export_spec_counters(spec_triton, grpc, reference):
    _assert_same(grpc.generate(_request(PROMPTS[1])), reference[1])  # at least one copy request on this server
    deadline = time.monotonic() + 30  # the model refreshes engine stats every 0.5 s
    while True:
        values = metrics(spec_triton.metrics_url)
        drafts = metric(values, "deepinfer_spec_decode_draft_tokens_total")
        if drafts > 0 or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    accepted = metric(values, "deepinfer_spec_decode_accepted_tokens_total")
    num_drafts = metric(values, "deepinfer_spec_decode_num_drafts_total")
    assert drafts > 0 and num_drafts > 0 and 0 <= accepted <= drafts
    per_position = [metric(values, "deepinfer_spec_decode_acceptance_rate_per_position", position=str(j))
                    for j in range(3)]
    assert all(0.0 <= rate <= 1.0 for rate in per_position)
    if _method(spec_triton) == "ngram":  # the copy prompts are accepted
        assert accepted > 0 and per_position[0] > 0
        assert metric(values, "deepinfer_spec_decode_acceptance_rate") > 0
        assert metric(values, "deepinfer_spec_decode_mean_accepted_length") > 1.0
        return
    # DSpark at a fixed length: every request-step given 3 drafts; the head's survival next to the observed one
    assert metric(values, "deepinfer_spec_decode_chosen_length_total", length="3") > 0
    for family in ("predicted", "observed"):
        survival = metric(values, f"deepinfer_spec_decode_{family}_survival_per_position", position="0")
        assert 0.0 <= survival <= 1.0


def test_openai_chat_completions_equal_the_plain_greedy_text(spec_triton, reference):
    if _method(spec_triton) != "dspark":
        pytest.skip("the OpenAI front runs beside the DSpark server")
    client = openai.OpenAI(base_url=spec_triton.openai_url, api_key="unused", max_retries=0, timeout=120)
    reply = client.chat.completions.create(model="deepinfer", messages=PROMPTS[3], **GREEDY)
    assert reply.choices[0].message.content == reference[3].text
    chunks = client.chat.completions.create(model="deepinfer", messages=PROMPTS[0], stream=True, **GREEDY)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == reference[0].text
