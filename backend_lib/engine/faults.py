"""Fault injection for tests: a fatal (``FatalEngineError``, from ``worker/failures.py``) or transient fault inside
one engine step's model run.

Fault injection is read once when the engine starts (``FaultConfig.from_env``), never from a module global, so a
test sets ``DEEPINFER_FAULT_STEP=N`` for the one server it starts and every other engine runs unfaulted. The fault
is raised inside the model run of engine step N, after the scheduler has allocated that step's blocks: the same
place a real device error (out of memory, a lost Neuron core) would surface.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from backend_lib.core import envs
from backend_lib.worker.failures import FatalEngineError

if TYPE_CHECKING:
    from backend_lib.engine.llm_engine import LLMEngine

FAULT_STEP_ENV = "DEEPINFER_FAULT_STEP"
FAULT_KIND_ENV = "DEEPINFER_FAULT_KIND"
_KINDS = ("fatal", "transient")


class InjectedFault(RuntimeError):
    """A transient fault injected by FaultConfig: only the requests of that step fail."""


@dataclass(frozen=True)
class FaultConfig:
    step: int = 0  # the 1-based engine step whose model run raises; 0 = no fault
    kind: str = "fatal"  # "fatal" (FatalEngineError) or "transient" (InjectedFault)

    def __post_init__(self) -> None:
        if self.step < 0:
            raise ValueError(f"{FAULT_STEP_ENV} must be >= 0 (0 = off), got {self.step}")
        if self.kind not in _KINDS:
            raise ValueError(f"{FAULT_KIND_ENV} must be one of {_KINDS}, got {self.kind!r}")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "FaultConfig":
        """From ``environ`` (default: this process's environment)."""
        return cls(step=envs.read(FAULT_STEP_ENV, environ), kind=envs.read(FAULT_KIND_ENV, environ))

    def install(self, engine: "LLMEngine") -> None:
        """Wrap the engine's model run so that step ``self.step`` raises (nothing to do when off)."""
        if not self.step:
            return
        run = engine.runner.execute
        runs = 0  # model runs so far; a failed step is not counted by engine.num_steps, so count here: fire once

        def run_with_fault(scheduler_output, *overlapped):  # async_scheduling: the prepared inputs and overlap
            nonlocal runs
            runs += 1
            if runs == self.step:
                message = f"fault injected at engine step {runs} ({FAULT_STEP_ENV})"
                raise FatalEngineError(message) if self.kind == "fatal" else InjectedFault(message)
            return run(scheduler_output, *overlapped)

        engine.runner.execute = run_with_fault
