"""The intake (backend_lib/engine/intake.py) and the one session table: every refusal a typed RequestError naming
the field; the engine reads and writes sessions only through the scheduler's SessionTable."""
from __future__ import annotations

import pytest

from backend_lib.core.config import RequestLimits
from backend_lib.core.errors import ErrorKind, RequestError
from backend_lib.core.outputs import SessionControl
from backend_lib.core.sampling_params import SamplingParams
from backend_lib.engine.intake import (coerce, parse_messages, parse_sampling,
                                       parse_session)
from backend_lib.structured_output.constraints import ConstraintKind
from tests.helpers.engines import drive, make_engine


# ---- values (no engine) ------------------------------------------------------------------------------------


@pytest.mark.parametrize("fields, field, limit", [
    ({"temperature": "hot"}, "temperature", None),  # coercion names the field
    ({"speculative": "perhaps"}, "speculative", None),
    ({"top_k": 0}, "top_k", None),  # a range (SamplingParams)
    ({"seed": 2**31}, "seed", None),
    ({"bogus": 1}, "bogus", None),  # the one unknown-field check
    ({"guided_regex": "x" * 9}, "guided_regex", "max_schema_chars"),  # structured output, under the server's limit
    ({"structured_outputs": {"json": {"type": "object"}, "regex": "a"}}, "structured_outputs", None),
    ({"structured_outputs": {"choice": ["a", "b", "c"]}}, "structured_outputs", "max_choices"),
])
def test_parse_sampling_refuses_with_the_field(fields, field, limit):
    with pytest.raises(RequestError) as info:
        parse_sampling(fields, RequestLimits(max_schema_chars=8, max_choices=2))
    assert (info.value.field, info.value.kind, info.value.limit) == (field, ErrorKind.INVALID, limit)
    assert field in str(info.value)  # a person reads it too


def test_parse_sampling_coerces_strings_and_keeps_the_constraint():
    params = parse_sampling({"temperature": "0.5", "max_tokens": " 7 ", "ignore_eos": "yes",
                             "structured_outputs": {"choice": ["yes", "no"]}}, RequestLimits())
    assert (params.temperature, params.max_tokens, params.ignore_eos) == (0.5, 7, True)
    assert params.structured_outputs.kind is ConstraintKind.CHOICE and params.structured_outputs.spec == ("yes", "no")
    assert coerce("stop", "x") == "x"  # untyped fields are SamplingParams' to judge


def test_prompt_and_session_values():
    assert parse_messages("messages", '[{"role": "user", "content": "hi"}]') == [{"role": "user", "content": "hi"}]
    with pytest.raises(RequestError) as info:
        parse_messages("messages", "[" * 50_000)  # the recursion guard
    assert info.value.field == "messages" and "nested too deeply" in str(info.value)
    assert parse_session({}, 0) is None
    assert parse_session({"sequence_id": "7", "sequence_start": "true"}) == SessionControl("7", start=True)
    assert parse_session({}, 9, start=False, end=True) == SessionControl("9", end=True)
    for values in ({"sequence_start": True}, {"sequence_id": 1.5}, {"sequence_id": 3, "sequence_end": "later"}):
        with pytest.raises(RequestError) as info:
            parse_session(values)
        assert info.value.field in ("sequence_id", "sequence_end")


# ---- the one session table ------------------------------------------------------------------------------------


@pytest.fixture
def engine(tiny_llama_dir):
    return make_engine(tiny_llama_dir, max_model_len=64, num_blocks=64, max_sessions=2)



def test_the_engine_keeps_no_session_table_of_its_own(engine):
    """A chat turn in flight is the scheduler table's (so a second turn is refused there), its answer joins the
    conversation kept there, END removes it there; the engine's session count is that table's."""
    sessions = engine.scheduler.sessions
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    engine.add_request("c1", [{"role": "user", "content": "hi"}], params, SessionControl("chat", start=True))
    assert sessions.busy("chat") and engine.stats().num_sessions == len(sessions) == 1
    with pytest.raises(RequestError, match="already has a turn in flight") as info:
        engine.add_request("c2", [{"role": "user", "content": "again"}], params, SessionControl("chat"))
    assert info.value.field == "sequence_id"
    drive(engine)
    assert not sessions.busy("chat")
    assert [m["role"] for m in sessions.get("chat").messages] == ["user", "assistant"]
    engine.add_request("c3", [{"role": "user", "content": "bye"}], params, SessionControl("chat", end=True))
    drive(engine)
    assert sessions.get("chat") is None and engine.stats().num_sessions == 0


def test_a_refused_start_opens_nothing_and_idle_sessions_close_in_the_one_table(engine):
    params = SamplingParams(max_tokens=2, temperature=0.0)
    with pytest.raises(RequestError) as info:  # past the context: refused before the session is opened
        engine.add_request("long", list(range(5, 70)), params, SessionControl("s", start=True))
    assert info.value.field == "prompt" and engine.scheduler.sessions.get("s") is None
    with pytest.raises(RequestError) as info:  # no START: unknown
        engine.add_request("t", [5, 6], params, SessionControl("s"))
    assert info.value.field == "sequence_id" and "unknown session s" in str(info.value)
    engine.add_request("a", [5, 6], params, SessionControl("s", start=True))
    engine.add_request("b", [5, 6], params, SessionControl("u", start=True))
    with pytest.raises(RequestError) as info:
        engine.add_request("c", [5, 6], params, SessionControl("v", start=True))
    assert info.value.busy and info.value.limit == "max_sessions"
    drive(engine)
    assert sorted(engine.close_idle_sessions(now=float("inf"))) == ["s", "u"]
    assert len(engine.scheduler.sessions) == 0
    engine.scheduler.check_integrity()


def test_a_constraint_parsed_at_the_intake_is_applied_by_the_engine(engine):
    """The intake's guided_choice reaches the sampler: the output is one of the choices, ended by the grammar."""
    params = parse_sampling({"guided_choice": ["yes", "no"], "max_tokens": 8, "temperature": 1.0, "seed": 3},
                            RequestLimits())
    engine.add_request("g", [5, 6], params)
    outputs = drive(engine)["g"]
    assert "".join(o.new_text for o in outputs) in ("yes", "no") and outputs[-1].finish_reason == "stop"
