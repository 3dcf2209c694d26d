"""The OpenAI front (`deepinfer serve --openai-port`) driven by the official `openai` client against a real server.

One server start for the module: tritonserver with the bundled SmolLM2 plus the front, as `deepinfer serve`
starts them. The gRPC path of the same server is the reference for greedy text and token counts.
"""
from __future__ import annotations

import http.client
import json
import time
from urllib.parse import urlparse

import jsonschema
import openai
import pytest
from tests.helpers.triton_server import (SERVER_PARAMETERS, StreamClient, http_generate, metric, metrics, new_server)

from backend_lib.core.errors import ErrorKind, from_wire

pytestmark = pytest.mark.e2e

MODEL = "deepinfer"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
STORY = "Once upon a time, in a small village by the sea,"
RETURN_COUNTS = {"return_finish_reason": True, "return_num_input_tokens": True, "return_num_output_tokens": True}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with new_server(tmp_path_factory.mktemp("openai"), dict(SERVER_PARAMETERS), openai=True) as server:
        yield server


@pytest.fixture(scope="module")
def client(served) -> openai.OpenAI:
    return openai.OpenAI(base_url=served.openai_url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def grpc(served):
    stream = StreamClient(served.grpc_url)
    yield stream
    stream.close()


def _grpc(grpc: StreamClient, prompt_input: str, prompt, **sampling):
    result = grpc.generate({prompt_input: prompt, "sampling_parameters": json.dumps(sampling), "stream": True,
                            **RETURN_COUNTS})
    assert result.error is None, result.error
    return result


def test_models_lists_the_served_model(client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError) as raised:
        client.models.retrieve("gpt-4o")
    assert raised.value.body["code"] == "model_not_found"


def test_chat_greedy_equals_grpc_streaming_and_not(client, grpc):
    reference = _grpc(grpc, "messages", json.dumps(QUESTION), temperature=0, max_tokens=12)
    reply = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=12)
    assert reply.object == "chat.completion" and reply.id.startswith("chatcmpl-") and reply.created > 0
    choice = reply.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == reference.text
    assert choice.finish_reason == reference.finish_reason
    assert reply.usage.prompt_tokens == reference.num_input_tokens
    assert reply.usage.completion_tokens == sum(reference.num_output_tokens)
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens

    chunks = list(client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0,
                                                 max_completion_tokens=12, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == reference.text
    assert len({c.id for c in chunks}) == 1 and chunks[0].object == "chat.completion.chunk"
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == \
        [reference.finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage == reply.usage


def test_completions_text_and_token_ids(client, grpc):
    reference = _grpc(grpc, "text_input", STORY, temperature=0, max_tokens=12, ignore_eos=True)
    reply = client.completions.create(model=MODEL, prompt=STORY, temperature=0, max_tokens=12,
                                      extra_body={"ignore_eos": True})
    assert reply.object == "text_completion" and reply.id.startswith("cmpl-")
    assert reply.choices[0].text == reference.text and reply.choices[0].finish_reason == "length"
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (reference.num_input_tokens, 12)

    streamed = list(client.completions.create(model=MODEL, prompt=STORY, temperature=0, max_tokens=12,
                                              stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in streamed) == reference.text
    assert streamed[-1].choices[0].finish_reason == "length"

    ids = grpc.generate({"text_input": STORY, "sampling_parameters": json.dumps({"max_tokens": 1, "temperature": 0}),
                         "stream": True}).all_ids  # any ids do: the model's own first token, then the story's
    by_ids = client.completions.create(model=MODEL, prompt=ids, temperature=0, max_tokens=8)
    assert by_ids.usage.prompt_tokens == len(ids)
    assert by_ids.choices[0].text == _grpc(grpc, "input_ids", ids, temperature=0, max_tokens=8).text


def test_without_max_tokens_chat_runs_to_the_context_end_and_completions_take_16(client):
    """OpenAI's (and vLLM's) defaults: a chat reply is not cut at 16 tokens, a completion is."""
    long_question = [{"role": "user", "content": "Repeat after me: " + "one two three " * 140}]
    chat = client.chat.completions.create(model=MODEL, messages=long_question, temperature=0,
                                          extra_body={"ignore_eos": True})
    assert chat.choices[0].finish_reason == "length" and chat.usage.completion_tokens > 16
    assert chat.usage.total_tokens == int(SERVER_PARAMETERS["max_model_len"])
    completion = client.completions.create(model=MODEL, prompt=STORY, temperature=0, extra_body={"ignore_eos": True})
    assert completion.usage.completion_tokens == 16


def test_logit_bias_bans_and_forces_tokens(client, grpc):
    """Through the default greedy path (the screened head): a biased row's logits are computed and biased."""
    greedy = grpc.generate({"text_input": STORY, "sampling_parameters": json.dumps(
        {"max_tokens": 3, "temperature": 0, "ignore_eos": True}), "stream": True}).all_ids
    plain = _grpc(grpc, "text_input", STORY, temperature=0, max_tokens=3, ignore_eos=True).text
    banned = client.completions.create(model=MODEL, prompt=STORY, temperature=0, max_tokens=3,
                                       logit_bias={str(greedy[0]): -100}, extra_body={"ignore_eos": True})
    assert banned.choices[0].text != plain
    forced = _grpc(grpc, "text_input", STORY, temperature=0, max_tokens=3, ignore_eos=True,
                   logit_bias={str(greedy[1]): 100})
    assert forced.all_ids == [greedy[1]] * 3
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model=MODEL, messages=QUESTION, logit_bias={"7": 101})
    assert raised.value.body["param"] == "logit_bias" and "[-100, 100]" in raised.value.body["message"]


def test_echo_gives_the_prompt_and_its_logprobs_as_lm_eval_reads_them(client, grpc):
    """lm-eval's loglikelihood call (token ids, echo, logprobs, max_tokens 1): a prompt token's logprob equals
    the one a call ending just before it reports for that token (forced there by logit_bias; logprobs are raw)."""
    entries = _grpc(grpc, "text_input", STORY, max_tokens=1, prompt_logprobs=1).prompt_logprobs  # the Triton API
    ids = [int(next(iter(entry))) for entry in entries]
    assert entries[0][str(ids[0])]["logprob"] is None and all(len(e) in (1, 2) for e in entries[1:])
    reply = client.completions.create(model=MODEL, prompt=STORY, echo=True, logprobs=2, max_tokens=1,
                                      temperature=0)
    choice = reply.choices[0]
    assert choice.text.startswith(STORY) and len(choice.text) > len(STORY)
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(ids) + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v <= 0 for v in lp.token_logprobs[1:]) and all(len(t) >= 1 for t in lp.top_logprobs[1:])
    assert "".join(lp.tokens[:len(ids)]) == STORY and lp.text_offset[1] == len(lp.tokens[0])
    by_ids = client.completions.create(model=MODEL, prompt=ids, echo=True, logprobs=1, max_tokens=1,
                                       temperature=0).choices[0]
    assert by_ids.text == choice.text  # the model decodes an input_ids prompt for the echo
    assert by_ids.logprobs.token_logprobs[1:] == pytest.approx(lp.token_logprobs[1:], abs=1e-5)
    for k in (3, len(ids) - 1):
        forced = client.completions.create(model=MODEL, prompt=ids[:k], max_tokens=1, logprobs=0, temperature=0,
                                           logit_bias={str(ids[k]): 100})
        assert forced.choices[0].logprobs.token_logprobs[0] == pytest.approx(lp.token_logprobs[k], abs=2e-3)
    streamed = list(client.completions.create(model=MODEL, prompt=STORY, echo=True, logprobs=1, max_tokens=2,
                                              temperature=0, stream=True))
    assert streamed[0].choices[0].text == STORY and len(streamed[0].choices[0].logprobs.tokens) == len(ids)
    plain = client.completions.create(model=MODEL, prompt=STORY, max_tokens=2, temperature=0).choices[0].text
    assert "".join(c.choices[0].text for c in streamed) == STORY + plain


def test_stop_string_cuts_the_text(client):
    free = client.completions.create(model=MODEL, prompt=STORY, temperature=0, max_tokens=16,
                                     extra_body={"ignore_eos": True}).choices[0].text
    word = free.split()[len(free.split()) // 2]
    stopped = client.completions.create(model=MODEL, prompt=STORY, temperature=0, max_tokens=16, stop=[word])
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].text == free[:free.index(word)]


def test_seeded_sampling_is_reproducible(client):
    def sample(seed: int) -> str:
        reply = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=1.0, top_p=0.95,
                                               seed=seed, max_tokens=8, extra_body={"top_k": 50})
        return reply.choices[0].message.content
    assert sample(1234) == sample(1234)


