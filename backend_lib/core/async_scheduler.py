"""The scheduler of zero-overhead scheduling (``async_scheduling``): step t+1 is scheduled while step t runs. No torch.

``schedule_ahead(in_flight)`` schedules the next step as if the step in flight had completed the way it was
scheduled: each of its requests is *projected* first (``num_computed_tokens`` moved past its chunk and, when the
chunk samples, one placeholder id appended to its output: the token being sampled, which the runner fills in on the
device from step t's sampled ids, worker/model_runner.py). The base ``schedule`` then runs unchanged over the
projected requests. A request projected to its length limit (``max_tokens``, ``max_model_len``) ends with step t
for sure and is left out of step t+1 (its blocks stay reserved until it is released).

``update_from_output(step t)`` undoes each projection before the base update applies the real tokens, so the
placeholder never reaches the prefix-cache hashes, a session's history, a grammar or a stop check. What cannot be
known when step t+1 is scheduled (a stop token, a grammar's end, a stop string, an abort) finishes the request at
step t's update; its step t+1 result is then dropped by the base update (it skips requests no longer RUNNING), so no
wrong token is ever streamed. A projected request preempted or failed while scheduling step t+1 is unprojected
before its state is reset; step t's token for it is dropped and recomputed at the same output position, with the
same seeded draw, after it is readmitted.

Only steps without drafts are projected: how many drafts a verification accepts decides where the next step starts,
so the engine completes a step that verifies drafts before it schedules the next one (engine/overlap.py).
"""
from __future__ import annotations

from dataclasses import dataclass

from backend_lib.core.outputs import RunnerOutput, SchedulerOutput
from backend_lib.core.request import Request, RequestStatus
from backend_lib.core.scheduler import Scheduler

# The id a projected request holds for the token its step in flight is sampling (never a vocabulary id).
PLACEHOLDER_TOKEN = -1


@dataclass
class _Projection:
    request: Request
    start: int  # num_computed_tokens when the step in flight was scheduled
    placeholder: bool  # one PLACEHOLDER_TOKEN appended to the output


class AsyncScheduler(Scheduler):
    """A Scheduler that can schedule one step ahead of the step in flight (at most one step in flight)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._projected: dict[str, _Projection] = {}

    def schedule_ahead(self, in_flight: SchedulerOutput | None) -> SchedulerOutput:
        """The next step while ``in_flight`` runs (None: a plain ``schedule``). Raises ValueError for a step in
        flight with drafts (its acceptance decides where the next step starts)."""
        if in_flight is None:
            return self.schedule()
        ending: set[str] = set()
        for chunk in in_flight.chunks:
            request = chunk.request
            if request.status is not RequestStatus.RUNNING:
                continue  # finished or preempted since that step was scheduled
            if chunk.num_draft_tokens:
                raise ValueError(f"request {request.request_id!r} verifies drafts in the step in flight: complete "
                                 f"that step before scheduling the next")
            samples = chunk.samples
            self._projected[request.request_id] = _Projection(request, chunk.start, samples)
            request.num_computed_tokens = chunk.start + chunk.num_tokens
            if samples:
                request.output_token_ids.append(PLACEHOLDER_TOKEN)
                if self._reaches_length(request):
                    ending.add(request.request_id)
        output = self.schedule()
        if ending:
            output.chunks = [c for c in output.chunks if c.request.request_id not in ending]
        return output

    def _reaches_length(self, request: Request) -> bool:
        return (request.num_output_tokens >= request.sampling_params.max_tokens
                or request.num_tokens >= self.max_model_len)

    def update_from_output(self, scheduler_output: SchedulerOutput, runner_output: RunnerOutput) -> list[Request]:
        for chunk in scheduler_output.chunks:
            self._unproject(chunk.request)
        return super().update_from_output(scheduler_output, runner_output)

    def _unproject(self, request: Request) -> None:
        projection = self._projected.get(request.request_id)
        if projection is None or projection.request is not request:
            return
        del self._projected[request.request_id]
        request.num_computed_tokens = projection.start
        if projection.placeholder:
            last = request.output_token_ids.pop()
            assert last == PLACEHOLDER_TOKEN, f"request {request.request_id!r}: its placeholder was replaced"

    # A projected request that the next step's scheduling preempts or fails goes back to its real state first.
    def _preempt(self, request: Request, preempted: list[str]) -> None:
        self._unproject(request)
        super()._preempt(request, preempted)

    def _release(self, request: Request) -> None:
        self._unproject(request)
        super()._release(request)
