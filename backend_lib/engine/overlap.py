"""Zero-overhead scheduling (``async_scheduling``): the device thread and the step in flight.

The engine loop (LLMEngine.step) keeps at most one step in flight on a device thread and, while it runs,
schedules the next step (core/async_scheduler.py: the requests of the step in flight projected one step on, the
token being sampled held by a placeholder) and prepares its inputs on the host. Then it waits for the step in
flight's sampled ids, commits them (the scheduler's update: stops, grammars, blocks), and only then builds the next
step's sampling metadata (penalties and grammar bitmasks read the committed tokens) and hands it over: the next
step's forward does not wait for it, its sampling does. Finally it detokenizes and streams the committed step.

On a device the overlap is the device step against the host's scheduling, preparation, commit and streaming: the
device thread only launches the step and waits for its sampled ids; the placeholders are filled on the device
from the previous step's sampled ids (ModelRunner.execute) before the inputs go to the other ranks.
"""
from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from backend_lib.core.async_scheduler import PLACEHOLDER_TOKEN
from backend_lib.core.outputs import RunnerOutput, SchedulerOutput
from backend_lib.worker.model_inputs import ModelInputs, StepOverlap


@dataclass
class InFlight:
    """A step submitted to the device thread and not yet committed."""

    scheduler_output: SchedulerOutput
    inputs: ModelInputs
    result: Future  # -> RunnerOutput
    sampling: Future  # -> its SamplingMetadata, set once the step before it is committed


def continued_rows(scheduler_output: SchedulerOutput, inputs: ModelInputs, previous: InFlight | None,
                   device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:  # [P] int64, [P] int64
    """The rows of this step whose token is a placeholder, and the rows of ``previous``'s sampled ids that hold
    them (a request continued from the step in flight: its chunk starts at the token being sampled)."""
    dst: list[int] = []
    src: list[int] = []
    if previous is not None:
        sampled_row = {id(previous.scheduler_output.chunks[i].request): row
                       for row, i in enumerate(previous.inputs.sampling_chunks)}
        for i, chunk in enumerate(scheduler_output.chunks):
            request = chunk.request
            if (request.output_token_ids and request.output_token_ids[-1] == PLACEHOLDER_TOKEN
                    and chunk.start == request.num_tokens - 1):
                dst.append(inputs.row_starts[i])
                src.append(sampled_row[id(request)])
    return (torch.tensor(dst, dtype=torch.int64, device=device),
            torch.tensor(src, dtype=torch.int64, device=device))


class DeviceThread:
    """The one thread that runs steps, in submission order (the device's queue)."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="deepinfer-device")
        self.in_flight: InFlight | None = None

    def submit(self, execute: Callable[..., RunnerOutput], scheduler_output: SchedulerOutput, inputs: ModelInputs,
               rows: tuple[torch.Tensor, torch.Tensor]) -> InFlight:
        sampling: Future = Future()
        overlap = StepOverlap(rows[0], rows[1], sampling.result)
        result = self._pool.submit(execute, scheduler_output, inputs, overlap)
        return InFlight(scheduler_output, inputs, result, sampling)

    def drop(self) -> BaseException | None:
        """Waits for the step in flight, whose result nobody will commit (after a failed step, at close); returns
        its exception, if it raised one."""
        step, self.in_flight = self.in_flight, None
        if step is None:
            return None
        if not step.sampling.done():
            step.sampling.set_exception(RuntimeError("the step was dropped before its sampling metadata was built"))
        return step.result.exception()

    def close(self) -> None:
        """Drops the step in flight and stops the thread; idempotent."""
        self.drop()
        self._pool.shutdown(wait=True)