def test_logprobs_in_both_layouts(client):
    chat = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=4,
                                          logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)
    assert "".join(t.token for t in content) == chat.choices[0].message.content
    completion = client.completions.create(model=MODEL, prompt=STORY, temperature=0, max_tokens=4, logprobs=3)
    lp = completion.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert lp.text_offset[0] == 0 and all(len(top) == 3 for top in lp.top_logprobs)


@pytest.mark.parametrize("kwargs, param", [
    ({"temperature": -1.0}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"n": 65}, "n"),
    ({"n": 2, "max_tokens": 100000}, "max_tokens"),
    ({"extra_body": {"top_k": "many"}}, "top_k"),
], ids=["temperature", "top_p", "n", "max_tokens-of-choices", "top_k-type"])
def test_bad_field_is_a_400_naming_it(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model=MODEL, messages=QUESTION, **kwargs)
    error = raised.value.body
    assert raised.value.status_code == 400 and error["param"] == param and param in error["message"]
    assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize("prompt", ['"a\\ud800"', "[5, 2147483648]"], ids=["lone-surrogate", "id-past-int32"])
def test_prompts_triton_cannot_carry_are_a_400(served, prompt):
    """Raw JSON (the openai client cannot even encode a lone surrogate); both were a 500 before the front
    checked them (the gRPC request could not be built)."""
    status, body = _raw_post(served, "/completions", f'{{"model": "{MODEL}", "prompt": {prompt}, "max_tokens": 2}}',
                             "application/json")
    assert status == 400 and body["error"]["param"] == "prompt", body


