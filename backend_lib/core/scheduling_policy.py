"""The scheduler's orders, by ``SchedulerConfig.scheduling_policy``: which waiting request is admitted next, in
which order running requests take their blocks, which one is preempted when the pool is full. No torch.

``fcfs`` (``FcfsOrder``): the head of the queue; admission order; the newest.

``priority`` (``PriorityOrder``, vLLM's ``--scheduling-policy priority``), vLLM's convention: a lower priority value
runs earlier (default 0; negative values are allowed). Aging keeps a low priority from starving under a steady
stream of higher ones: a request's effective priority is its value minus one for every ``priority_aging_s`` seconds
since it arrived, so after ``(p_low - p_high) * priority_aging_s`` seconds it goes before any newly arrived request
of the higher priority. The same effective priority orders both decisions:

- admission: the waiting request with the lowest effective priority is next (a tie: the one first in the queue,
  i.e. first come, first served, a preempted request ahead of the requests it was admitted before);
- preemption, when the KV pool is full: the running request with the highest effective priority gives its blocks
  back first (a tie: the newest, as under fcfs); running requests reserve their blocks in the opposite order, so a
  higher-priority request is never the one left without blocks while a lower one holds its own.
"""
from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from backend_lib.core.config import SchedulerConfig
from backend_lib.core.request import Request


class FcfsOrder:
    def next_to_admit(self, waiting: Iterable[Request], now: float) -> Request | None:
        return next(iter(waiting), None)

    def reserve_order(self, running: list[Request], now: float) -> list[Request]:
        return list(running)

    def victim(self, running: list[Request], now: float) -> Request:
        return running[-1]


def scheduling_order(config: SchedulerConfig) -> FcfsOrder | PriorityOrder:
    if config.scheduling_policy == "priority":
        return PriorityOrder(config.priority_aging_s)
    return FcfsOrder()


@dataclass(frozen=True)
class PriorityOrder:
    aging_s: float  # SchedulerConfig.priority_aging_s

    def effective(self, request: Request, now: float) -> int:
        waited = max(0.0, now - request.arrival_time)
        return request.priority - math.floor(waited / self.aging_s)

    def next_to_admit(self, waiting: Iterable[Request], now: float) -> Request | None:
        """min() keeps the first of equal keys: the queue's own order breaks ties."""
        return min(waiting, key=lambda r: self.effective(r, now), default=None)

    def reserve_order(self, running: list[Request], now: float) -> list[Request]:
        """Running requests (admission order) as they take their blocks: best effective priority first, the
        older first on a tie."""
        return sorted(running, key=lambda r: self.effective(r, now))  # sorted() is stable: admission order

    def victim(self, running: list[Request], now: float) -> Request:
        """The request to preempt among ``running`` (admission order, non-empty): the worst effective priority, the
        newest of those."""
        return max(reversed(running), key=lambda r: self.effective(r, now))  # max keeps the first: the newest
