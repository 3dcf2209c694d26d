"""Limits on what one request may ask for and on what the server holds: context (prompt + max_tokens), request
caps (RequestLimits), admission control (max_waiting_requests, max_sessions) and their refusal counters."""
from __future__ import annotations

import pytest

from backend_lib.core.config import EngineConfig, RequestLimits, config_to_flat
from backend_lib.core.outputs import SessionControl
from backend_lib.core.sampling_params import SamplingParams
from backend_lib.engine.async_engine import AsyncEngine
from backend_lib.core.errors import ErrorKind, RequestError
from backend_lib.engine.intake import check_context, check_params, check_prompt
from backend_lib.frontend.triton import parameters
from tests.helpers.engines import drive, final_outputs, make_engine


# ---- configuration ---------------------------------------------------------------------------------

def test_admission_defaults_derive_from_max_num_seqs_and_parameters_override_them():
    config = EngineConfig.from_flat({"max_num_seqs": 4, "max_model_len": 128})
    assert (config.max_waiting_requests, config.max_sessions) == (32, 128)
    assert config.limits.max_input_ids == 0 and config.limits.max_logprobs == 20
    config = parameters.engine_config_from_parameters({
        "max_num_seqs": "4", "max_waiting_requests": "5", "max_sessions": "0", "max_stop_strings": "2",
        "max_logprobs": "3", "max_input_ids": "64"})
    assert (config.max_waiting_requests, config.max_sessions) == (5, 128)
    assert (config.limits.max_stop_strings, config.limits.max_logprobs, config.limits.max_input_ids) == (2, 3, 64)
    # Worker ranks rebuild the driver's config from its flat form: the limits and derived values survive.
    assert EngineConfig.from_flat(config_to_flat(config)) == config


@pytest.mark.parametrize("params, needle", [
    ({"max_waiting_requests": "-1"}, "max_waiting_requests must be >= 0"),
    ({"max_sessions": "many"}, "max_sessions must be an integer"),
    ({"max_stop_strings": "0"}, "max_stop_strings must be an integer >= 1"),
    ({"max_logprobs": "-2"}, "max_logprobs must be an integer >= 0"),
])
def test_bad_limit_parameters_name_the_parameter(params, needle):
    with pytest.raises(ValueError) as info:
        parameters.engine_config_from_parameters(params)
    assert needle in str(info.value)


# ---- checks, without an engine -----------------------------------------------------------------------

LIMITS = RequestLimits(max_prompt_chars=10, max_input_ids=4, max_messages=2, max_messages_chars=40,
                       max_stop_strings=2, max_stop_string_chars=3, max_stop_token_ids=2, max_logprobs=5,
                       max_logit_bias=2)


@pytest.mark.parametrize("prompt, needle", [
    ("x" * 11, "text_input has 11 characters; the limit (max_prompt_chars) is 10"),
    ([1] * 5, "input_ids has 5 tokens; the limit (max_input_ids) is 4"),
    ([{"role": "user", "content": "a"}] * 3, "messages has 3 messages; the limit (max_messages) is 2"),
    ([{"role": "user", "content": "a" * 30}], "messages has 45 characters; the limit (max_messages_chars) is 40"),
    ([{"role": "user", "content": "a", "extra": [[["b" * 30]]]}], "max_messages_chars"),  # keys and nesting count
])
def test_prompt_caps_name_the_field_and_the_limit(prompt, needle):
    with pytest.raises(RequestError) as info:
        check_prompt(LIMITS, prompt, 64)
    assert needle in str(info.value)
    assert info.value.field in ("text_input", "input_ids", "messages") and info.value.limit in str(info.value)


def test_prompts_within_the_caps_pass():
    for prompt in ("x" * 10, [1] * 4, [{"role": "user", "content": "abc"}] * 2):
        check_prompt(LIMITS, prompt, 64)
    with pytest.raises(ValueError, match="prompt has 64 tokens; max_model_len is 64"):  # max_input_ids 0
        check_prompt(RequestLimits(), [1] * 64, 64)