def test_n_choices_each_sample_as_one_request_with_its_seed(client):
    """Choice j of a seeded call samples as a call with seed + j (vLLM's rule); usage counts the prompt once."""
    sampling = dict(temperature=1.0, max_tokens=8, extra_body={"top_k": 50, "ignore_eos": True})
    reply = client.chat.completions.create(model=MODEL, messages=QUESTION, n=3, seed=77, **sampling)
    singles = [client.chat.completions.create(model=MODEL, messages=QUESTION, seed=77 + j, **sampling)
               for j in range(3)]
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert [c.message.content for c in reply.choices] == [s.choices[0].message.content for s in singles]
    assert len({c.message.content for c in reply.choices}) > 1  # three seeds, not one sample thrice
    assert reply.usage.prompt_tokens == singles[0].usage.prompt_tokens
    assert reply.usage.completion_tokens == 3 * 8

    chunks = list(client.chat.completions.create(model=MODEL, messages=QUESTION, n=3, seed=77, stream=True,
                                                 stream_options={"include_usage": True}, **sampling))
    assert len({c.id for c in chunks}) == 1
    for j, single in enumerate(singles):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == j]
        assert mine[0].delta.role == "assistant"
        assert "".join(c.delta.content or "" for c in mine) == single.choices[0].message.content
        assert [c.finish_reason for c in mine if c.finish_reason] == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage == reply.usage


