"""Fuzzed request decoding: whatever a client sends, the only outcomes are a valid request or a RequestError
(typed: field and kind) - never another exception (an internal error) or a hang.

Covers codec.decode_request (arbitrary tensors, dtypes, shapes, JSON parameters, session controls),
SamplingParams.from_dict (JSON values: NaN / inf, huge numbers, wrong types, nesting), and the engine's checks
behind them (LLMEngine.prepare_request: tokenization, the chat template, out-of-vocabulary ids, the limits).
Bounded (max_examples, no deadline) so the file runs in well under a minute on 2 cores.
"""
from __future__ import annotations

import dataclasses

import json
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from backend_lib.core.config import RequestLimits
from backend_lib.core.errors import RequestError
from backend_lib.core.sampling_params import SamplingParams
from backend_lib.engine.intake import parse_json, parse_sampling
from backend_lib.frontend.triton import codec
from tests.helpers.fuzz_values import (FUZZ, JSON_VALUES, SAMPLING_DICTS, TEXT, accepts_or_request_error,
                               small_engine)
from tests.helpers.engines import drive



@FUZZ
@given(SAMPLING_DICTS)
def test_sampling_params_from_dict_is_valid_or_a_value_error(values):
    params = accepts_or_request_error(lambda: SamplingParams.from_dict(values))
    if params is not None:  # what it accepted is what the engine can use
        assert isinstance(params.max_tokens, int) and params.max_tokens >= 1
        assert math.isfinite(params.temperature) and 0 < params.top_p <= 1
        assert all(isinstance(s, str) and s for s in params.stop)
        assert SamplingParams.from_dict(params.to_dict()) == params


@FUZZ
@given(st.one_of(TEXT, JSON_VALUES.map(lambda v: json.dumps(v, allow_nan=True)),
                 SAMPLING_DICTS.map(lambda d: json.dumps(d, allow_nan=True))))
def test_intake_of_sampling_json_is_valid_or_a_request_error(text):
    """JSON text (the sampling_parameters input) -> the intake's SamplingParams, or a typed refusal."""
    def intake():
        values = parse_json("sampling_parameters", text)
        if not isinstance(values, dict):
            raise RequestError("sampling_parameters", "not an object")
        return parse_sampling(values, RequestLimits())
    accepts_or_request_error(intake)


# ---- decode_request: arbitrary tensors --------------------------------------------------------------------

_DTYPES = [np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint32, np.uint64, np.float16, np.float32,
           np.float64, np.bool_, np.object_, np.str_, np.bytes_, np.complex64]
_BYTES_ITEMS = st.one_of(
    TEXT.map(lambda t: t.encode("utf-8", "surrogatepass")), st.binary(max_size=30),
    JSON_VALUES.map(lambda v: json.dumps(v).encode()), SAMPLING_DICTS.map(lambda d: json.dumps(d).encode()),
    st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system", "tool", ""]),
                                    "content": TEXT}), max_size=3).map(lambda m: json.dumps(m).encode()),
    st.sampled_from([b"\xff\xfe", b"\xc3\x28", b"\xed\xa0\x80", b"[" * 100000, b'{"a":' * 50000, b""]))


@st.composite
def tensors(draw):
    dtype = draw(st.sampled_from(_DTYPES))
    shape = tuple(draw(st.lists(st.integers(0, 3), max_size=3)))
    size = int(np.prod(shape)) if shape else 1
    if dtype is np.object_:
        items = draw(st.lists(st.one_of(_BYTES_ITEMS, TEXT, st.integers(), st.none(), st.floats()),
                              min_size=size, max_size=size))
        array = np.empty(size, dtype=object)
        array[:] = items if size else []
        return array.reshape(shape)
    if dtype in (np.str_, np.bytes_):
        items = draw(st.lists(st.text(alphabet=st.characters(codec="ascii"), max_size=10), min_size=size,
                              max_size=size))
        return np.array(items, dtype=dtype).reshape(shape)
    if dtype is np.bool_:
        return np.array(draw(st.lists(st.booleans(), min_size=size, max_size=size)), dtype=dtype).reshape(shape)
    info = np.iinfo(dtype) if np.dtype(dtype).kind in "iu" else None
    if info is not None:
        values = draw(st.lists(st.integers(int(info.min), int(info.max)) | st.integers(0, min(int(info.max), 60000)),
                               min_size=size, max_size=size))
        return np.array(values, dtype=dtype).reshape(shape)
    values = draw(st.lists(st.floats(allow_nan=True, allow_infinity=True, width=32), min_size=size, max_size=size))
    return np.array(values).astype(dtype).reshape(shape)


