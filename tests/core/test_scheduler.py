"""Scheduler driven by a deterministic fake model that really pages its "KV".

The fake writes each fed token (with its position) into the slot the block table gives it, and samples
the next token from the sequence it reads back through the block table. So a wrong block table, a
prefix-cache hit on the wrong block, or a shared block overwritten by another request changes the
tokens, and the comparison with an unconstrained run fails.
"""
from __future__ import annotations

import random
from dataclasses import fields

import pytest

from backend_lib.core.errors import RequestError
from backend_lib.core.outputs import EngineStats, SchedulerOutput
from backend_lib.core.request import Request, RequestStatus
from tests.helpers.scheduler_model import EOS, VOCAB, FakeModel, expected_tokens, make, req, run, step


def test_chunked_prefill_under_a_small_budget():
    sched, model = make(budget=8), FakeModel(4)
    sched.add_request(req("a", range(1, 21), max_tokens=3))
    sizes = []
    while sched.has_unfinished_requests():
        out = sched.schedule()
        sizes.append([(c.start, c.num_tokens, c.samples) for c in out.chunks])  # samples: before the update
        sched.update_from_output(out, model.execute(out))
    assert sizes == [[(0, 8, False)], [(8, 8, False)], [(16, 4, True)], [(20, 1, True)], [(21, 1, True)]]
    assert sched.kv_cache.num_used_blocks == 0


def test_decodes_are_never_starved_and_come_first():
    sched, model = make(budget=6, max_seqs=4), FakeModel(4)
    for i in range(3):
        sched.add_request(req(f"d{i}", [10 + i, 2], max_tokens=30))
    step(sched, model)  # three 2-token prefills
    sched.add_request(req("long", range(1, 41), max_tokens=2))
    for _ in range(10):
        out, _ = step(sched, model)
        kinds = [(c.request.request_id, c.num_tokens) for c in out.chunks]
        assert kinds[:3] == [("d0", 1), ("d1", 1), ("d2", 1)]  # every decode, every step, first
        assert out.num_tokens <= 6
        if len(kinds) > 3:
            assert kinds[3] == ("long", 3)  # the prefill gets what the decodes leave
    assert sched.get_request("long").num_computed_tokens == 30


def test_fcfs_admission_stops_at_the_first_request_that_does_not_fit():
    sched, model = make(num_blocks=4, block_size=4, budget=64), FakeModel(4)
    sched.add_request(req("hold", range(1, 10), max_tokens=3))  # 3 blocks
    step(sched, model)
    sched.add_request(req("big", range(30, 37), max_tokens=1))  # needs 2 blocks, 1 is free
    sched.add_request(req("small", [5], max_tokens=1))  # would fit, must not overtake
    out, _ = step(sched, model)
    assert [c.request.request_id for c in out.chunks] == ["hold"]
    assert sched.num_waiting == 2
    done = run(sched, model)
    assert done["big"].output_token_ids == expected_tokens(list(range(30, 37)), 1)
    assert done["small"].output_token_ids == expected_tokens([5], 1)


def test_max_num_seqs_caps_running_requests():
    sched, model = make(budget=64, max_seqs=2), FakeModel(4)
    for i in range(5):
        sched.add_request(req(str(i), [i + 1], max_tokens=4))
    while sched.has_unfinished_requests():
        step(sched, model)
        assert sched.num_running <= 2


def _workload(rng: random.Random, n: int) -> list[tuple[list[int], int]]:
    prefixes = [[rng.randrange(1, VOCAB) for _ in range(rng.randint(4, 20))] for _ in range(4)]
    out = []
    for _ in range(n):
        tail = [rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 25))]
        prompt = (rng.choice(prefixes) if rng.random() < 0.6 else []) + tail
        out.append((prompt, rng.randint(1, 20)))
    return out