def test_a_batch_of_prompts_gets_a_choice_each_prompt_by_prompt(client):
    """OpenAI's layout: choice index = prompt * n + j; greedy, each choice is its prompt's own answer."""
    prompts = [STORY, "The capital of France is", "1, 2, 3,"]
    singles = [client.completions.create(model=MODEL, prompt=p, temperature=0, max_tokens=6) for p in prompts]
    batch = client.completions.create(model=MODEL, prompt=prompts, n=2, temperature=0, max_tokens=6, logprobs=1)
    assert [c.index for c in batch.choices] == list(range(6))
    assert [c.text for c in batch.choices] == [s.choices[0].text for s in singles for _ in range(2)]
    assert all(c.logprobs.text_offset[0] == 0 for c in batch.choices)
    assert batch.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles)
    assert batch.usage.completion_tokens == sum(2 * s.usage.completion_tokens for s in singles)
    streamed = list(client.completions.create(model=MODEL, prompt=prompts, temperature=0, max_tokens=6,
                                              stream=True))
    texts = ["".join(c.choices[0].text for c in streamed if c.choices[0].index == i) for i in range(3)]
    assert texts == [s.choices[0].text for s in singles]


def test_a_refused_choice_ends_the_call_and_its_siblings(served, client):
    """One prompt of a batch the model refuses (past max_model_len): a 400 naming it, and no sibling is left
    generating or holding blocks."""
    def used_and_aborted() -> tuple[float, float]:
        now = metrics(served.metrics_url)
        return (metric(now, "deepinfer_kv_blocks_used"),
                metric(now, "deepinfer_requests_total", finish_reason="abort"))

    aborted_before = used_and_aborted()[1]
    too_long = list(range(10, 10 + 5000))
    with pytest.raises(openai.BadRequestError) as raised:
        client.completions.create(model=MODEL, prompt=[[1, 2, 3], too_long], max_tokens=300,
                                  extra_body={"ignore_eos": True})
    assert raised.value.status_code == 400 and "prompt" in raised.value.body["message"]
    deadline = time.monotonic() + 20
    while used_and_aborted() != (0, aborted_before + 1) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert used_and_aborted() == (0, aborted_before + 1)  # the sibling was aborted, its blocks freed


def test_unknown_model_is_a_404(client):
    with pytest.raises(openai.NotFoundError) as raised:
        client.chat.completions.create(model="gpt-4o", messages=QUESTION)
    assert raised.value.body["code"] == "model_not_found" and "gpt-4o" in raised.value.body["message"]


def test_disconnect_mid_stream_frees_the_blocks(served):
    def used() -> float:
        return metric(metrics(served.metrics_url), "deepinfer_kv_blocks_used")

    def aborted() -> float:
        return metric(metrics(served.metrics_url), "deepinfer_requests_total", finish_reason="abort")

    aborted_before = aborted()
    body = {"model": MODEL, "messages": QUESTION, "max_tokens": 400, "ignore_eos": True, "stream": True}
    url = urlparse(served.openai_url)
    connection = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
    connection.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    response = connection.getresponse()
    assert response.status == 200
    for _ in range(8):
        assert response.readline().startswith((b"data: ", b"\n", b"\r\n"))
    deadline = time.monotonic() + 10
    while used() == 0 and time.monotonic() < deadline:  # the gauge refreshes every 0.5 s
        time.sleep(0.2)
    assert used() > 0
    connection.sock.shutdown(2)  # the client goes away mid-stream
    connection.close()
    deadline = time.monotonic() + 20
    while (used() > 0 or aborted() == aborted_before) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert used() == 0 and aborted() == aborted_before + 1


def test_a_disconnect_right_after_the_status_cancels_every_choice(served):
    """The client leaves before the choices' streams are merged (only their first chunks went out): each choice's
    request is aborted and its blocks freed, without waiting for garbage collection."""
    def used_and_aborted() -> tuple[float, float]:
        now = metrics(served.metrics_url)
        return (metric(now, "deepinfer_kv_blocks_used"),
                metric(now, "deepinfer_requests_total", finish_reason="abort"))

    aborted_before = used_and_aborted()[1]
    body = {"model": MODEL, "messages": QUESTION, "max_tokens": 400, "ignore_eos": True, "stream": True, "n": 2}
    url = urlparse(served.openai_url)
    connection = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
    connection.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    response = connection.getresponse()
    assert response.status == 200 and response.readline().startswith(b"data: ")  # the first role chunk
    connection.sock.shutdown(2)
    connection.close()
    deadline = time.monotonic() + 20
    while used_and_aborted() != (0, aborted_before + 2) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert used_and_aborted() == (0, aborted_before + 2)


