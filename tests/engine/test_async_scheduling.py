"""Zero-overhead scheduling (async_scheduling): the same streams as without it, token for token, through stop tokens,
stop strings, length limits, penalties and logprobs, grammars, preemption, cancels mid-stream, session turns and the
server loop (AsyncEngine), a failed step with the next in flight, two tensor-parallel ranks; speculation (n-gram,
MTP) steps in turn with the same tokens; the scheduler alone scheduling ahead gives the sequential one's tokens; no
block leaks."""
from __future__ import annotations

import random
from functools import partial

import pytest

from backend_lib.core.async_scheduler import AsyncScheduler
from backend_lib.core.config import CacheConfig, EngineConfig, SchedulerConfig
from backend_lib.core.outputs import RunnerOutput
from backend_lib.core.request import Request
from backend_lib.core.scheduler import Scheduler
from backend_lib.core.outputs import SessionControl
from backend_lib.core.sampling_params import SamplingParams
from backend_lib.engine.async_engine import AsyncEngine
from backend_lib.engine.faults import FaultConfig
from backend_lib.frontend.triton.parameters import engine_config_from_parameters
from backend_lib.structured_output.constraints import parse_constraint
from backend_lib.tools.tiny import make_tiny
from tests.helpers.engines import drive, final_outputs, full_texts, make_engine, new_tokens
from tests.helpers.scheduler_model import EOS, VOCAB, FakeModel, next_token, req