def test_preemption_with_a_tiny_pool_gives_identical_tokens():
    rng = random.Random(1)
    work = _workload(rng, 24)
    sched, model = make(num_blocks=14, block_size=4, budget=16, max_seqs=8), FakeModel(4)
    for i, (prompt, max_tokens) in enumerate(work):
        sched.add_request(req(str(i), prompt, max_tokens))
    done = run(sched, model)
    assert sched.num_preemptions > 0
    assert any(r.num_preemptions for r in done.values())
    for i, (prompt, max_tokens) in enumerate(work):
        r = done[str(i)]
        assert r.status is RequestStatus.FINISHED_LENGTH and r.output_token_ids == expected_tokens(prompt, max_tokens)
    assert sched.kv_cache.num_used_blocks == 0


def test_300_random_requests_with_aborts_return_every_block():
    rng = random.Random(7)
    work = _workload(rng, 300)
    sched, model = make(num_blocks=20, block_size=4, budget=24, max_seqs=12), FakeModel(4)
    pending, live, done, aborted = list(range(300)), set(), {}, set()
    while pending or sched.has_unfinished_requests():
        for _ in range(rng.randint(0, 5)):
            if pending:
                i = pending.pop(0)
                sched.add_request(req(str(i), *work[i]))
                live.add(str(i))
        if live and rng.random() < 0.2:
            victim = rng.choice(sorted(live))
            r = sched.abort_request(victim)
            assert r is not None and r.status is RequestStatus.FINISHED_ABORTED and not r.block_ids
            live.discard(victim)
            aborted.add(victim)
        for r in step(sched, model)[1]:
            if r.is_finished:
                live.discard(r.request_id)
                done[r.request_id] = r
    assert sched.num_preemptions > 0 and len(done) > 150
    assert sched.kv_cache.prefix_cache_hits > 0
    for rid, r in done.items():
        assert r.output_token_ids == expected_tokens(*work[int(rid)]), rid
    assert len(done) + len(aborted) == 300
    assert sched.kv_cache.num_used_blocks == 0
    sched.check_integrity()


def test_prefix_hits_count_into_cached_tokens():
    sched, model = make(block_size=4), FakeModel(4)
    prompt = list(range(1, 14))
    sched.add_request(req("a", prompt, max_tokens=2))
    run(sched, model)
    sched.add_request(req("b", prompt + [7, 7], max_tokens=2))
    out, _ = step(sched, model)
    assert (out.chunks[0].start, out.chunks[0].num_tokens) == (12, 3)
    done = run(sched, model)
    assert done["b"].num_cached_tokens == 12
    assert done["b"].output_token_ids == expected_tokens(prompt + [7, 7], 2)
    stats = sched.stats_counters()
    assert stats["prefix_cache_hits"] == 12 and stats["num_computed_prompt_tokens"] == 13 + 3


def test_a_request_larger_than_the_pool_fails_instead_of_looping():
    sched, model = make(num_blocks=4, block_size=4), FakeModel(4)
    sched.add_request(req("too-long-prompt", range(1, 20), max_tokens=2))  # 5 blocks > 4
    sched.add_request(req("grows-too-long", range(1, 14), max_tokens=10))  # fits, then outgrows the pool
    sched.add_request(req("ok", [3, 4], max_tokens=2))
    done = run(sched, model)
    assert done["too-long-prompt"].status is RequestStatus.FINISHED_ERROR
    assert "the pool has 4" in done["too-long-prompt"].error
    grown = done["grows-too-long"]
    assert grown.status is RequestStatus.FINISHED_ERROR and grown.num_output_tokens == 4
    assert done["ok"].output_token_ids == expected_tokens([3, 4], 2)
    assert sched.kv_cache.num_used_blocks == 0


