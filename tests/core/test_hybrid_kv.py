"""The hybrid KV manager under the real scheduler, driven by a fake model whose state lives only in state slots.

The fake keeps, per state slot, the position its request reached and a digest of every token before it (as V4's
rings summarize the window and the open compressor windows). A chunk that starts at position p must find exactly
the digest of its own first p tokens in its slot, so a slot handed to the wrong request, shared by two, kept past
a preemption, or resumed at another position than the one its session reached changes the sampled tokens or
fails the assertion. Block accounting and leak checks run after every step (``check_integrity``).
"""
from __future__ import annotations

import random

import pytest

from backend_lib.core.config import CacheConfig, SchedulerConfig
from backend_lib.core.hybrid_kv import HybridKVManager, StateSlotPool
from backend_lib.core.outputs import RunnerOutput, SchedulerOutput
from backend_lib.core.scheduler import Scheduler
from tests.helpers.scheduler_model import VOCAB, expected_tokens, next_token, req, run, step


def _digest(tokens: list[int]) -> int:
    h = 0
    for t in tokens:
        h = (h * 1000003 + t + 1) % (1 << 61)
    return h


class FakeStateModel:
    """Samples ``next_token`` of the sequence, reading the prefix only through the chunk's state slot."""

    def __init__(self) -> None:
        self.state: dict[int, tuple[int, int]] = {}  # slot -> (position reached, digest of the tokens before it)

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        sampled = []
        slots = [c.state_slot for c in out.chunks]
        assert None not in slots and len(set(slots)) == len(slots), f"chunks' state slots {slots}"
        for chunk in out.chunks:
            tokens = chunk.request.all_token_ids
            if chunk.start:
                reached = self.state.get(chunk.state_slot)
                assert reached == (chunk.start, _digest(tokens[:chunk.start])), \
                    f"request {chunk.request.request_id!r} resumes at {chunk.start} but its slot holds {reached}"
            end = chunk.start + chunk.num_tokens
            self.state[chunk.state_slot] = (end, _digest(tokens[:end]))
            sampled.append([next_token(tokens[:end])] if chunk.samples else [])
        return RunnerOutput(sampled_token_ids=sampled)


def make(num_blocks=64, num_state_slots=8, budget=32, max_seqs=4, prefix=True, clock=None) -> Scheduler:
    kwargs = {} if clock is None else {"clock": clock}
    return Scheduler(SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget),
                     CacheConfig(block_size=4, num_blocks=num_blocks, enable_prefix_caching=prefix),
                     num_blocks, 256, num_state_slots=num_state_slots, **kwargs)


def _turn(sched: Scheduler, model: FakeStateModel, sid: str, rid: str, new: list[int], max_tokens: int = 4):
    r = req(rid, sched.session_history(sid) + new, max_tokens, session_id=sid)
    sched.add_request(r)
    while not r.is_finished:
        step(sched, model)
    return r


def test_slots_are_taken_at_admission_and_come_back_with_the_blocks():
    sched, model = make(budget=8), FakeStateModel()
    assert isinstance(sched.kv_cache, HybridKVManager) and not sched.kv_cache.enable_prefix_caching
    for i, n in enumerate((3, 21, 9)):
        sched.add_request(req(f"r{i}", range(1 + i, 1 + i + n), max_tokens=5))
    step(sched, model)
    assert sched.kv_cache.num_free_state_slots == 8 - sched.num_running
    done = run(sched, model)
    for i, n in enumerate((3, 21, 9)):
        assert done[f"r{i}"].output_token_ids == expected_tokens(list(range(1 + i, 1 + i + n)), 5)
    assert sched.kv_cache.num_free_state_slots == 8 and sched.kv_cache.num_used_blocks == 0


def test_prefix_caching_is_off():
    sched, model = make(), FakeStateModel()
    prompt = list(range(1, 30))
    sched.add_request(req("a", prompt))
    run(sched, model)
    sched.add_request(req("b", prompt))
    done = run(sched, model)
    assert done["b"].num_cached_tokens == 0 and sched.kv_cache.prefix_cache_hits == 0
    with pytest.raises(ValueError, match="prefix caching is off"):
        sched.kv_cache.allocate(req("c", prompt), 4, computed_block_ids=[0])


def test_a_session_keeps_its_slot_between_turns_and_gives_it_back_at_end():
    sched, model = make(), FakeStateModel()
    sched.open_session("s")
    first = _turn(sched, model, "s", "t1", list(range(1, 12)))
    assert sched.kv_cache.num_free_state_slots == 7 and sched.session_num_cached_tokens("s") == 14
    second = _turn(sched, model, "s", "t2", [7, 8, 9])
    assert second.num_cached_tokens == 14
    assert second.output_token_ids == expected_tokens(first.all_token_ids + [7, 8, 9], 4)
    sched.close_session("s")
    assert sched.kv_cache.num_free_state_slots == 8 and sched.kv_cache.num_used_blocks == 0
    sched.check_integrity()


