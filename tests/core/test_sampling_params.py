"""SamplingParams: every validation error names its field; dict / JSON round trips."""
from __future__ import annotations

import json

import pytest

from backend_lib.core.config import RequestLimits
from backend_lib.core.errors import RequestError
from backend_lib.core.sampling_params import UNTIL_CONTEXT_ENDS, SamplingParams
from backend_lib.engine.intake import parse_json, parse_sampling
from backend_lib.structured_output.constraints import ConstraintKind, OutputConstraint


def test_defaults_match_vllm():
    p = SamplingParams()
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.min_p) == (16, 1.0, 1.0, -1, 0.0)
    assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == (1.0, 0.0, 0.0)
    assert p.seed is None and p.stop == [] and p.stop_token_ids == [] and p.logprobs is None
    assert not p.ignore_eos and p.min_tokens == 0 and not p.include_stop_str_in_output
    assert p.skip_special_tokens and p.speculative and not p.is_greedy
    assert SamplingParams(temperature=0).is_greedy


BAD_VALUES = [
    ("temperature", -1, ">= 0"),
    ("temperature", float("nan"), "temperature"),
    ("temperature", float("inf"), "finite"),
    ("top_p", 0.0, "(0, 1]"),
    ("top_p", 1.5, "(0, 1]"),
    ("top_p", "0.5", "number"),
    ("top_k", 0, "-1"),
    ("top_k", -2, "-1"),
    ("top_k", 2.0, "integer"),
    ("min_p", -0.1, "[0, 1]"),
    ("min_p", 1.1, "[0, 1]"),
    ("max_tokens", 0, ">= 1"),
    ("max_tokens", "16", "integer"),
    ("repetition_penalty", 0.0, "> 0"),
    ("presence_penalty", 2.5, "[-2, 2]"),
    ("presence_penalty", -2.1, "[-2, 2]"),
    ("frequency_penalty", 3, "[-2, 2]"),
    ("frequency_penalty", True, "number"),
    ("min_tokens", -1, "min_tokens"),
    ("seed", -1, "[0, 2147483647]"),
    ("seed", 2**31, "[0, 2147483647]"),
    ("seed", 1.5, "integer"),
    ("seed", True, "integer"),
    ("logprobs", -1, ">= 0"),  # the upper bound is the server's max_logprobs (tests/engine/test_limits.py)
    ("logprobs", "5", "integer"),
    ("stop", [""], "non-empty"),
    ("stop", [1], "non-empty strings"),
    ("stop", 5, "string or a list"),
    ("stop_token_ids", [-1], ">= 0"),
    ("stop_token_ids", ["2"], "integers"),
    ("stop_token_ids", 2, "list"),
    ("ignore_eos", "yes", "boolean"),
    ("include_stop_str_in_output", 1, "boolean"),
    ("skip_special_tokens", None, "boolean"),
    ("speculative", "false", "boolean"),
    ("logit_bias", [1, 2], "object of token id"),
    ("logit_bias", {"a": 1.0}, "token ids"),
    ("logit_bias", {"-3": 1.0}, "token ids"),
    ("logit_bias", {True: 1.0}, "token ids"),
    ("logit_bias", {"7": 100.5}, "[-100, 100]"),
    ("logit_bias", {"7": "high"}, "number"),
    ("logit_bias", {7: float("nan")}, "finite"),
    ("logit_bias", {"5": 10**400}, "finite"),  # a JSON integer past float's range (was an OverflowError)
    ("logit_bias", {"9" * 5000: 1.0}, "token ids"),  # past int()'s digit limit (was a ValueError naming int)
    ("temperature", 10**400, "finite"),
]


@pytest.mark.parametrize("name,value,fragment", BAD_VALUES)
def test_bad_value_names_field_and_range(name, value, fragment):
    with pytest.raises(RequestError) as info:
        SamplingParams(**{name: value})
    message = str(info.value)
    assert message.startswith(name), message
    assert fragment in message, message
    assert info.value.field == name  # typed: the fronts read the field, not the message


def test_temperature_message_exact():
    with pytest.raises(ValueError, match=r"^temperature must be >= 0, got -1$"):
        SamplingParams(temperature=-1)


def test_min_tokens_above_max_tokens():
    with pytest.raises(ValueError, match=r"min_tokens must be in \[0, max_tokens=4\], got 5"):
        SamplingParams(max_tokens=4, min_tokens=5)
    assert SamplingParams(max_tokens=4, min_tokens=4).min_tokens == 4