@pytest.mark.parametrize("params, needle", [
    (SamplingParams(stop=["a", "b", "c"]), "stop has 3 strings; the limit (max_stop_strings) is 2"),
    (SamplingParams(stop=["abcd"]), "stop has a string of 4 characters; the limit (max_stop_string_chars) is 3"),
    (SamplingParams(stop_token_ids=[1, 2, 3]), "stop_token_ids has 3 ids; the limit (max_stop_token_ids) is 2"),
    (SamplingParams(logprobs=6), "logprobs must be in [0, 5]"),
    (SamplingParams(logit_bias={1: 1, 2: 1, 3: 1}), "logit_bias has 3 entries; the limit (max_logit_bias) is 2"),
    (SamplingParams(logit_bias={1000: 1}), "logit_bias has token id 1000, outside the vocabulary (size 1000)"),
])
def test_param_caps_name_the_field_and_the_limit(params, needle):
    with pytest.raises(RequestError) as info:
        check_params(LIMITS, params, vocab_size=1000)
    assert needle in str(info.value)
    assert needle.startswith(info.value.field) and info.value.kind is ErrorKind.INVALID


def test_logprobs_cap_is_also_the_vocabulary():
    with pytest.raises(ValueError, match=r"logprobs must be in \[0, 3\]"):
        check_params(LIMITS, SamplingParams(logprobs=4), vocab_size=3)
    check_params(LIMITS, SamplingParams(logprobs=5, stop=["abc", "d"], stop_token_ids=[1, 2]), vocab_size=1000)


def test_context_limit_names_max_tokens_the_prompt_length_and_max_model_len():
    with pytest.raises(ValueError) as info:
        check_context(10, SamplingParams(max_tokens=1_000_000_000), 64)
    message = str(info.value)
    assert message.startswith("max_tokens is 1000000000") and "10 tokens" in message
    assert "max_model_len is 64" in message
    check_context(10, SamplingParams(max_tokens=54), 64)  # exactly fits
    check_context(60, SamplingParams(), 64)  # unset: the default, cut at max_model_len
    with pytest.raises(ValueError, match="prompt has 64 tokens; max_model_len is 64"):
        check_context(64, SamplingParams(), 64)


# ---- the engine ----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    return make_engine(tiny_llama_dir, max_model_len=64, num_blocks=64, max_sessions=2, max_stop_strings=2)



def test_engine_refuses_max_tokens_beyond_the_context_before_any_work(engine):
    prompt = list(range(10, 30))
    with pytest.raises(ValueError, match=r"^max_tokens is 45, but the prompt has 20 tokens and max_model_len is 64"):
        engine.add_request("big", prompt, SamplingParams(max_tokens=45))
    assert not engine.has_unfinished_requests()
    engine.add_request("fits", prompt, SamplingParams(max_tokens=44, temperature=0.0, ignore_eos=True))
    engine.add_request("unset", list(range(10, 70)), SamplingParams(temperature=0.0, ignore_eos=True))
    engine.add_request("null", prompt, SamplingParams.from_dict({"max_tokens": None, "temperature": 0,
                                                                 "ignore_eos": True}))
    finals = final_outputs(drive(engine))
    assert finals["fits"].num_output_tokens == 44 and finals["fits"].finish_reason == "length"
    # max_tokens left out keeps vLLM's default: 16 at most, cut where max_model_len ends the request.
    assert finals["unset"].num_output_tokens == 4 and finals["unset"].finish_reason == "length"
    # null (vLLM's "as many as fit"): up to max_model_len, never refused for its size.
    assert finals["null"].num_output_tokens == 44 and finals["null"].finish_reason == "length"
    with pytest.raises(ValueError, match="stop has 3 strings; the limit"):
        engine.add_request("stops", "hi", SamplingParams(stop=["a", "b", "c"]))
    with pytest.raises(ValueError, match="prompt has 65 tokens; max_model_len is 64"):
        engine.add_request("long", [5] * 65, SamplingParams())