def test_session_headers_continue_a_conversation(client):
    first_turn = [{"role": "user", "content": "My name is Ada. Say hello."}]
    second_turn = [{"role": "user", "content": "What is my name?"}]
    session = {"X-Session-Id": "openai-e2e-1"}
    first = client.chat.completions.create(model=MODEL, messages=first_turn, temperature=0, max_tokens=12,
                                           extra_headers={**session, "X-Session-Start": "true"})
    second = client.chat.completions.create(model=MODEL, messages=second_turn, temperature=0, max_tokens=12,
                                            extra_headers={**session, "X-Session-End": "true"})
    # The session turn sees the whole conversation: the same answer as the full history sent without a session.
    history = first_turn + [{"role": "assistant", "content": first.choices[0].message.content}] + second_turn
    stateless = client.chat.completions.create(model=MODEL, messages=history, temperature=0, max_tokens=12)
    assert second.choices[0].message.content == stateless.choices[0].message.content
    assert second.usage.prompt_tokens == stateless.usage.prompt_tokens
    # The session ended: another turn is refused, naming the session.
    with pytest.raises(openai.BadRequestError, match="unknown session"):
        client.chat.completions.create(model=MODEL, messages=second_turn, max_tokens=4, extra_headers=session)


def test_model_errors_leave_nothing_that_holds_the_server_at_stop(tmp_path):
    """A request the model refuses ends its gRPC call as completed. When the front cancelled it instead, Triton
    kept the model referenced in ~1 of 4 runs and waited out its whole exit timeout on shutdown."""
    with new_server(tmp_path, dict(SERVER_PARAMETERS), openai=True) as server:
        client = openai.OpenAI(base_url=server.openai_url, api_key="unused", max_retries=0, timeout=120)
        for turn in range(6):
            client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=4)
            with pytest.raises(openai.BadRequestError, match="unknown session"):
                client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=4,
                                               extra_headers={"X-Session-Id": f"never-started-{turn}"})
        started = time.monotonic()
        server.stop()
        assert time.monotonic() - started < 10, "Triton waited out its exit timeout (15 s): the model was held"


# One refusal rule, every way in: the same bad value reaches the client with the same field and kind through Triton
# gRPC (the stream's message), HTTP /generate and /generate_stream (Triton 2.51 answers 400 for every model error, so
# the kind travels in the message's detail, core/errors.py), and the OpenAI front (status of the kind, param the
# field). /v2/.../infer does not take a decoupled model (test_http_infer_cannot_reach_a_decoupled_model).
LONG_PROMPT = "hello " * 600  # past max_model_len (512) once tokenized
REFUSED = [
    # (fields the Triton model gets, OpenAI completions kwargs or None where the front has no such field, engine
    #  field, OpenAI param)
    ({"temperature": -1}, {"temperature": -1}, "temperature", "temperature"),
    ({"top_k": 0}, {"extra_body": {"top_k": 0}}, "top_k", "top_k"),
    ({"logprobs": 50}, {"logprobs": 50}, "logprobs", "logprobs"),  # past max_logprobs (20): a limit
    ({"colour": "blue"}, None, "colour", None),  # the OpenAI front's schema ignores unknown fields (OpenAI's way)
    ({"guided_regex": ""}, {"extra_body": {"guided_regex": ""}}, "guided_regex", "guided_regex"),
    ({"max_tokens": 4, "prompt": LONG_PROMPT}, {"max_tokens": 4, "prompt": LONG_PROMPT}, "prompt", "prompt"),
]


