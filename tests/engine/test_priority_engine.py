"""Request priority through the engine: the intake's `priority` field, a saturated engine under
scheduling_policy=priority (a late high-priority request finishes before earlier low-priority ones; fcfs keeps
arrival order), and a session's priority across turns."""
from __future__ import annotations

import pytest

from backend_lib.core.config import EngineConfig
from backend_lib.core.errors import RequestError
from backend_lib.core.outputs import SessionControl
from backend_lib.core.sampling_params import SamplingParams
from backend_lib.engine.intake import RequestRules, take_in
from backend_lib.engine.llm_engine import LLMEngine

PARAMS = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def test_the_intake_takes_priority_from_the_fields_and_names_it_when_refused():
    rules = RequestRules()
    assert take_in(rules, "hi", {"priority": " -3 ", "max_tokens": 2}).priority == -3  # a request parameter string
    assert take_in(rules, "hi", {}).priority is None  # not given: 0, or a session's own
    assert take_in(rules, "hi", PARAMS, priority=7).priority == 7  # Python callers
    for value, needle in ((1.5, "priority must be an integer"), ("soon", "priority must be an integer"),
                          (True, "priority must be an integer"), (2**31, "priority must be in [-2147483648, ")):
        with pytest.raises(RequestError) as info:
            take_in(rules, "hi", {"priority": value})
        assert info.value.field == "priority" and needle in str(info.value)


@pytest.fixture(scope="module")
def engines(tiny_llama_dir):
    """Two seats each, so a burst saturates them; one engine per policy."""
    def build(policy: str) -> LLMEngine:
        return LLMEngine(EngineConfig.from_flat({"model": str(tiny_llama_dir), "max_model_len": 64, "num_blocks": 64,
                                                 "max_num_seqs": 2, "scheduling_policy": policy}))
    return {policy: build(policy) for policy in ("priority", "fcfs")}


def _finish_order(engine: LLMEngine, late: tuple[str, int] | None = None) -> list[str]:
    """Steps to the end; ``late`` (id, priority; 2 tokens, so it ends before what starts with it) comes in after the
    first step, when every seat is taken."""
    order, steps = [], 0
    while engine.has_unfinished_requests():
        order += [out.request_id for out in engine.step() if out.finished]
        steps += 1
        if steps == 1 and late is not None:
            engine.add_request(late[0], [9, 9, 9], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True),
                               priority=late[1])
    return order


@pytest.mark.parametrize("policy", ["priority", "fcfs"])
def test_a_late_high_priority_request_overtakes_the_waiting_low_ones(engines, policy):
    engine = engines[policy]
    for i in range(6):
        engine.add_request(f"low{i}", [3 + i, 5, 7], PARAMS, priority=5)
    order = _finish_order(engine, late=("high", 0))
    lows = [f"low{i}" for i in range(6)]
    assert sorted(order) == sorted(lows + ["high"])
    waiting_lows = lows[2:]  # low0 and low1 held the seats when high came
    if policy == "priority":
        assert order.index("high") < min(order.index(r) for r in waiting_lows), order
        assert [r for r in order if r != "high"] == lows  # equal priorities: first come, first served
    else:
        assert order == lows + ["high"]
    engine.scheduler.check_integrity()


def test_a_session_keeps_its_priority_until_a_turn_changes_it(engines):
    engine = engines["priority"]
    turns = [("t1", SessionControl("s", start=True), -3, -3), ("t2", SessionControl("s"), None, -3),
             ("t3", SessionControl("s"), 2, 2), ("t4", SessionControl("s", end=True), None, 2)]
    for request_id, control, given, expected in turns:
        engine.add_request(request_id, [5, 6], PARAMS, control, priority=given)
        assert engine.scheduler.get_request(request_id).priority == expected, request_id
        _finish_order(engine)
    assert engine.scheduler.sessions.get("s") is None
