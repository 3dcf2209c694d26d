"""prompt_logprobs (vLLM's field; OpenAI's echo): every prompt token after the first gets its logprob under the
model, equal to transformers' log-softmax of the same prompt, across chunked prefill, prefix-cache hits and
preemption's recompute; a session turn is refused."""
from __future__ import annotations

import pytest
import torch

from backend_lib.core.config import EngineConfig
from backend_lib.core.outputs import SessionControl
from backend_lib.core.sampling_params import SamplingParams
from backend_lib.engine.llm_engine import LLMEngine
from tests.helpers.engines import drive

PROMPT = list(range(100, 140))  # 40 tokens: three chunks at max_num_batched_tokens 16


@pytest.fixture(scope="module")
def reference(tiny_llama_dir) -> torch.Tensor:  # [39, vocab]: log-softmax of the logits predicting tokens 1..39
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, torch_dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT])).logits[0, :-1].float()
    return torch.log_softmax(logits, dim=-1)



def _check(prompt_logprobs, reference: torch.Tensor, top_n: int) -> None:
    assert prompt_logprobs.first_token_id == PROMPT[0]
    entries = prompt_logprobs.entries
    assert [e.token_id for e in entries] == PROMPT[1:]
    expected = reference.gather(1, torch.tensor(PROMPT[1:])[:, None]).squeeze(1)
    assert torch.allclose(torch.tensor([e.logprob for e in entries]), expected, atol=1e-4)
    for entry, row in zip(entries, reference):
        assert [t for t, _ in entry.top] == row.topk(top_n).indices.tolist()


def test_prompt_logprobs_equal_transformers_through_chunks_and_the_prefix_cache(tiny_llama_dir, reference):
    engine = LLMEngine(EngineConfig.from_flat({"model": str(tiny_llama_dir), "max_model_len": 128,
                                               "max_num_batched_tokens": 16, "block_size": 4,
                                               "enable_prefix_caching": True}))
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, prompt_logprobs=2)
    engine.add_request("plain", PROMPT, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    engine.add_request("first", PROMPT, params)
    outputs = drive(engine)
    assert all(o.prompt_logprobs is None for o in outputs["plain"])
    carrying = [o for o in outputs["first"] if o.prompt_logprobs is not None]
    assert len(carrying) == 1 and carrying[0].new_token_ids  # once, with the first token
    _check(carrying[0].prompt_logprobs, reference, 2)
    # The same prompt again: its blocks are cached, but a prompt_logprobs request computes every position.
    engine.add_request("again", PROMPT, params)
    again = [o for o in drive(engine)["again"] if o.prompt_logprobs is not None]
    _check(again[0].prompt_logprobs, reference, 2)
    assert again[0].num_cached_tokens == 0
    engine.add_request("cached", PROMPT, SamplingParams(max_tokens=1))  # without it, the cache serves as before
    assert drive(engine)["cached"][-1].num_cached_tokens > 0


def test_preemption_recompute_does_not_repeat_entries(tiny_llama_dir, reference):
    """A pool so small that requests preempt each other mid-generation; each prompt's entries stay whole."""
    engine = LLMEngine(EngineConfig.from_flat({"model": str(tiny_llama_dir), "max_model_len": 128,
                                               "num_blocks": 24, "block_size": 4,
                                               "enable_prefix_caching": False}))
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, prompt_logprobs=1)
    for i in range(3):
        engine.add_request(f"r{i}", PROMPT, params)
    outputs = drive(engine)
    assert engine.scheduler.num_preemptions > 0
    for i in range(3):
        carrying = [o for o in outputs[f"r{i}"] if o.prompt_logprobs is not None]
        assert len(carrying) == 1
        _check(carrying[0].prompt_logprobs, reference, 1)


def test_a_session_turn_refuses_prompt_logprobs(tiny_llama_dir):
    engine = LLMEngine(EngineConfig.from_flat({"model": str(tiny_llama_dir), "max_model_len": 128}))
    with pytest.raises(ValueError, match="^prompt_logprobs is not available for a session turn"):
        engine.add_request("t", PROMPT, SamplingParams(prompt_logprobs=0), SessionControl("s", start=True))
    with pytest.raises(ValueError, match=r"^prompt_logprobs must be in \[0, 20\]"):
        engine.add_request("u", PROMPT, SamplingParams(prompt_logprobs=21))
