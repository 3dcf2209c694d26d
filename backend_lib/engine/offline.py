"""Offline batch generation: LLM(...).generate(prompts) drives LLMEngine synchronously."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from backend_lib.core.config import EngineConfig
from backend_lib.core.outputs import PromptLogprobs, TokenLogprob
from backend_lib.core.sampling_params import SamplingParams
from backend_lib.engine.intake import Prompt
from backend_lib.engine.llm_engine import LLMEngine


@dataclass
class GenerationResult:
    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    cumulative_logprob: float
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: PromptLogprobs | None = None  # SamplingParams.prompt_logprobs
    error: str | None = None


class LLM:
    def __init__(self, model: str = "", config: EngineConfig | None = None, **settings: Any) -> None:
        self.engine = LLMEngine(config or EngineConfig.from_flat({"model": model, **settings}))

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def close(self) -> None:
        """Stop the worker ranks of a tensor-parallel engine (they also die with this process)."""
        self.engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def generate(self, prompts: list[Prompt], params: SamplingParams | list[SamplingParams] | None = None,
                 priority: list[int] | None = None) -> list[GenerationResult]:
        """Runs all prompts as one continuous batch; results in prompt order. ``priority`` (one per prompt, as vLLM's
        generate) matters under scheduling_policy "priority": lower runs earlier."""
        params_list = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        priorities = priority if priority is not None else [None] * len(prompts)
        if len(priorities) != len(prompts):
            raise ValueError(f"priority has {len(priorities)} values for {len(prompts)} prompts")
        ids = [f"offline-{self.engine.num_steps}-{i}" for i in range(len(prompts))]
        results = {rid: GenerationResult(rid, "", [], None, 0, 0, 0.0) for rid in ids}
        for rid, prompt, p, level in zip(ids, prompts, params_list, priorities):
            self.engine.add_request(rid, prompt, p, priority=level)
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                result = results[out.request_id]
                result.text += out.new_text
                result.token_ids += out.new_token_ids
                result.logprobs += out.new_logprobs or []
                result.prompt_logprobs = result.prompt_logprobs or out.prompt_logprobs
                result.num_prompt_tokens, result.num_cached_tokens = out.num_prompt_tokens, out.num_cached_tokens
                result.cumulative_logprob = out.cumulative_logprob
                if out.finished:
                    result.finish_reason, result.error = out.finish_reason, out.error
        return [results[rid] for rid in ids]