def test_stop_checks():
    # A model that emits EOS every 3rd position lets eos / ignore_eos / min_tokens / stop_token_ids show.
    def fixed(seq):  # outputs after a 2-token prompt: 12, EOS, 11, 12, EOS, 11, ...
        return EOS if len(seq) % 3 == 0 else 10 + len(seq) % 3

    sched, model = make(max_model_len=12), FakeModel(4, fixed)
    sched.add_request(req("eos", [5, 5], max_tokens=10, ignore_eos=False))
    sched.add_request(req("ignore", [5, 5], max_tokens=5))
    sched.add_request(req("min", [5, 5], max_tokens=10, ignore_eos=False, min_tokens=3))
    sched.add_request(req("stop-id", [5, 5], max_tokens=10, stop_token_ids=[11]))
    sched.add_request(req("model-len", [5] * 9, max_tokens=10))
    done = run(sched, model)
    assert done["eos"].output_token_ids == [12, EOS] and done["eos"].stop_reason == EOS
    assert done["eos"].status is RequestStatus.FINISHED_STOPPED
    assert done["ignore"].status is RequestStatus.FINISHED_LENGTH
    assert done["ignore"].output_token_ids == [12, EOS, 11, 12, EOS]
    assert done["min"].output_token_ids == [12, EOS, 11, 12, EOS]  # the first EOS came before min_tokens
    assert done["min"].status is RequestStatus.FINISHED_STOPPED
    assert done["stop-id"].output_token_ids == [12, EOS, 11] and done["stop-id"].stop_reason == 11
    assert done["model-len"].status is RequestStatus.FINISHED_LENGTH and done["model-len"].num_tokens == 12


def test_abort_while_waiting_running_and_preempted_frees_blocks():
    sched, model = make(num_blocks=6, block_size=4, budget=8), FakeModel(4)
    sched.add_request(req("run", range(1, 9), max_tokens=12))
    sched.add_request(req("wait", range(1, 30), max_tokens=2))
    step(sched, model)
    assert sched.get_request("wait").status is RequestStatus.WAITING
    assert sched.abort_request("wait").status is RequestStatus.FINISHED_ABORTED
    assert sched.abort_request("wait") is None
    sched.add_request(req("new", range(20, 28), max_tokens=12))
    preempted = None
    for _ in range(30):
        out, _ = step(sched, model)
        if out.preempted_ids:
            preempted = out.preempted_ids[0]
            break
    assert preempted == "new" and sched.get_request("new").status is RequestStatus.PREEMPTED
    assert sched.abort_request("new").status is RequestStatus.FINISHED_ABORTED
    assert sched.abort_request("run").block_ids == []
    assert not sched.has_unfinished_requests() and sched.kv_cache.num_used_blocks == 0
    sched.check_integrity()


def test_finish_request_from_the_engine_releases_blocks():
    sched, model = make(), FakeModel(4)
    sched.add_request(req("a", [1, 2, 3], max_tokens=10))
    step(sched, model)
    r = sched.finish_request("a", RequestStatus.FINISHED_STOPPED, "stop string")
    assert r.stop_reason == "stop string" and r.is_finished
    assert sched.kv_cache.num_used_blocks == 0 and not sched.has_unfinished_requests()
    with pytest.raises(ValueError, match="finished status"):
        sched.finish_request("a", RequestStatus.RUNNING)


def _turn(sched, model, sid, rid, new_tokens, max_tokens=4) -> tuple[Request, list[SchedulerOutput]]:
    history = sched.session_history(sid)
    r = req(rid, history + new_tokens, max_tokens, session_id=sid)
    r.num_history_tokens = len(history)
    sched.add_request(r)
    outs = []
    while not r.is_finished:
        outs.append(step(sched, model)[0])
    return r, outs


def test_session_second_turn_computes_only_new_tokens():
    sched, model = make(block_size=4), FakeModel(4)
    sched.open_session("s")
    first, _ = _turn(sched, model, "s", "t1", list(range(1, 11)))
    history = sched.session_history("s")
    assert history == first.all_token_ids and len(history) == 14
    assert sched.kv_cache.num_used_blocks == 4  # 13 computed tokens pinned
    second, outs = _turn(sched, model, "s", "t2", [7, 8, 9])
    first_chunk = outs[0].chunks[0]
    assert (first_chunk.start, first_chunk.num_tokens) == (13, 4)  # history's last token + 3 new ones
    assert second.num_cached_tokens == 13
    assert second.output_token_ids == expected_tokens(history + [7, 8, 9], 4)
    assert sched.stats_counters()["num_computed_prompt_tokens"] == 10 + 4
    sched.close_session("s")
    assert not sched.has_session("s") and sched.kv_cache.num_used_blocks == 0
    sched.check_integrity()


