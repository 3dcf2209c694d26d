"""scheduling_policy on the scheduler alone (core/scheduling_policy.py), with a clock the test moves: admission by
priority (FCFS within one), preemption of the lowest-priority running request, aging under a steady stream of
higher-priority requests, and fcfs as it was."""
from __future__ import annotations

import pytest

from backend_lib.core.config import CacheConfig, SchedulerConfig
from backend_lib.core.outputs import RunnerOutput
from backend_lib.core.request import Request
from backend_lib.core.sampling_params import SamplingParams
from backend_lib.core.scheduler import Scheduler

BLOCK_SIZE = 4


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _scheduler(clock: _Clock, policy: str, num_blocks: int = 64, max_num_seqs: int = 8,
               aging_s: float = 10.0) -> Scheduler:
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=64, scheduling_policy=policy,
                             priority_aging_s=aging_s)
    return Scheduler(config, CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=False), num_blocks,
                     max_model_len=256, clock=clock)


def _add(scheduler: Scheduler, clock: _Clock, request_id: str, priority: int, max_tokens: int = 4) -> None:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    scheduler.add_request(Request(request_id, [1, 2, 3, 4], params, seed=0, arrival_time=clock.now,
                                  priority=priority))


def _step(scheduler: Scheduler) -> tuple[list[str], list[str]]:
    """One step with a stand-in model (every sampling chunk gets token 1): (finished ids, preempted ids)."""
    out = scheduler.schedule()
    runner = RunnerOutput(sampled_token_ids=[[1] if chunk.samples else [] for chunk in out.chunks])
    finished = [r.request_id for r in scheduler.update_from_output(out, runner) if r.is_finished]
    return finished, list(out.preempted_ids)


def _finish_order(scheduler: Scheduler, limit: int = 500) -> list[str]:
    order = []
    for _ in range(limit):
        if not scheduler.has_unfinished_requests():
            return order
        order += _step(scheduler)[0]
    raise AssertionError(f"not done after {limit} steps: {order}")


@pytest.mark.parametrize("policy, expected", [
    ("priority", ["c", "d", "a", "b"]),  # lower first; equal priorities in arrival order
    ("fcfs", ["a", "b", "c", "d"]),  # the priorities change nothing
])
def test_admission_order(policy, expected):
    clock = _Clock()
    scheduler = _scheduler(clock, policy, max_num_seqs=1)
    for request_id, priority in (("a", 1), ("b", 1), ("c", 0), ("d", 0)):
        _add(scheduler, clock, request_id, priority)
    assert _finish_order(scheduler) == expected
    scheduler.check_integrity()


@pytest.mark.parametrize("policy, first_victim", [("priority", "low"), ("fcfs", "high2")])
def test_a_full_pool_preempts_the_lowest_priority_first(policy, first_victim):
    """low runs first (alone), high1 and high2 join; the 6-block pool then runs dry as the three grow past two blocks
    each. fcfs preempts the newest (high2), priority the lowest-priority one (low) though it is the oldest."""
    clock = _Clock()
    scheduler = _scheduler(clock, policy, num_blocks=6)
    _add(scheduler, clock, "low", 5, max_tokens=12)
    _step(scheduler)
    _add(scheduler, clock, "high1", 0, max_tokens=12)
    _add(scheduler, clock, "high2", 0, max_tokens=12)
    victims = []
    for _ in range(100):
        if not scheduler.has_unfinished_requests():
            break
        victims += _step(scheduler)[1]
        scheduler.check_integrity()
    assert victims and victims[0] == first_victim, victims


@pytest.mark.parametrize("aging_s, gets_through", [(1.0, True), (1e9, False)])
def test_aging_lets_a_low_priority_request_through_a_steady_stream(aging_s, gets_through):
    """One seat; a new priority-0 request arrives every step (0.25 s), faster than they finish. With aging one level a
    second, the priority-3 request goes once it is 3 levels ahead of the oldest waiting one (about 7 s); without
    aging it never does."""
    clock = _Clock()
    scheduler = _scheduler(clock, "priority", max_num_seqs=1, aging_s=aging_s)
    _add(scheduler, clock, "low", 3, max_tokens=2)
    finished = []
    for step in range(120):
        _add(scheduler, clock, f"high{step}", 0, max_tokens=2)
        finished += _step(scheduler)[0]
        clock.now += 0.25
    assert ("low" in finished) is gets_through
    assert len(finished) > 50  # the stream itself kept being served
