"""Fuzzed OpenAI calls through the front's own steps and then the model's: whatever a client sends, it gets a
4xx naming what it refused (pydantic's validation, translate.py's refusals, or the model's ValueError as
errors.from_model_error maps it) or a request the engine prepares; never an internal error (a 500).

The chain is the one a call takes: the request model -> translate -> the gRPC infer request the front sends ->
its tensors as the Python backend hands them to codec.decode_request -> LLMEngine.prepare_request.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pydantic
import pytest
from hypothesis import given
from hypothesis import strategies as st

from backend_lib.core.errors import RequestError, to_wire
from backend_lib.frontend.openai import translate
from backend_lib.frontend.openai.errors import OpenAIError, from_model_error
from backend_lib.frontend.openai.schema import ChatCompletionRequest, CompletionRequest
from backend_lib.frontend.openai.triton_stream import build_infer_request
from backend_lib.frontend.triton import codec
from tests.helpers.fuzz_values import FUZZ, JSON_VALUES, PLAUSIBLE, TEXT, small_engine

# OpenAI's names for the sampling fields, mostly plausible values, sometimes anything.
_FIELD_VALUES = {
    **{name: PLAUSIBLE[name] for name in ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed",
                                          "min_tokens", "stop_token_ids")},
    "stop": st.one_of(TEXT, PLAUSIBLE["stop"]), "n": st.integers(-1, 70), "stream": st.booleans(),
    "frequency_penalty": st.floats(-3, 3), "presence_penalty": st.floats(-3, 3),
    "repetition_penalty": st.floats(-1, 3), "ignore_eos": st.booleans(), "logit_bias": st.dictionaries(TEXT, st.floats()),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "max_completion_tokens": st.integers(-3, 5000), "logprobs": st.one_of(st.booleans(), st.integers(-2, 30)),
    "top_logprobs": st.integers(-2, 30), "echo": st.booleans(), "best_of": st.integers(0, 3),
    "response_format": st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object", "x"])}),
}
_FIELDS = st.dictionaries(st.one_of(st.sampled_from(sorted(_FIELD_VALUES)), TEXT), JSON_VALUES, max_size=3).flatmap(
    lambda junk: st.fixed_dictionaries({}, optional=_FIELD_VALUES).map(lambda good: {**junk, **good}))
_CONTENT = st.one_of(
    TEXT, st.none(), JSON_VALUES,
    st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url", ""])},
                                   optional={"text": st.one_of(TEXT, st.none())}), max_size=3))
_MESSAGES = st.lists(st.fixed_dictionaries(
    {"role": st.one_of(st.sampled_from(["user", "assistant", "system", "developer", "tool"]), TEXT),
     "content": _CONTENT}, optional={"tool_calls": JSON_VALUES, "name": TEXT}), max_size=4)
_PROMPTS = st.one_of(TEXT, st.lists(st.integers(-5, 60000) | st.integers(-2**40, 2**40), max_size=8),
                     st.lists(TEXT, max_size=2), st.lists(st.lists(st.integers(-5, 60000), max_size=4), max_size=2),
                     JSON_VALUES)
_HEADERS = st.fixed_dictionaries({}, optional={
    "X-Session-Id": st.one_of(TEXT, st.integers(-5, 2**64).map(str)),
    "X-Session-Start": st.sampled_from(["true", "false", "1", "", "maybe"]),
    "X-Session-End": st.sampled_from(["true", "false", "0", "yes"])})
CALLS = st.one_of(
    st.tuples(st.just("chat"), st.builds(lambda f, m: {**f, "model": "deepinfer", "messages": m}, _FIELDS,
                                         st.one_of(_MESSAGES, JSON_VALUES)), _HEADERS),
    st.tuples(st.just("completion"), st.builds(lambda f, p: {**f, "model": "deepinfer", "prompt": p}, _FIELDS,
                                               _PROMPTS), _HEADERS))


def _backend_inputs(infer) -> dict[str, np.ndarray]:
    """The infer request's tensors as the Python backend's as_numpy() gives them."""
    inputs = {}
    for tensor in infer.inputs:
        if tensor.datatype == "BYTES":
            inputs[tensor.name] = np.array(list(tensor.contents.bytes_contents), dtype=object)
        elif tensor.datatype == "BOOL":
            inputs[tensor.name] = np.array(list(tensor.contents.bool_contents), dtype=np.bool_)
        else:
            inputs[tensor.name] = np.array(list(tensor.contents.int_contents), dtype=np.int32)
    return inputs


def _refused_as_a_client_error(error: OpenAIError) -> None:
    assert 400 <= error.status < 500, (error.status, error.message)
    assert error.message


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    return small_engine(tiny_llama_dir)


@FUZZ
@given(CALLS)
def test_openai_calls_are_prepared_or_refused_with_a_client_error(engine, call):
    kind, body, headers = call
    try:
        request = (ChatCompletionRequest if kind == "chat" else CompletionRequest).model_validate(body)
    except pydantic.ValidationError:  # the app answers 400 naming the field (errors.py: body_error)
        return
    try:
        session = translate.session_from_headers(headers)
        build = translate.chat_requests if kind == "chat" else translate.completion_requests
        choices = build(request, session)
    except OpenAIError as error:
        _refused_as_a_client_error(error)
        return
    assert 1 <= len(choices) <= translate.MAX_CHOICES
    for model_request in choices:
        _prepared_or_refused(engine, model_request, session)


def _prepared_or_refused(engine, model_request: translate.ModelRequest, session: translate.Session | None) -> None:
    infer = build_infer_request("deepinfer", "fuzz", model_request)
    correlation = session.sequence_id if session is not None else 0
    flags = (codec.FLAG_SEQUENCE_START * session.start + codec.FLAG_SEQUENCE_END * session.end) if session else 0
    try:
        decoded = codec.decode_request(_backend_inputs(infer), "{}", correlation, flags,
                                       [o.name for o in infer.outputs], engine.rules)
        prepared = engine.prepare_request("fuzz", dataclasses.replace(decoded.request, session=None))
    except RequestError as exc:  # the model's refusal on the wire, as the front turns it into an answer
        error = from_model_error(to_wire(exc), model_request.field_names)
        _refused_as_a_client_error(error)
        assert error.param, error.message  # the client is told which of its fields
        return
    assert all(0 <= t < engine.vocab_size for t in prepared.prompt_ids)