def _http_infer(http_url: str, prompt: str, parameters: dict) -> tuple[int, dict]:
    """POST /v2/models/deepinfer/infer (KServe JSON): text_input as a BYTES tensor, the fields as parameters."""
    body = {"inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [1], "data": [prompt]}],
            "parameters": parameters}
    connection = http.client.HTTPConnection(http_url, timeout=120)
    try:
        connection.request("POST", f"/v2/models/{MODEL}/infer", json.dumps(body),
                           {"Content-Type": "application/json"})
        response = connection.getresponse()
        return response.status, json.loads(response.read().decode() or "{}")
    finally:
        connection.close()


def test_http_infer_cannot_reach_a_decoupled_model(served):
    """KServe's /v2/models/<m>/infer is Triton's to refuse for a decoupled model (Triton 2.51: 501, its own message,
    no detail of ours): HTTP clients use /generate and /generate_stream. Fails when a Triton upgrade changes this,
    and the refusal test above then has one more way in to cover."""
    status, answer = _http_infer(served.http_url, "hi", {"temperature": -1})
    assert status == 501 and "decoupled" in answer.get("error", ""), (status, answer)
    assert from_wire(answer["error"]).field is None


@pytest.mark.parametrize("fields, openai_kwargs, field, param", REFUSED, ids=[r[2] for r in REFUSED])
def test_a_refusal_names_the_same_field_and_kind_through_every_front(served, grpc, client, fields, openai_kwargs,
                                                                     field, param):
    fields = dict(fields)
    prompt = fields.pop("prompt", "hi")
    via_grpc = grpc.generate({"text_input": prompt, "sampling_parameters": json.dumps(fields)})
    status, [via_generate] = http_generate(served.http_url, {"text_input": prompt, **fields})
    assert status == 400, via_generate
    status, via_stream = http_generate(served.http_url, {"text_input": prompt, "stream": True, **fields}, stream=True)
    assert status == 400 and len(via_stream) == 1, via_stream
    for path, message in (("grpc", via_grpc.error), ("generate", via_generate.get("error")),
                          ("generate_stream", via_stream[0].get("error"))):
        assert message, path
        wire = from_wire(message)
        assert (wire.kind, wire.field) == (ErrorKind.INVALID, field), (path, message)
    if openai_kwargs is not None:
        kwargs = {"prompt": "hi", **openai_kwargs}
        with pytest.raises(openai.BadRequestError) as raised:
            client.completions.create(model=MODEL, **kwargs)
        error = raised.value.body
        assert raised.value.status_code == 400 and error["param"] == param, error
        assert error["type"] == "invalid_request_error" and "deepinfer-error" not in error["message"]


# -- response_format and tools (SmolLM2's template ignores tools: required / named calls come from the grammar) ----

CITY_SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                                "sunny": {"type": "boolean"}},
               "required": ["city", "sunny"], "additionalProperties": False}
WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                                 "parameters": CITY_SCHEMA}}
TIME_TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"]}}}
WEATHER_QUESTION = [{"role": "user", "content": "Is it sunny in Paris? Answer in JSON."}]


def _streamed_chat(client, **kwargs):
    """(content, {index: {id, name, arguments}}, finish reasons) of a streamed chat, deltas concatenated."""
    content, calls, reasons = "", {}, []
    for chunk in client.chat.completions.create(model=MODEL, stream=True, **kwargs):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for entry in choice.delta.tool_calls or []:
                call = calls.setdefault(entry.index, {"id": None, "name": None, "arguments": ""})
                if entry.id is not None:
                    assert call["id"] is None and entry.type == "function"
                    call["id"], call["name"] = entry.id, entry.function.name
                call["arguments"] += (entry.function.arguments or "") if entry.function else ""
            if choice.finish_reason:
                reasons.append(choice.finish_reason)
    return content, calls, reasons


