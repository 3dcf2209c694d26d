"""The one way tests build a small engine from flat settings and run it until every request has finished."""
from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from backend_lib.core.config import EngineConfig
from backend_lib.core.outputs import RequestOutput
from backend_lib.core.sampling_params import SamplingParams
from backend_lib.engine.llm_engine import LLMEngine


def make_engine(model: Any, *defaults: Mapping[str, Any], engine_type: Callable[[EngineConfig], Any] = LLMEngine,
                **settings: Any):
    """An engine over ``model`` (a path) from flat settings: each mapping of ``defaults`` in turn, then ``settings``,
    so that a test's own values override its module's defaults. ``engine_type`` builds it from the EngineConfig
    (an AsyncEngine, or a partial with its faults)."""
    flat: dict[str, Any] = {"model": str(model)}
    for mapping in defaults:
        flat.update(mapping)
    flat.update(settings)
    return engine_type(EngineConfig.from_flat(flat))


def drive(engine: LLMEngine, requests: Mapping[str, tuple[Any, SamplingParams]] | None = None, *,
          on_step: Callable[[LLMEngine], None] | None = None,
          on_output: Callable[[RequestOutput], None] | None = None,
          max_steps: int = 100_000) -> dict[str, list[RequestOutput]]:
    """Adds ``requests`` (id -> (prompt, params)), then steps until the engine has nothing left: every request's
    outputs in order. ``on_step`` runs before each step (to force a state the scheduler rarely reaches),
    ``on_output`` after each output (to abort mid-stream); ``max_steps`` turns a hang into a failure."""
    for request_id, (prompt, params) in (requests or {}).items():
        engine.add_request(request_id, prompt, params)
    outputs: dict[str, list[RequestOutput]] = {}
    steps = 0
    while engine.has_unfinished_requests():
        steps += 1
        assert steps <= max_steps, f"the engine did not finish in {max_steps} steps"
        if on_step is not None:
            on_step(engine)
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
            if on_output is not None:
                on_output(out)
    return outputs


def new_tokens(outputs: Mapping[str, list[RequestOutput]]) -> dict[str, list[int]]:
    """Each request's generated ids, its outputs' new tokens joined."""
    return {request_id: [t for out in outs for t in out.new_token_ids] for request_id, outs in outputs.items()}


def final_outputs(outputs: Mapping[str, list[RequestOutput]]) -> dict[str, RequestOutput]:
    """Each request's finished output."""
    return {request_id: outs[-1] for request_id, outs in outputs.items() if outs[-1].finished}


def full_texts(outputs: Mapping[str, list[RequestOutput]]) -> dict[str, str]:
    """Each request's whole text, its outputs' new text joined."""
    return {request_id: "".join(out.new_text for out in outs) for request_id, outs in outputs.items()}