# A pool small enough that the mixed workload preempts.
ENGINE = {"max_model_len": 256, "num_blocks": 30, "block_size": 4, "max_num_batched_tokens": 32, "max_num_seqs": 12}
SCHEMA = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                                           "ok": {"type": "boolean"}},
          "required": ["id", "ok"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny("llama", tmp_path_factory.mktemp("async_llama"))


@pytest.fixture(scope="module")
def pair(tiny):
    """(off, on): the same engine without and with async_scheduling."""
    off, on = make_engine(tiny, ENGINE), make_engine(tiny, ENGINE, async_scheduling=True)
    assert isinstance(on.scheduler, AsyncScheduler) and not isinstance(off.scheduler, AsyncScheduler)
    yield off, on
    off.close()
    on.close()


def _clean(engine) -> None:
    engine.scheduler.check_integrity()
    assert engine.stats().kv_blocks_used == 0 and not engine.has_unfinished_requests()


def _summary(outputs) -> dict[str, tuple]:
    """Per request: its streamed ids, text, finish and stop reasons, and logprobs."""
    finals, texts, ids = final_outputs(outputs), full_texts(outputs), new_tokens(outputs)
    logprobs = {rid: [(lp.token_id, round(lp.logprob, 4)) for out in outs for lp in out.new_logprobs or []]
                for rid, outs in outputs.items()}
    return {rid: (ids[rid], texts[rid], finals[rid].finish_reason, finals[rid].stop_reason, logprobs[rid])
            for rid in outputs}


def _workload() -> dict[str, tuple[list[int], SamplingParams]]:
    json_schema = parse_constraint({"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}})
    regex = parse_constraint({"guided_regex": r"[a-z]{2,6}-[0-9]{1,3}"})
    requests = {}
    for i in range(12):
        kind = i % 7
        params = SamplingParams(max_tokens=6 + 2 * i, temperature=0.0 if i % 3 else 1.0, seed=i, ignore_eos=True)
        if kind == 1:
            params = params.clone(stop=["e", "or"])
        elif kind == 2:
            params = params.clone(stop=["a"], include_stop_str_in_output=True)
        elif kind == 3:
            params = params.clone(ignore_eos=False, stop_token_ids=list(range(40, 100)))
        elif kind == 4:
            params = params.clone(repetition_penalty=1.3, frequency_penalty=0.5, logprobs=2)
        elif kind == 5:
            params = params.clone(structured_outputs=json_schema, max_tokens=60, ignore_eos=False)
        elif kind == 6:
            params = params.clone(structured_outputs=regex, max_tokens=20, ignore_eos=False)
        requests[f"r{i}"] = ([5 + i, 9, 17, 30 + i] * (1 + i % 4), params)
    return requests


def test_mixed_workload_gives_the_same_streams(pair):
    off, on = pair
    preemptions = on.stats().num_preemptions
    expected, got = _summary(drive(off, _workload())), _summary(drive(on, _workload()))
    assert got == expected
    reasons = {s[2] for s in got.values()}
    assert {"stop", "length"} <= reasons and any(isinstance(s[3], str) for s in got.values())  # a stop string hit
    assert on.stats().num_preemptions > preemptions
    _clean(off)
    _clean(on)


def test_cancel_mid_stream_streams_nothing_after_it(pair):
    off, on = pair
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    streams = {}
    for engine in pair:
        outputs: dict[str, list] = {}
        requests = {f"c{i}": ([7, 8 + i, 9], params) for i in range(4)}

        def cancel(out, engine=engine, outputs=outputs):
            outputs.setdefault(out.request_id, []).append(out)
            if out.request_id in ("c1", "c2") and len(outputs[out.request_id]) == 3 + int(out.request_id[1]):
                final = engine.abort(out.request_id)
                assert final.finish_reason == "abort" and not final.new_token_ids
        drive(engine, requests, on_output=cancel)
        streams[engine is on] = {rid: [t for o in outs for t in o.new_token_ids] for rid, outs in outputs.items()}
        _clean(engine)
    assert streams[True] == streams[False]
    assert len(streams[True]["c1"]) == 4 and len(streams[True]["c0"]) == 40


def test_session_turns_give_the_same_tokens(pair):
    turns = [([5, 6, 7], SessionControl("s", start=True)), ([8, 9], SessionControl("s")),
             ([10, 11, 12], SessionControl("s", end=True))]
    got = {}
    for engine in pair:
        ids, cached = [], []
        for n, (prompt, control) in enumerate(turns):
            engine.add_request(f"t{n}", prompt, SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True),
                               session=control)
            final = final_outputs(outputs := drive(engine))[f"t{n}"]
            ids.append(new_tokens(outputs)[f"t{n}"])
            cached.append(final.num_cached_tokens)
        got[engine is pair[1]] = (ids, cached)
        _clean(engine)
    assert got[True] == got[False] and got[True][1][1] > 0  # the second turn reused the session's KV


def test_the_server_loop_gives_the_same_tokens(tiny):
    params = [SamplingParams(max_tokens=12, temperature=t, seed=s, ignore_eos=True)
              for t, s in [(0.0, 0), (1.0, 1), (0.8, 2)]]
    prompts = [[5, 6, 7], [8, 9, 10, 11], [12]]

    results = []
    for flag in (False, True):
        engine = AsyncEngine(EngineConfig.from_flat({"model": str(tiny), **ENGINE, "async_scheduling": flag}))
        try:
            streams = [engine.add_request(f"a{i}", prompt, p) for i, (prompt, p) in enumerate(zip(prompts, params))]
            results.append([[t for out in stream for t in out.new_token_ids] for stream in streams])
        finally:
            engine.shutdown()
    assert results[0] == results[1]


@pytest.mark.parametrize("spec", [{"method": "ngram", "num_speculative_tokens": 3}])
def test_speculation_steps_in_turn_with_the_same_tokens(pair, tiny, spec):
    """A proposer's acceptance decides where the next step starts: these engines do not overlap steps."""
    off = pair[0]
    requests = {f"n{i}": ([5, 6, 7, 8] * 4, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
                for i in range(3)}
    engine = make_engine(tiny, ENGINE, async_scheduling=True, **spec)
    assert not isinstance(engine.scheduler, AsyncScheduler)
    assert new_tokens(drive(engine, dict(requests))) == new_tokens(drive(off, dict(requests)))
    assert engine.stats().spec_draft_tokens > 0
    _clean(engine)
    engine.close()


def test_a_failed_step_with_the_next_in_flight_ends_its_requests_and_the_engine_goes_on(tiny):
    """Step 3 raises on the device thread while step 4 is already submitted behind it: both are dropped, every
    request ends with the error, no block leaks, and the next request runs as on a fresh engine."""
    engine = make_engine(tiny, ENGINE, async_scheduling=True,
                         engine_type=partial(AsyncEngine, faults=FaultConfig(step=3, kind="transient")))
    try:
        streams = [engine.add_request(f"f{i}", [3 + i, 5, 7], SamplingParams(max_tokens=30, ignore_eos=True))
                   for i in range(3)]
        for stream in streams:
            last = list(stream)[-1]
            assert last.finish_reason == "error" and "fault injected at engine step 3" in last.error
        assert engine.failure is None and engine.stats().kv_blocks_used == 0
        after = list(engine.add_request("g", [3, 5, 7], SamplingParams(max_tokens=5, temperature=0.0,
                                                                       ignore_eos=True)))
        assert after[-1].finish_reason == "length"
        plain = make_engine(tiny, ENGINE)
        expected = new_tokens(drive(plain, {"g": ([3, 5, 7], SamplingParams(max_tokens=5, temperature=0.0,
                                                                            ignore_eos=True))}))["g"]
        plain.close()
        assert [t for out in after for t in out.new_token_ids] == expected
    finally:
        engine.shutdown()


@pytest.mark.slow
def test_mtp_steps_in_turn_with_the_same_tokens(tmp_path):
    """Tiny DeepSeek-V3 (MLA, MoE) with MTP drafts under async_scheduling (steps in turn) against the same model
    overlapping its plain steps: greedy ids equal."""
    path = make_tiny("deepseek_v3", tmp_path / "v3", seed=7, mtp_layers=1)
    requests = {f"m{i}": ([5 + i, 6, 7, 8], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
                for i in range(3)}
    got = []
    for spec in ({"method": "mtp", "num_speculative_tokens": 2}, {}):
        engine = make_engine(path, ENGINE, async_scheduling=True, **spec)
        assert isinstance(engine.scheduler, AsyncScheduler) == (not spec)
        got.append(new_tokens(drive(engine, dict(requests))))
        assert (engine.stats().spec_draft_tokens > 0) == bool(spec)
        _clean(engine)
        engine.close()
    assert got[0] == got[1]


@pytest.mark.slow
def test_two_tensor_parallel_ranks_give_one_ranks_tokens(pair, tiny):
    """The placeholder rows are filled on the driver before the step goes to the worker rank (its forward pairs up
    with the driver's, from the device thread), and prompt logprobs' head calls still pair up."""
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=2, prompt_logprobs=1)
    requests = {f"p{i}": ([5 + i, 6, 7, 8 + i], params) for i in range(3)}
    engine = make_engine(tiny, ENGINE, async_scheduling=True, tensor_parallel_size=2)
    try:
        assert isinstance(engine.scheduler, AsyncScheduler)
        got = new_tokens(drive(engine, dict(requests)))
        _clean(engine)
    finally:
        engine.close()
    assert got == new_tokens(drive(pair[0], dict(requests)))


def _eos_sometimes(seq: list[int]) -> int:
    token = next_token(seq)
    return EOS if token % 11 == 0 else token


def test_scheduling_ahead_gives_the_sequential_schedulers_tokens():
    """The scheduler alone (FakeModel reads every token back from its KV slot, so a block given away while a step
    still writes it, or a placeholder left in a sequence, shows up as a wrong token): random prompts, EOS found only
    when sampled, length limits, aborts between steps and a pool small enough to preempt projected requests."""
    rng = random.Random(3)
    requests = [([rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 14))], rng.randint(1, 12),
                 rng.random() < 0.5) for _ in range(40)]
    aborts = {rng.randrange(40): rng.randint(1, 6) for _ in range(6)}  # request -> after how many of its tokens

    def run(ahead: bool) -> dict[str, Request]:
        config = SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=24)
        cache = CacheConfig(block_size=4, num_blocks=14, enable_prefix_caching=True)
        scheduler = (AsyncScheduler if ahead else Scheduler)(config, cache, 14, 64)
        model = FakeModel(4, _eos_sometimes)
        live = {}
        for i, (prompt, max_tokens, eos) in enumerate(requests):
            live[str(i)] = req(str(i), prompt, max_tokens=max_tokens, ignore_eos=not eos)
            scheduler.add_request(live[str(i)])
        in_flight = None
        for _ in range(5000):
            if not scheduler.has_unfinished_requests() and in_flight is None:
                break
            # The device runs the step in flight (its KV written before the next step's) while the next is
            # scheduled; then the step in flight is committed.
            result = model.execute(in_flight) if ahead and in_flight is not None else None
            out = scheduler.schedule_ahead(in_flight) if ahead else scheduler.schedule()
            if result is not None:
                scheduler.update_from_output(in_flight, result)
            if not ahead:
                scheduler.update_from_output(out, model.execute(out))
            in_flight = out if ahead and out.chunks else None
            if ahead and in_flight is None:
                scheduler.update_from_output(out, RunnerOutput([]))
            for rid, after in aborts.items():  # between calls: no projection is live
                if live[str(rid)].num_output_tokens >= after and not live[str(rid)].is_finished:
                    scheduler.abort_request(str(rid))
            scheduler.check_integrity()
        assert not scheduler.has_unfinished_requests() and scheduler.kv_cache.num_used_blocks == 0
        assert scheduler.num_preemptions > 0
        return live

    sequential, ahead = run(False), run(True)
    finished = [rid for rid, r in sequential.items() if int(rid) not in aborts]
    assert any(sequential[rid].stop_reason == EOS for rid in finished)
    for rid in finished:
        assert (ahead[rid].output_token_ids, ahead[rid].status) == (sequential[rid].output_token_ids,
                                                                    sequential[rid].status), rid
    for rid in map(str, aborts):  # an abort lands after a step or two more on one side: the same tokens so far
        shorter, longer = sorted((ahead[rid].output_token_ids, sequential[rid].output_token_ids), key=len)
        assert longer[:len(shorter)] == shorter


def test_the_setting_arrives_from_config_pbtxt_parameters():
    assert engine_config_from_parameters({"async_scheduling": "true"}).scheduler.async_scheduling
    assert not engine_config_from_parameters({"async_scheduling": ""}).scheduler.async_scheduling
    assert not EngineConfig().scheduler.async_scheduling  # off by default (benchmarks/results/async_scheduling.md)