def test_response_format_json_schema_validates_streamed_or_not(client):
    response_format = {"type": "json_schema", "json_schema": {"name": "weather", "schema": CITY_SCHEMA,
                                                              "strict": True}}
    kwargs = dict(messages=WEATHER_QUESTION, temperature=0, max_tokens=60, response_format=response_format)
    reply = client.chat.completions.create(model=MODEL, **kwargs)
    text = reply.choices[0].message.content
    jsonschema.validate(json.loads(text), CITY_SCHEMA)
    assert reply.choices[0].finish_reason == "stop"
    content, calls, reasons = _streamed_chat(client, **kwargs)
    assert content == text and not calls and reasons == ["stop"]
    anything = client.chat.completions.create(model=MODEL, messages=WEATHER_QUESTION, temperature=0, max_tokens=8,
                                              response_format={"type": "json_object"})
    assert anything.choices[0].message.content.lstrip().startswith("{")  # (greedy SmolLM2 runs on past 60 tokens)


def test_a_schema_the_grammar_refuses_is_a_400_naming_the_field(client):
    bad = {"type": "object", "not": {"required": ["a"]}}
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=5, response_format={
            "type": "json_schema", "json_schema": {"name": "bad", "schema": bad}})
    assert raised.value.body["param"] == "response_format.json_schema.schema", raised.value.body
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=5, tool_choice="required", tools=[
            WEATHER_TOOL, {"type": "function", "function": {"name": "bad", "parameters": bad}}], stream=True)
    assert raised.value.body["param"] == "tools", raised.value.body
    assert client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=2).choices  # the server goes on


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}],
                         ids=["required", "named"])
def test_forced_tool_calls_validate_against_their_parameters_streamed_or_not(client, tool_choice):
    kwargs = dict(messages=WEATHER_QUESTION, temperature=0, max_tokens=80, tools=[WEATHER_TOOL, TIME_TOOL],
                  tool_choice=tool_choice)
    reply = client.chat.completions.create(model=MODEL, **kwargs)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls and not choice.message.content
    schemas = {tool["function"]["name"]: tool["function"]["parameters"] for tool in (WEATHER_TOOL, TIME_TOOL)}
    for call in choice.message.tool_calls:
        assert call.id.startswith("call_") and call.type == "function"
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    if isinstance(tool_choice, dict):
        assert [call.function.name for call in choice.message.tool_calls] == ["get_time"]
    content, calls, reasons = _streamed_chat(client, **kwargs)
    assert not content and reasons == ["tool_calls"]
    assert [(c["name"], c["arguments"]) for c in calls.values()] == \
        [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]


def test_a_two_turn_tool_conversation(client):
    tools = [WEATHER_TOOL]
    first = client.chat.completions.create(model=MODEL, messages=WEATHER_QUESTION, temperature=0, max_tokens=60,
                                           tools=tools, tool_choice={"type": "function",
                                                                     "function": {"name": "get_weather"}})
    [call] = first.choices[0].message.tool_calls
    messages = WEATHER_QUESTION + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "It is sunny in Paris, 24 degrees."}]
    second = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=12,
                                            tools=tools, tool_choice="none")
    answer = second.choices[0]
    assert answer.message.content and not answer.message.tool_calls and answer.finish_reason in ("stop", "length")
    # The call and its result reached the model: the prompt is the question's and more.
    question = client.chat.completions.create(model=MODEL, messages=WEATHER_QUESTION, max_tokens=1)
    assert second.usage.prompt_tokens > question.usage.prompt_tokens + 20


# -- tools on a template that drops them (SmolLM2's): the generic format, with the agent frameworks' request shapes --

# As the frameworks send them (none of them is installed here): langchain-openai's bind_tools (tool_choice left out:
# auto), pydantic-ai's function tools (strict schemas, tool_choice auto while text may end the run), instructor's
# PARALLEL_TOOLS (auto) and TOOLS (the response model's function named).
FRAMEWORK_SHAPES = {
    "langchain-bind-tools": {"tools": [WEATHER_TOOL, TIME_TOOL]},
    "pydantic-ai-function-tools": {"tools": [{"type": "function", "function": {**WEATHER_TOOL["function"],
                                                                                "strict": True}}],
                                   "tool_choice": "auto"},
    "instructor-parallel-tools": {"tools": [WEATHER_TOOL, TIME_TOOL], "tool_choice": "auto"},
    "instructor-tools": {"tools": [WEATHER_TOOL], "tool_choice": {"type": "function",
                                                                  "function": {"name": "get_weather"}}},
}
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in (WEATHER_TOOL, TIME_TOOL)}