INPUT_NAMES = list(codec.INPUT_NAMES) + ["bogus"]
PARAMETERS = st.one_of(
    SAMPLING_DICTS.map(json.dumps),
    st.dictionaries(st.sampled_from(codec.SESSION_PARAMETERS + ("max_tokens", "stop")), JSON_VALUES,
                    max_size=3).map(json.dumps),
    JSON_VALUES.map(json.dumps), TEXT, st.sampled_from(["", "{}", "[" * 100000, "NaN"]))


@st.composite
def requests(draw):
    names = draw(st.lists(st.sampled_from(INPUT_NAMES), max_size=4, unique=True))
    inputs = {name: draw(tensors()) for name in names}
    # Well-typed prompt inputs half the time, so decoding gets past the prompt and into the parameters.
    if draw(st.booleans()):
        kind = draw(st.sampled_from(["text_input", "input_ids", "messages"]))
        for other in ("text_input", "input_ids", "messages"):
            inputs.pop(other, None)
        if kind == "input_ids":
            inputs[kind] = np.array(draw(st.lists(st.integers(-2**31, 2**31 - 1) | st.integers(0, 60000),
                                                  max_size=8)), dtype=np.int32)
        else:
            inputs[kind] = np.array([draw(_BYTES_ITEMS)], dtype=object)
    correlation = draw(st.one_of(st.integers(0, 2**64 - 1), TEXT))
    flags = draw(st.integers(0, 7))
    outputs = draw(st.lists(TEXT, max_size=3))
    return inputs, draw(PARAMETERS), correlation, flags, outputs


@FUZZ
@given(requests())
def test_decode_request_is_valid_or_a_value_error(request):
    inputs, parameters, correlation, flags, outputs = request
    decoded = accepts_or_request_error(lambda: codec.decode_request(inputs, parameters, correlation, flags, outputs))
    if decoded is not None:
        assert isinstance(decoded.params, SamplingParams)
        prompt = decoded.prompt
        assert (isinstance(prompt, str) and prompt) or (isinstance(prompt, list) and prompt)


# ---- the engine behind the codec: tokenization, chat template, vocabulary, limits -------------------------

@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    return small_engine(tiny_llama_dir)


@FUZZ
@given(requests())
def test_decoded_requests_are_prepared_or_refused_with_a_value_error(engine, request):
    inputs, parameters, correlation, flags, outputs = request
    decoded = accepts_or_request_error(lambda: codec.decode_request(inputs, parameters, correlation, flags, outputs,
                                                                         engine.rules))
    if decoded is None:
        return
    # A session turn is tokenized against its history; here its prompt alone.
    request = dataclasses.replace(decoded.request, session=None)
    prepared = accepts_or_request_error(lambda: engine.prepare_request("fuzz", request))
    if prepared is not None:
        assert all(0 <= t < engine.vocab_size for t in prepared.prompt_ids)
        assert len(prepared.prompt_ids) < engine.config.model.max_model_len


MESSAGES = st.lists(st.dictionaries(
    st.sampled_from(["role", "content", "name", "tool_calls", "x"]),
    st.one_of(TEXT, st.sampled_from(["user", "assistant", "system", "tool", "{{ 1 }}",
                                                     "{% raw %}", "<|im_end|>", "\ud800", "\x00"]), JSON_VALUES),
    max_size=4), max_size=5)


