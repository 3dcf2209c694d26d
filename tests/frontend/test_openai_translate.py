"""The OpenAI front's translation layer without a server: requests -> model requests, responses -> OpenAI."""
from __future__ import annotations

import json

import pytest

from backend_lib.core.errors import ErrorKind, RequestError, WireError, busy, from_wire, internal, to_wire
from backend_lib.frontend.openai import translate
from backend_lib.frontend.openai.errors import OpenAIError, from_model_error
from backend_lib.frontend.openai.schema import ChatCompletionRequest, CompletionRequest
from backend_lib.frontend.openai.translate import ModelDelta, Session, Totals
from backend_lib.frontend.openai.triton_stream import _bytes_elements, build_infer_request, parse_response


def _chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="deepinfer", messages=[{"role": "user", "content": "hi"}], **fields)


def test_chat_request_maps_fields_and_messages():
    request = ChatCompletionRequest(model="deepinfer", messages=[
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
        max_completion_tokens=7, temperature=0.5, stop="x", seed=3, logprobs=True, top_logprobs=2, top_k=5,
        ignore_eos=True, user="someone", logit_bias={"5": -100})
    [model] = translate.chat_requests(request, None)
    assert model.prompt_input == "messages"
    assert json.loads(model.prompt) == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "ab"}]
    assert model.sampling == {"max_tokens": 7, "temperature": 0.5, "stop": "x", "seed": 3, "logprobs": 2,
                              "top_k": 5, "ignore_eos": True, "logit_bias": {"5": -100}}
    assert model.logprobs and model.field_names == {"logprobs": "top_logprobs", "max_tokens": "max_completion_tokens"}