def test_aborted_turn_keeps_the_previous_session_state():
    sched, model = make(block_size=4, budget=4), FakeModel(4)
    sched.open_session("s")
    _turn(sched, model, "s", "t1", [1, 2, 3, 4, 5])
    history = sched.session_history("s")
    r = req("t2", history + list(range(20, 30)), 4, session_id="s")
    sched.add_request(r)
    assert sched.session_busy("s")
    step(sched, model)
    step(sched, model)  # part of the new turn's prefill is computed
    sched.abort_request("t2")
    assert not sched.session_busy("s") and sched.session_history("s") == history
    # 9 history tokens; the aborted turn filled (and hashed) block 2, so the session keeps blocks 0-1 only:
    # its next turn writes position 8 on, and a hashed block may be shared, so it must stay read-only.
    assert sched.session_num_cached_tokens("s") == 8
    third, _ = _turn(sched, model, "s", "t3", [9])
    assert third.output_token_ids == expected_tokens(history + [9], 4)
    sched.close_session("s")
    assert sched.kv_cache.num_used_blocks == 0


def test_idle_sessions_lose_their_blocks_before_running_requests_are_preempted():
    sched, model = make(num_blocks=8, block_size=4, budget=32), FakeModel(4)
    sched.open_session("idle")
    _turn(sched, model, "idle", "t1", list(range(1, 12)))  # 14 tokens: 4 blocks pinned
    assert sched.kv_cache.num_used_blocks == 4
    sched.add_request(req("big", range(30, 50), max_tokens=8))  # needs 7 blocks in the end
    done = run(sched, model)
    assert sched.num_preemptions == 0 and sched.num_session_evictions == 1
    assert done["big"].output_token_ids == expected_tokens(list(range(30, 50)), 8)
    assert sched.session_num_cached_tokens("idle") == 0
    history = sched.session_history("idle")
    again, _ = _turn(sched, model, "idle", "t2", [3])  # recomputes (from the prefix cache where it survived)
    assert again.output_token_ids == expected_tokens(history + [3], 4)
    sched.close_session("idle")
    assert sched.kv_cache.num_used_blocks == 0


def test_idle_timeout_closes_sessions_and_frees_blocks():
    now = [100.0]
    sched, model = make(clock=lambda: now[0]), FakeModel(4)
    for sid in ("a", "b"):
        sched.open_session(sid)
        _turn(sched, model, sid, f"{sid}1", [1, 2, 3, 4, 5])
    now[0] = 150.0
    _turn(sched, model, "b", "b2", [6])
    assert sched.close_idle_sessions(now=180.0, idle_timeout_s=60.0) == ["a"]
    assert not sched.has_session("a") and sched.has_session("b")
    sched.add_request(req("b3", sched.session_history("b") + [1], 50, session_id="b"))
    step(sched, model)
    assert sched.close_idle_sessions(now=1000.0, idle_timeout_s=60.0) == []  # a turn is in flight
    sched.close_session("b")  # deferred until the turn ends
    run(sched, model)
    assert not sched.has_session("b") and sched.kv_cache.num_used_blocks == 0
    sched.check_integrity()