def test_session_turn_counts_its_history_in_the_context_limit(engine):
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    engine.add_request("t1", list(range(10, 40)), params, SessionControl("ctx", start=True))
    drive(engine)  # history: 30 prompt + 8 output tokens
    with pytest.raises(ValueError, match=r"max_tokens is 20, but the prompt has 48 tokens \(session history "
                                         r"included\) and max_model_len is 64"):
        engine.add_request("t2", list(range(10, 20)), SamplingParams(max_tokens=20), SessionControl("ctx"))
    engine.add_request("t3", list(range(10, 20)), SamplingParams(max_tokens=16, temperature=0.0),
                       SessionControl("ctx", end=True))
    assert final_outputs(drive(engine))["t3"].finish_reason in ("length", "stop")


def test_max_sessions_refuses_a_new_start_but_not_a_restart(engine):
    params = SamplingParams(max_tokens=2, temperature=0.0)
    engine.add_request("a", [5, 6], params, SessionControl("s-a", start=True))
    engine.add_request("b", [5, 6], params, SessionControl("s-b", start=True))
    with pytest.raises(RequestError, match=r"^server busy: 2 sessions are open, the limit \(max_sessions 2\)") \
            as info:
        engine.add_request("c", [5, 6], params, SessionControl("s-c", start=True))
    assert info.value.limit == "max_sessions" and info.value.kind is ErrorKind.BUSY
    drive(engine)
    engine.add_request("a2", [5, 6], params, SessionControl("s-a", start=True))  # a restart opens nothing new
    engine.add_request("b2", [7], params, SessionControl("s-b", end=True))
    drive(engine)
    engine.add_request("c", [5, 6], params, SessionControl("s-c", start=True, end=True))  # room again
    engine.add_request("a3", [7], params, SessionControl("s-a", end=True))
    drive(engine)
    assert engine.stats().num_sessions == 0


def test_async_engine_refuses_past_max_waiting_requests_and_counts_refusals(tiny_llama_dir):
    engine = AsyncEngine(EngineConfig.from_flat({"model": str(tiny_llama_dir), "max_model_len": 64,
                                                 "num_blocks": 64, "max_num_seqs": 2, "max_waiting_requests": 3,
                                                 "max_sessions": 1}))
    try:
        params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        with engine._lock:  # stands in for a long step: nothing leaves the inbox meanwhile
            streams = [engine.add_request(f"r{i}", [3 + i, 5, 7], params) for i in range(3)]
            for i in range(2):
                with pytest.raises(RequestError, match=r"^server busy: 3 requests are waiting for a slot, the "
                                                       r"limit \(max_waiting_requests 3\)") as info:
                    engine.add_request(f"x{i}", [3, 5, 7], params)
                assert info.value.kind is ErrorKind.BUSY and info.value.limit == "max_waiting_requests"
            with pytest.raises(RequestError) as info:  # refused before tokenizing: its bad id is never looked at
                engine.add_request("bad", [10**6], params)
            assert info.value.busy
        assert all(list(s)[-1].finish_reason == "length" for s in streams)
        assert list(engine.add_request("s1", [3, 5], params, SessionControl("one", start=True)))[-1].finished
        refused = engine.add_request("s2", [3, 5], params, SessionControl("two", start=True))  # "one" is open
        [out] = list(refused)
        assert out.rejected and out.busy and "max_sessions 1" in out.error
        stats = engine.stats()
        assert (stats.num_refused_waiting, stats.num_refused_sessions) == (3, 1)
        # Room again once the queue drained: nothing stays counted as waiting.
        assert list(engine.add_request("after", [3, 5, 7], params))[-1].finish_reason == "length"
    finally:
        engine.shutdown()