def test_a_turn_aborted_past_its_history_drops_the_state_it_cannot_rewind():
    sched, model = make(budget=4), FakeStateModel()
    sched.open_session("s")
    _turn(sched, model, "s", "t1", [1, 2, 3, 4, 5])
    history = sched.session_history("s")
    sched.add_request(req("t2", history + list(range(20, 30)), 4, session_id="s"))
    step(sched, model)
    step(sched, model)  # the slot's state is now past the history's end
    sched.abort_request("t2")
    assert sched.session_num_cached_tokens("s") == 0 and sched.kv_cache.num_free_state_slots == 8
    third = _turn(sched, model, "s", "t3", [9])
    assert third.output_token_ids == expected_tokens(history + [9], 4)


def test_out_of_slots_idle_sessions_lose_their_state_and_nothing_hangs():
    """Two slots: a session keeps one between turns; two plain requests need both, so the session's state is
    evicted (like its blocks) and its next turn recomputes its history."""
    sched, model = make(num_state_slots=2, max_seqs=2), FakeStateModel()
    sched.open_session("s")
    first = _turn(sched, model, "s", "t1", [1, 2, 3])
    for rid in ("a", "b"):
        sched.add_request(req(rid, range(5, 15), max_tokens=3))
    done = run(sched, model)
    assert sched.num_session_evictions == 1 and sched.session_num_cached_tokens("s") == 0
    assert done["a"].output_token_ids == done["b"].output_token_ids == expected_tokens(list(range(5, 15)), 3)
    again = _turn(sched, model, "s", "t2", [4])
    assert again.num_cached_tokens == 0
    assert again.output_token_ids == expected_tokens(first.all_token_ids + [4], 4)


def test_random_traffic_with_sessions_aborts_and_preemption_stays_exact():
    rng = random.Random(5)
    sched, model = make(num_blocks=20, num_state_slots=6 + 4, budget=12, max_seqs=6), FakeStateModel()
    sessions = {f"s{i}": None for i in range(4)}
    histories = {sid: [] for sid in sessions}
    plain: dict[str, tuple[list[int], int]] = {}
    for sid in sessions:
        sched.open_session(sid)
    n_turns = 0
    for i in range(300):
        for sid, turn in sessions.items():
            if turn is None and len(histories[sid]) >= 40:
                sched.close_session(sid)
                sched.open_session(sid)
                histories[sid] = []
            if turn is None and rng.random() < 0.3:
                new = [rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 8))]
                sessions[sid] = req(f"{sid}-{i}", histories[sid] + new, rng.randint(1, 6), session_id=sid)
                sched.add_request(sessions[sid])
        if rng.random() < 0.3:
            prompt = [rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 24))]
            plain[f"p{i}"] = (prompt, rng.randint(1, 8))
            sched.add_request(req(f"p{i}", prompt, plain[f"p{i}"][1]))
        if rng.random() < 0.08:
            busy = [t for t in sessions.values() if t is not None]
            if busy:
                victim = rng.choice(busy)
                sched.abort_request(victim.request_id)
                sessions[victim.session_id] = None
        for r in step(sched, model)[1]:
            if not r.is_finished:
                continue
            if r.session_id is not None:
                assert r.output_token_ids == expected_tokens(r.prompt_token_ids, r.sampling_params.max_tokens)
                histories[r.session_id], sessions[r.session_id] = r.all_token_ids, None
                n_turns += 1
            else:
                assert r.output_token_ids == expected_tokens(*plain[r.request_id])
    run(sched, model)
    assert n_turns > 20 and sched.num_preemptions > 0
    for sid in sessions:
        sched.close_session(sid)
    assert sched.kv_cache.num_used_blocks == 0 and sched.kv_cache.num_free_state_slots == 10
    sched.check_integrity()


def test_slot_pool_refuses_double_frees_and_finds_leaks():
    pool = StateSlotPool(3)
    a, b = pool.take(), pool.take()
    pool.give_back(a)
    with pytest.raises(ValueError, match="not held"):
        pool.give_back(a)
    pool.check_integrity([b])
    with pytest.raises(AssertionError, match="held slots"):
        pool.check_integrity([])  # b is held but no live owner has it: leaked
    with pytest.raises(ValueError, match="num_state_slots must be >= 1"):
        StateSlotPool(0)