@FUZZ
@given(MESSAGES)
def test_chat_template_path_is_valid_or_a_value_error(engine, messages):
    ids = accepts_or_request_error(lambda: engine.tokenizer.apply_chat_template(messages))
    if ids is not None:
        assert all(isinstance(t, int) for t in ids)
    accepts_or_request_error(lambda: engine.prepare_request("fuzz", engine.take_in(messages)))


# ---- session turns: any sequence of START / END / turns leaves the engine consistent ---------------------

TURNS = st.lists(st.tuples(
    st.sampled_from(["1", "2", "3"]), st.booleans(), st.booleans(),  # session id, START, END
    st.one_of(st.lists(st.integers(0, 300), min_size=1, max_size=40), TEXT.filter(bool),
              st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system"]),
                                              "content": TEXT}), min_size=1, max_size=2)),
    st.one_of(st.none(), st.integers(1, 60)),  # max_tokens: unset or set (some past the context)
    st.integers(0, 3)), max_size=6)  # steps run after the turn


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(TURNS)
def test_fuzzed_session_turns_leave_the_engine_consistent(engine, turns):
    """Turns of up to three sessions, with or without START / END, some refused (unknown session, a turn still
    running, context, max_sessions): whatever the order, every block and session is returned at the end."""
    from backend_lib.core.outputs import SessionControl

    for i, (sid, start, end, prompt, max_tokens, steps) in enumerate(turns):
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
        try:
            engine.add_request(f"t{i}", prompt, params, SessionControl(sid, start=start, end=end))
        except RequestError:
            pass
        for _ in range(steps):
            engine.step()
    drive(engine)
    engine.close_idle_sessions(now=float("inf"))
    engine.scheduler.check_integrity()
    stats = engine.stats()
    assert stats.num_sessions == 0 and stats.num_running == 0 and stats.num_waiting == 0
    assert stats.kv_blocks_used == 0



# ---- plain requests with logit_bias, prompt_logprobs, logprobs and null max_tokens, preempting each other ---------

REQUESTS = st.lists(st.tuples(
    st.lists(st.integers(0, 300), min_size=1, max_size=60),  # prompt ids
    st.fixed_dictionaries({}, optional={
        "max_tokens": st.one_of(st.none(), st.integers(1, 40)), "temperature": st.sampled_from([0.0, 0.8]),
        "seed": st.integers(0, 9), "logprobs": st.integers(0, 5), "prompt_logprobs": st.integers(0, 5),
        "logit_bias": st.dictionaries(st.integers(0, 300), st.floats(-100, 100), max_size=3),
        "repetition_penalty": st.floats(0.5, 2)}),
    st.integers(0, 3)), max_size=6)  # steps run after the request


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(REQUESTS)
def test_fuzzed_requests_complete_whole_and_return_every_block(engine, requests):
    """In a pool small enough that requests preempt each other: each admitted request ends, a prompt_logprobs one
    carries every prompt token after the first exactly once, and no block is left."""

    outputs: dict[str, list] = {}
    admitted: dict[str, tuple[list[int], SamplingParams]] = {}

    def step() -> None:
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)

    for i, (prompt, fields, steps) in enumerate(requests):
        params = SamplingParams(**fields)
        try:
            engine.add_request(f"fz{i}", prompt, params)
            admitted[f"fz{i}"] = (prompt, params)
        except RequestError:
            pass
        for _ in range(steps):
            step()
    for request_id, outs in drive(engine).items():
        outputs.setdefault(request_id, []).extend(outs)
    for request_id, (prompt, params) in admitted.items():
        finals = [o for o in outputs[request_id] if o.finished]
        assert len(finals) == 1 and finals[0].finish_reason in ("stop", "length"), finals
        carried = [o.prompt_logprobs for o in outputs[request_id] if o.prompt_logprobs is not None]
        if params.prompt_logprobs is None:
            assert not carried
        else:
            assert len(carried) == 1 and [e.token_id for e in carried[0].entries] == prompt[1:]
            assert all(len(e.top) == params.prompt_logprobs for e in carried[0].entries)
    engine.scheduler.check_integrity()
    assert engine.stats().kv_blocks_used == 0