def test_accepted_edges_and_coercions():
    p = SamplingParams(temperature=1, top_p=1, min_p=1, top_k=1, presence_penalty=-2, frequency_penalty=2,
                       seed=2**31 - 1, logprobs=20, stop="###", stop_token_ids=(7, 8))
    assert isinstance(p.temperature, float) and p.temperature == 1.0
    assert isinstance(p.top_p, float) and isinstance(p.presence_penalty, float)
    assert p.stop == ["###"] and p.stop_token_ids == [7, 8]
    assert SamplingParams(logprobs=0).logprobs == 0
    # OpenAI's JSON keys are the ids' strings; the values may be JSON ints.
    assert SamplingParams(logit_bias={"50256": -100, 7: 2.5}).logit_bias == {50256: -100.0, 7: 2.5}
    assert SamplingParams(logit_bias=None).logit_bias == {}


def test_from_dict_rejects_unknown_field_and_lists_allowed():
    with pytest.raises(ValueError) as info:
        SamplingParams.from_dict({"temperature": 0.5, "foo": 1})
    assert "unknown sampling field 'foo'" in str(info.value)
    assert "temperature" in str(info.value) and "max_tokens" in str(info.value)


def test_dict_and_json_round_trip():
    p = SamplingParams(max_tokens=32, temperature=0.7, top_p=0.9, top_k=50, min_p=0.05, repetition_penalty=1.1,
                       presence_penalty=0.5, frequency_penalty=-0.5, seed=42, stop=["\n\n", "END"],
                       stop_token_ids=[2], ignore_eos=True, min_tokens=3, logprobs=5,
                       include_stop_str_in_output=True, skip_special_tokens=False, speculative=False,
                       logit_bias={3: -1.5})
    assert SamplingParams.from_dict(p.to_dict()) == p
    assert SamplingParams.from_dict(json.loads(p.to_json())) == p
    constrained = p.clone(structured_outputs=OutputConstraint(ConstraintKind.CHOICE, ("yes", "no")))
    assert parse_sampling(json.loads(constrained.to_json()), RequestLimits()) == constrained
    d = p.to_dict()
    d["stop"].append("x")  # to_dict hands out copies
    assert p.stop == ["\n\n", "END"]


def test_json_text_errors_name_the_field():
    """The intake parses a request's JSON text (one parser, one recursion guard); values keep their JSON types."""
    with pytest.raises(RequestError, match="sampling_parameters is not valid JSON") as info:
        parse_json("sampling_parameters", "{temperature: 0}")
    assert info.value.field == "sampling_parameters"
    with pytest.raises(RequestError, match="nested too deeply"):
        parse_json("messages", "[" * 100_000)
    with pytest.raises(ValueError, match="^top_p"):
        SamplingParams.from_dict(json.loads('{"top_p": "0.5"}'))
    with pytest.raises(ValueError, match="^ignore_eos"):
        SamplingParams.from_dict(json.loads('{"ignore_eos": "yes"}'))
    with pytest.raises(RequestError, match="sampling parameters must be an object"):
        SamplingParams.from_dict([1, 2])


def test_clone_validates_and_copies():
    p = SamplingParams(stop=["a"], seed=1)
    q = p.clone(temperature=0.0)
    assert q.is_greedy and q.seed == 1 and q.stop == ["a"] and q.stop is not p.stop
    with pytest.raises(ValueError, match="^top_p"):
        p.clone(top_p=0)
    with pytest.raises(TypeError, match="bogus"):  # overrides come from code: a plain TypeError
        p.clone(bogus=1)


def test_unset_max_tokens_is_the_default_and_stays_unset_through_round_trips():
    """vLLM's meanings: max_tokens left out is 16, null is as many as fit, both cut short at max_model_len; the
    engine refuses prompt + max_tokens > max_model_len only for a number the client set."""
    omitted, null = SamplingParams(), SamplingParams.from_dict(json.loads('{"max_tokens": null}'))
    assert omitted.max_tokens == 16 and not omitted.max_tokens_set
    assert null.max_tokens == UNTIL_CONTEXT_ENDS and not null.max_tokens_set
    assert SamplingParams(max_tokens=None).max_tokens == UNTIL_CONTEXT_ENDS
    assert SamplingParams(max_tokens=16).max_tokens_set
    assert "max_tokens" not in omitted.to_dict() and null.to_dict()["max_tokens"] is None
    for params in (omitted, null):
        for copy in (SamplingParams.from_dict(params.to_dict()), SamplingParams.from_dict(json.loads(params.to_json())),
                     params.clone(temperature=0.0)):
            assert (copy.max_tokens, copy.max_tokens_set) == (params.max_tokens, False)
    assert SamplingParams.from_dict({"max_tokens": 16}).max_tokens_set
    assert SamplingParams(max_tokens=8).clone(temperature=0.0).max_tokens == 8
    with pytest.raises(ValueError, match="unknown sampling field 'max_tokens_set'"):
        SamplingParams.from_dict({"max_tokens_set": True})