@pytest.mark.parametrize("fields, param", [
    ({"n": 0}, "n"), ({"n": 65}, "n"), ({"tool_choice": "required"}, "tool_choice"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"), ({"top_logprobs": 2}, "top_logprobs"),
    ({"max_tokens": 1, "max_completion_tokens": 2}, "max_completion_tokens"),
])
def test_chat_fields_we_cannot_honour_are_refused(fields, param):
    with pytest.raises(OpenAIError) as raised:
        translate.chat_requests(_chat(**fields), None)
    assert raised.value.status == 400 and raised.value.param == param


def test_completion_prompts():
    [text] = translate.completion_requests(CompletionRequest(model="m", prompt="abc"), None)
    assert text.prompt_input == "text_input"
    [by_ids] = translate.completion_requests(CompletionRequest(model="m", prompt=[[1, 2, 3]], logprobs=2), None)
    assert (by_ids.prompt_input, by_ids.prompt, by_ids.sampling) == ("input_ids", [1, 2, 3], {"logprobs": 2})
    with pytest.raises(OpenAIError, match="echo of a token-id prompt needs stream: false") as raised:
        translate.completion_requests(CompletionRequest(model="m", prompt=[1, 2], echo=True, stream=True), None)
    assert raised.value.param == "echo"


def test_echo_asks_the_model_for_the_prompt_and_its_logprobs():
    [text] = translate.completion_requests(CompletionRequest(model="m", prompt="ab", echo=True, logprobs=2), None)
    assert text.echo and text.sampling == {"logprobs": 2, "prompt_logprobs": 2}
    assert text.field_names == {"prompt_logprobs": "logprobs"}
    infer = build_infer_request("deepinfer", "cmpl-1", text)
    flags = {i.name: i.contents.bool_contents[0] for i in infer.inputs if i.datatype == "BOOL"}
    assert flags["exclude_input_in_output"] is False  # the model puts the prompt's text first
    assert "prompt_logprobs" in {o.name for o in infer.outputs}
    [streamed] = translate.completion_requests(CompletionRequest(model="m", prompt="ab", echo=True, stream=True),
                                               None)
    streamed_infer = build_infer_request("deepinfer", "cmpl-2", streamed)
    assert next(i for i in streamed_infer.inputs if i.name == "exclude_input_in_output").contents.bool_contents[0]
    assert "prompt_logprobs" not in streamed.sampling  # no logprobs asked: the front repeats the text itself
    prompt = [{"5": {"logprob": None, "rank": None, "decoded_token": "a"}},
              {"6": {"logprob": -1.0, "rank": 2, "decoded_token": "b"},
               "7": {"logprob": -0.5, "rank": 1, "decoded_token": "c"}}]
    echoed = translate.completion_logprobs(prompt, 0)
    assert echoed.tokens == ["a", "b"] and echoed.token_logprobs == [None, -1.0]
    assert echoed.top_logprobs == [None, {"c": -0.5, "b": -1.0}] and echoed.text_offset == [0, 1]


def test_choices_are_n_requests_per_prompt_with_their_own_seeds():
    """OpenAI's choice index is prompt * n + j; choice j samples with seed + j (vLLM's rule)."""
    choices = translate.completion_requests(CompletionRequest(model="m", prompt=["a", "b"], n=3, seed=5), None)
    assert [(c.prompt_index, c.prompt, c.sampling["seed"]) for c in choices] == [
        (0, "a", 5), (0, "a", 6), (0, "a", 7), (1, "b", 5), (1, "b", 6), (1, "b", 7)]
    by_ids = translate.completion_requests(CompletionRequest(model="m", prompt=[[7, 8], [9]]), None)
    assert [(c.prompt_index, c.prompt_input, c.prompt) for c in by_ids] == [(0, "input_ids", [7, 8]),
                                                                            (1, "input_ids", [9])]
    top = translate.SEED_LIMIT - 1  # wraps inside the model's range
    assert [c.sampling["seed"] for c in translate.chat_requests(_chat(n=2, seed=top), None)] == [top, 0]
    assert all("seed" not in c.sampling for c in translate.chat_requests(_chat(n=2), None))
    # A seed the model refuses stays as given, so its refusal names it.
    assert [c.sampling["seed"] for c in translate.chat_requests(_chat(n=2, seed=-1), None)] == [-1, -1]
    totals = [Totals(prompt_tokens=4, completion_tokens=2), Totals(prompt_tokens=4, completion_tokens=3),
              Totals(prompt_tokens=9, completion_tokens=1), Totals(prompt_tokens=9, completion_tokens=1)]
    two_by_two = translate.completion_requests(CompletionRequest(model="m", prompt=["a", "bc"], n=2), None)
    assert translate.call_usage(totals, two_by_two).model_dump() == {
        "prompt_tokens": 13, "completion_tokens": 7, "total_tokens": 20}


@pytest.mark.parametrize("fields, session, param, message", [
    ({"prompt": ["a"] * 8, "n": 9}, None, "prompt", "n x prompts is 9 x 8 = 72 choices; at most 64"),
    ({"prompt": "a", "n": 2}, Session(3), "n", "a session turn continues one conversation"),
    ({"prompt": ["a", "b"]}, Session(3), "prompt", "a session turn continues one conversation"),
    ({"prompt": [[1], []]}, None, "prompt", r"prompt\[1\] is empty"),
])
def test_choices_past_the_limit_or_in_a_session_are_refused(fields, session, param, message):
    with pytest.raises(OpenAIError, match=message) as raised:
        translate.completion_requests(CompletionRequest(model="m", **fields), session)
    assert raised.value.status == 400 and raised.value.param == param


@pytest.mark.parametrize("prompt, message", [
    ("a\ud800b", r"prompt is not valid Unicode: a lone surrogate \(U\+D800\) at character 1"),  # JSON "\ud800"
    ([5, 2**31], r"prompt\[1\] must be a token id in \[0, 2147483647\], got 2147483648"),
    ([[-1]], r"prompt\[0\]\[0\] must be a token id"),
    (["ok", "a\udfffb"], r"prompt\[1\] is not valid Unicode"),
])
def test_prompts_triton_cannot_carry_are_refused_naming_the_prompt(prompt, message):
    """The first two, found by tests/frontend/test_fuzz_openai.py, failed while the gRPC request was built (a 500); a
    negative id, which the engine refused, is now refused here with the others."""
    with pytest.raises(OpenAIError, match=message) as refused:
        translate.completion_requests(CompletionRequest(model="m", prompt=prompt), None)
    assert (refused.value.status, refused.value.param) == (400, "prompt")


def test_session_headers():
    assert translate.session_from_headers({}) is None
    assert translate.session_from_headers({"x-session-id": "42", "x-session-start": "true"}) == Session(42, True)
    assert translate.session_from_headers({"x-session-id": "chat-a", "x-session-end": "1"}) == \
        Session("chat-a", False, True)
    for headers in ({"x-session-start": "true"}, {"x-session-id": "1", "x-session-end": "maybe"},
                    {"x-session-id": str(2**63)}, {"x-session-id": "0"}):
        with pytest.raises(OpenAIError):
            translate.session_from_headers(headers)


def test_model_errors_get_their_status_and_param_from_the_wire_form_not_the_prose():
    busy_error = from_model_error(to_wire(busy("server busy: 300 requests are waiting for a slot",
                                                "max_waiting_requests")), {})
    assert (busy_error.status, busy_error.type) == (503, "server_busy")
    assert busy_error.message == "server busy: 300 requests are waiting for a slot"  # the detail is not shown
    bad = from_model_error(to_wire(RequestError("logprobs", "logprobs must be >= 0 (or null), got -1")),
                           {"logprobs": "top_logprobs"})
    assert (bad.status, bad.param) == (400, "top_logprobs")
    # The field comes from the detail, whatever the prose says first.
    worded = from_model_error(to_wire(RequestError("temperature", "a negative temperature (-1) is not allowed")), {})
    assert (worded.status, worded.param) == (400, "temperature")
    assert from_model_error(to_wire(internal("internal error: boom")), {}).status == 500
    session = from_model_error(to_wire(RequestError("sequence_id", "unknown session x")), {})
    assert (session.status, session.param) == (400, "X-Session-Id")
    # Triton's own errors carry no detail: a client error without a param (an "internal error" says so).
    assert (from_model_error("unknown model 'x'", {}).status, from_model_error("unknown model 'x'", {}).param) == \
        (400, None)
    assert set(bad.body()["error"]) == {"message", "type", "param", "code"}


def test_wire_form_round_trips_and_reads_plainly():
    error = RequestError("top_k", "top_k must be -1 (off) or >= 1, got 0")
    text = to_wire(error)
    assert text.startswith("top_k must be -1 (off) or >= 1, got 0")  # a human reading curl output reads this first
    assert from_wire(text) == WireError(error.message, ErrorKind.INVALID, "top_k")
    limited = busy("server busy: 2 sessions are open", "max_sessions")
    assert from_wire(to_wire(limited)) == WireError(limited.message, ErrorKind.BUSY, None, "max_sessions")
    assert from_wire("boom [deepinfer-error not json]").kind is ErrorKind.INVALID  # malformed: no detail read


def test_infer_request_carries_inputs_outputs_and_session():
    [model] = translate.chat_requests(_chat(temperature=0), Session("s1", start=True))
    infer = build_infer_request("deepinfer", "chatcmpl-1", model)
    inputs = {i.name: i for i in infer.inputs}
    assert json.loads(inputs["messages"].contents.bytes_contents[0]) == [{"role": "user", "content": "hi"}]
    # No max_tokens in a chat call: the rest of the context (OpenAI's and vLLM's chat default), the model's null.
    assert json.loads(inputs["sampling_parameters"].contents.bytes_contents[0]) == {"temperature": 0,
                                                                                  "max_tokens": None}
    assert inputs["stream"].contents.bool_contents[0] is False
    assert {o.name for o in infer.outputs} == {"text_output", "finish_reason", "num_input_tokens", "num_output_tokens"}
    assert infer.parameters["sequence_id"].string_param == "s1" and infer.parameters["sequence_start"].bool_param
    ids = build_infer_request("deepinfer", "cmpl-1", *translate.completion_requests(
        CompletionRequest(model="m", prompt=[5, 6]), Session(9)))
    assert list(next(i for i in ids.inputs if i.name == "input_ids").contents.int_contents) == [5, 6]
    # Completions keep OpenAI's default there (16): the model's own when max_tokens is left out.
    assert json.loads(next(i for i in ids.inputs if i.name == "sampling_parameters").contents.bytes_contents[0]) == {}
    assert ids.parameters["sequence_id"].int64_param == 9


def _bytes_tensor(*items: bytes) -> bytes:
    return b"".join(len(item).to_bytes(4, "little") + item for item in items)


def test_parse_response_reads_raw_outputs():
    from tritonclient.grpc import service_pb2

    result = service_pb2.ModelInferResponse()
    logprobs = [{"7": {"logprob": -0.5, "rank": 2, "decoded_token": "a"},
                 "3": {"logprob": -0.1, "rank": 1, "decoded_token": "b"}}]
    for name, raw in (("text_output", _bytes_tensor("héllo".encode())), ("num_output_tokens", (2).to_bytes(4, "little")),
                      ("num_input_tokens", (11).to_bytes(4, "little")), ("finish_reason", _bytes_tensor(b"length")),
                      ("logprobs", _bytes_tensor(json.dumps(logprobs).encode()))):
        result.outputs.add(name=name)
        result.raw_output_contents.append(raw)
    delta = parse_response(result)
    assert (delta.text, delta.num_output_tokens, delta.num_input_tokens, delta.finish_reason) == \
        ("héllo", 2, 11, "length")
    assert _bytes_elements(_bytes_tensor(b"a", b"", b"bc")) == [b"a", b"", b"bc"]

    chat = translate.chat_logprobs(delta.logprobs).content[0]
    assert (chat.token, chat.logprob, [t.token for t in chat.top_logprobs]) == ("a", -0.5, ["b", "a"])
    completion = translate.completion_logprobs(delta.logprobs, 5)
    assert completion.tokens == ["a"] and completion.top_logprobs == [{"b": -0.1, "a": -0.5}]
    assert completion.text_offset == [5]


def test_totals_and_chunks():
    totals = Totals()
    totals.add(ModelDelta("Hel", 1, 9, "None"))
    totals.add(ModelDelta("lo", 1, 9, "length"))
    other = Totals()
    other.add(ModelDelta("Hi", 1, 9, "stop"))
    [request] = translate.chat_requests(_chat(), None)
    call = translate.call_usage([totals, other], [request, request])
    answer = translate.chat_response("chatcmpl-x", 1, "deepinfer", [totals, other], call, False, [request, request])
    assert [(c.index, c.message.content, c.finish_reason) for c in answer.choices] == \
        [(0, "Hello", "length"), (1, "Hi", "stop")]
    assert answer.usage.model_dump() == {"prompt_tokens": 9, "completion_tokens": 3, "total_tokens": 12}
    opening = translate.chat_chunk("chatcmpl-x", 1, "deepinfer", 2, None, False)
    assert opening.choices[0].delta.role == "assistant" and opening.choices[0].finish_reason is None
    assert opening.choices[0].index == 2
    chunk = translate.completion_chunk("cmpl-x", 1, "deepinfer", 1, ModelDelta("lo", 1, 9, "stop"), 3, False)
    assert (chunk.choices[0].index, chunk.choices[0].text, chunk.choices[0].finish_reason) == (1, "lo", "stop")
