"""Engine failures in AsyncEngine: a failed step ends its requests with an error (never a hang); a fatal one
kills the engine for good (waiting and new requests get the error, the owner is told why)."""
from __future__ import annotations

import threading
from functools import partial

import pytest

from backend_lib.core.sampling_params import SamplingParams
from backend_lib.engine.async_engine import AsyncEngine, EngineDeadError
from backend_lib.engine.faults import FaultConfig
from tests.helpers.engines import make_engine

LONG = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)
SHORT = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


ENGINE = {"num_blocks": 64, "max_model_len": 256}


def _last(stream, timeout_s: float = 60.0):
    while True:
        output = stream.get(timeout=timeout_s)  # raises TimeoutError instead of hanging
        if output.finished:
            return output


def test_fault_config_from_env():
    assert FaultConfig.from_env({}) == FaultConfig(step=0)
    assert FaultConfig.from_env({"DEEPINFER_FAULT_STEP": "7"}) == FaultConfig(step=7, kind="fatal")
    assert FaultConfig.from_env({"DEEPINFER_FAULT_STEP": "2", "DEEPINFER_FAULT_KIND": "transient"}).kind == "transient"
    with pytest.raises(ValueError, match="DEEPINFER_FAULT_STEP must be an integer"):
        FaultConfig.from_env({"DEEPINFER_FAULT_STEP": "soon"})
    with pytest.raises(ValueError, match="DEEPINFER_FAULT_KIND must be one of"):
        FaultConfig.from_env({"DEEPINFER_FAULT_STEP": "1", "DEEPINFER_FAULT_KIND": "sometimes"})


def test_transient_step_failure_ends_its_requests_and_the_engine_goes_on(tiny_llama_dir):
    faults = FaultConfig(step=3, kind="transient")
    engine = make_engine(tiny_llama_dir, ENGINE, engine_type=partial(AsyncEngine, faults=faults))
    try:
        failed = _last(engine.add_request("a", [3, 5, 7], LONG))
        assert failed.finish_reason == "error" and "fault injected at engine step 3" in failed.error
        assert engine.failure is None
        assert engine.stats().kv_blocks_used == 0  # the failed step's blocks went back to the pool
        after = _last(engine.add_request("b", [3, 5, 7], SHORT))
        assert after.finish_reason == "length" and after.num_output_tokens == 4
    finally:
        engine.shutdown()


def test_fatal_step_failure_kills_the_engine_and_says_why(tiny_llama_dir):
    faults = FaultConfig(step=3, kind="fatal")
    engine = make_engine(tiny_llama_dir, ENGINE, engine_type=partial(AsyncEngine, faults=faults))
    told = []
    died = threading.Event()
    engine.on_failure = lambda reason: (told.append(reason), died.set())
    try:
        streams = [engine.add_request(f"r{i}", [3 + i, 5, 7], LONG) for i in range(3)]
        for stream in streams:
            last = _last(stream)
            assert last.finish_reason == "error" and "FatalEngineError" in last.error
        assert died.wait(30)
        assert len(told) == 1 and "fault injected at engine step 3" in told[0]
        assert engine.failure == told[0]
        with pytest.raises(EngineDeadError, match="cannot serve requests: .*fault injected"):
            engine.add_request("late", [3, 5, 7], SHORT)
    finally:
        engine.shutdown()  # returns although the loop already ended


def test_a_failure_outside_the_step_never_leaves_a_stream_hanging(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir, ENGINE, engine_type=partial(AsyncEngine, faults=FaultConfig()))
    died = threading.Event()
    engine.on_failure = lambda reason: died.set()
    try:
        admit = engine.engine.add_prepared

        def broken_admit(prepared):
            raise RuntimeError("admission bug")
        engine.engine.add_prepared = broken_admit  # one request's admission fails: it ends, the engine goes on
        failed = _last(engine.add_request("a", [3, 5, 7], SHORT))
        assert failed.finish_reason == "error" and "admission bug" in failed.error
        engine.engine.add_prepared = admit
        assert _last(engine.add_request("b", [3, 5, 7], SHORT)).finish_reason == "length"

        def broken_housekeeping(*args):
            raise RuntimeError("housekeeping bug")
        engine.engine.close_idle_sessions = broken_housekeeping  # the loop itself fails: the engine dies, says why
        assert died.wait(30)
        assert "the engine loop failed: RuntimeError: housekeeping bug" in engine.failure
        with pytest.raises(EngineDeadError):
            engine.add_request("c", [3, 5, 7], SHORT)
    finally:
        engine.shutdown()
