"""Hypothesis values the fuzz tests share (tests/frontend/test_fuzz_codec.py, tests/frontend/test_fuzz_openai.py):
any text, JSON-like values as clients send them, sampling fields with mostly plausible values,
and a small engine to prepare requests."""
from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from backend_lib.core.errors import RequestError
from backend_lib.core.sampling_params import SamplingParams

FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                         HealthCheck.function_scoped_fixture])

# Any code point, lone surrogates included (a JSON "\ud800" escape decodes to one; st.text() never makes them).
TEXT = st.lists(st.one_of(st.characters(), st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF,
                                                         categories=["Cs"])), max_size=20).map("".join)
# JSON-like values, including what Python's json module produces from NaN / Infinity / huge literals.
_SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(), st.integers(min_value=-2**70, max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True), TEXT,
    st.sampled_from([10**400, -10**400, 2**63, 2**64, -2**63 - 1, 1e308, -0.0, "nan", "inf", "1e999", "-1",
                     "0x10", " 5 ", "\ud800", "true", ""]),
)
JSON_VALUES = st.recursive(_SCALARS, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(TEXT, inner, max_size=4)), max_leaves=12)

FIELDS = SamplingParams.field_names()
# Mostly plausible values for the real fields, so the fuzzer gets past the first check often.
PLAUSIBLE = {
    "max_tokens": st.integers(-3, 5000), "temperature": st.floats(-1, 3), "top_p": st.floats(0, 1.5),
    "top_k": st.integers(-3, 10**6), "min_p": st.floats(-0.5, 1.5), "seed": st.integers(-5, 2**32),
    "logprobs": st.integers(-2, 30), "min_tokens": st.integers(-1, 40),
    "stop": st.lists(TEXT, max_size=4), "stop_token_ids": st.lists(st.integers(-5, 60000), max_size=4),
    "prompt_logprobs": st.integers(-2, 30),
    "logit_bias": st.dictionaries(st.one_of(st.integers(-5, 60000).map(str), TEXT), st.floats(-150, 150),
                                  max_size=4),
}
SAMPLING_DICTS = st.dictionaries(
    st.one_of(st.sampled_from(FIELDS), TEXT),
    st.one_of(JSON_VALUES, *PLAUSIBLE.values()), max_size=6)


def accepts_or_request_error(call):
    """The call's result, or None when it refused with the typed RequestError; any other exception (a bare
    ValueError included) fails the test: every refusal of a request must carry its field and kind."""
    try:
        return call()
    except RequestError:
        return None


def small_engine(model_dir):
    """An engine small enough that fuzzed turns run out of context, blocks and sessions."""
    from tests.helpers.engines import make_engine
    return make_engine(model_dir, max_model_len=96, num_blocks=24, block_size=4, max_sessions=2, max_logprobs=5)