def _check_calls_or_text(message, finish_reason) -> None:
    """A tool call whose arguments validate, or text; never a malformed call."""
    if message.tool_calls:
        assert finish_reason == "tool_calls" and not message.content
        for call in message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    else:
        assert message.content and not message.content.lstrip().startswith("{") and finish_reason in ("stop", "length")


@pytest.mark.parametrize("shape", FRAMEWORK_SHAPES.values(), ids=FRAMEWORK_SHAPES.keys())
def test_the_frameworks_tool_requests_get_calls_or_text_streamed_or_not(client, shape):
    kwargs = dict(messages=[{"role": "user", "content": "What is the weather in Paris?"}], temperature=0,
                  max_tokens=60, **shape)
    choice = client.chat.completions.create(model=MODEL, **kwargs).choices[0]
    _check_calls_or_text(choice.message, choice.finish_reason)
    if shape.get("tool_choice", "auto") != "auto":
        assert choice.message.tool_calls
    content, calls, reasons = _streamed_chat(client, **kwargs)
    assert (content or None) == choice.message.content and reasons == [choice.finish_reason]
    assert [(c["name"], c["arguments"]) for c in calls.values()] == \
        [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]


def test_required_without_parallel_calls_is_one_call(client):
    choice = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Weather in Paris and in Rome?"}], temperature=0,
        max_tokens=80, tools=[WEATHER_TOOL, TIME_TOOL], tool_choice="required", parallel_tool_calls=False).choices[0]
    assert len(choice.message.tool_calls) == 1
    _check_calls_or_text(choice.message, choice.finish_reason)


def test_a_tool_result_round_trip_in_the_generic_format(client):
    """An agent loop's second turn: the call and its result written back (generic format), tools still offered."""
    question = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = client.chat.completions.create(model=MODEL, messages=question, temperature=0, max_tokens=60,
                                           tools=[WEATHER_TOOL], tool_choice="required")
    calls = first.choices[0].message.tool_calls  # (greedy SmolLM2 may ask more than once: each gets its result)
    messages = question + [{"role": "assistant", "content": None, "tool_calls": [c.model_dump() for c in calls]}] + [
        {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 24 degrees."} for call in calls]
    second = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=60,
                                            tools=[WEATHER_TOOL])
    _check_calls_or_text(second.choices[0].message, second.choices[0].finish_reason)
    assert second.usage.prompt_tokens > first.usage.prompt_tokens + 20  # the call and its result reached the model


def _raw_post(served, path: str, body: str, content_type: str | None) -> tuple[int, dict]:
    """A POST the openai client cannot send (a broken body, another Content-Type)."""
    url = urlparse(served.openai_url)
    connection = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
    try:
        connection.request("POST", f"{url.path}{path}", body=body,
                           headers={"Content-Type": content_type} if content_type else {})
        response = connection.getresponse()
        return response.status, json.loads(response.read())
    finally:
        connection.close()


def test_broken_bodies_are_refused_saying_what_is_wrong(served):
    status, body = _raw_post(served, "/chat/completions", f'{{"model": "{MODEL}", "messages": [}}', "application/json")
    assert status == 400 and body["error"]["param"] is None, body
    assert body["error"]["message"] == "the request body is not valid JSON: Expecting value at character 36"
    status, body = _raw_post(served, "/chat/completions", json.dumps({"model": MODEL, "messages": QUESTION}),
                             "application/x-www-form-urlencoded")  # what curl -d sends without -H
    assert status == 415 and "Content-Type: application/json" in body["error"]["message"], body
    status, body = _raw_post(served, "/completions", "[1, 2]", "application/json")
    assert status == 400 and body["error"]["message"] == "the request body must be a JSON object, got an array"