def test_session_protocol_errors():
    sched = make()
    with pytest.raises(RequestError, match="unknown session x"):
        sched.add_request(req("r", [1], session_id="x"))
    sched.open_session("x")
    with pytest.raises(ValueError, match="already open"):
        sched.open_session("x")
    sched.add_request(req("r", [1], session_id="x"))
    with pytest.raises(RequestError, match="already has a turn in flight") as info:
        sched.add_request(req("r2", [1], session_id="x"))
    assert info.value.field == "sequence_id"
    with pytest.raises(RequestError, match="already in use") as info:
        sched.add_request(req("r", [2]))
    assert info.value.field == "request_id"
    with pytest.raises(ValueError, match="max_model_len is 256"):
        sched.add_request(req("long", [1] * 256))


def test_stats_counters_fill_engine_stats():
    sched, model = make(), FakeModel(4)
    sched.add_request(req("a", [1, 2, 3], max_tokens=2))
    run(sched, model)
    counters = sched.stats_counters()
    stats = EngineStats(num_running=0, num_waiting=0, kv_blocks_total=64, **counters)
    assert stats.num_prompt_tokens == 3 and stats.num_generation_tokens == 2 and stats.kv_blocks_used == 0
    owned = {f.name for f in fields(EngineStats)} - {"num_running", "num_waiting", "kv_blocks_total",
                                                     "num_sessions",  # spec_* counters are the scheduler's
                                                     "num_refused_waiting", "num_refused_sessions",  # AsyncEngine's
                                                     "eplb", "spec_survival"}  # the executor's
    assert set(counters) == owned


def test_random_sessions_with_aborts_preemption_and_eviction_stay_exact():
    """Sessions, plain requests, aborts and a tiny pool mixed: every finished turn's tokens equal a fresh run
    of its full prompt, aborted turns leave the history alone, and closing every session frees every block."""
    rng = random.Random(3)
    sched, model = make(num_blocks=16, block_size=4, budget=12, max_seqs=6, max_model_len=200), FakeModel(4)
    sessions = {f"s{i}": None for i in range(5)}  # session id -> turn request in flight
    for sid in sessions:
        sched.open_session(sid)
    histories = {sid: [] for sid in sessions}
    plain: dict[str, tuple[list[int], int]] = {}
    n_turns = n_aborted = 0
    for i in range(400):
        for sid, turn in sessions.items():
            if turn is None and len(histories[sid]) >= 40:  # turns stay under the 64-slot pool: start over
                sched.close_session(sid)
                sched.open_session(sid)
                histories[sid] = []
            if turn is None and rng.random() < 0.3:
                new = [rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 8))]
                turn = req(f"{sid}-{i}", histories[sid] + new, rng.randint(1, 6), session_id=sid)
                turn.num_history_tokens = len(histories[sid])
                sched.add_request(turn)
                sessions[sid] = turn
        if rng.random() < 0.3:
            prompt = [rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 20))]
            plain[f"p{i}"] = (prompt, rng.randint(1, 8))
            sched.add_request(req(f"p{i}", prompt, plain[f"p{i}"][1]))
        if rng.random() < 0.1:
            busy = [t for t in sessions.values() if t is not None]
            if busy:
                victim = rng.choice(busy)
                sched.abort_request(victim.request_id)
                sessions[victim.session_id] = None
                n_aborted += 1
                assert sched.session_history(victim.session_id) == histories[victim.session_id]
        for r in step(sched, model)[1]:
            if not r.is_finished:
                continue
            if r.session_id is not None:
                assert r.output_token_ids == expected_tokens(r.prompt_token_ids, r.sampling_params.max_tokens)
                histories[r.session_id] = r.all_token_ids
                assert sched.session_history(r.session_id) == r.all_token_ids
                sessions[r.session_id] = None
                n_turns += 1
            else:
                assert r.output_token_ids == expected_tokens(*plain[r.request_id])
    run(sched, model)
    assert n_turns > 30 and n_aborted > 3
    assert sched.num_preemptions > 0 and sched.num_session_evictions > 0
    assert sched.kv_cache.num_used_blocks > 0  # sessions still pin their history
    for sid in sessions:
        sched.close_session(sid)
    assert sched.kv_cache.num_used_blocks == 0
    sched.check_integrity()
