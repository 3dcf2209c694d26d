"""The engine against transformers on the real SmolLM2 GGUF and on a tiny random Llama (HF directory)."""
from __future__ import annotations

import subprocess
import sys

import pytest

from backend_lib.core.config import EngineConfig
from backend_lib.core.sampling_params import SamplingParams
from backend_lib.engine.offline import LLM
from tests.helpers.greedy_agreement import hf_greedy, hf_greedy_choices

# `make test` only (not test-fast): SmolLM2 against transformers, token for token (the model loaded by both).
pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a land far away,",
    "1, 2, 3, 4, 5,",
    "Les chats et les chiens",
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three colours."}],
]
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def oracle(hf_smollm2) -> list[list[int]]:
    """transformers' prompt ids; its greedy choices are checked against each run's tokens (hf_greedy_choices: one
    forward a prompt instead of 7 x 32 single-token steps, the suite's costliest oracle when stepped)."""
    _, tokenizer = hf_smollm2
    prompt_ids = []
    for prompt in PROMPTS:
        if isinstance(prompt, str):
            ids = tokenizer(prompt)["input_ids"]
        else:
            ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True,
                                                return_dict=False)
        prompt_ids.append(list(ids))
    return prompt_ids


@pytest.fixture(scope="module")
def smollm2_llm(smollm2_path):
    # A small token budget forces chunked prefill in the concurrent run; weight_format=dequantize: transformers'
    # weights (auto would run the Q4_1 file packed).
    return LLM(config=EngineConfig.from_flat({"model": smollm2_path, "weight_format": "dequantize",
                                              "max_num_batched_tokens": 32, "max_num_seqs": 8, "num_blocks": 256,
                                              "enable_prefix_caching": False}))


def test_prompt_ids_match_transformers(smollm2_llm, oracle):
    for prompt, ids in zip(PROMPTS, oracle):
        assert smollm2_llm.engine.tokenize(prompt) == ids


def _check(results, oracle, hf_model):
    for result, ids in zip(results, oracle):
        assert len(result.token_ids) == NEW_TOKENS and len(result.logprobs) == NEW_TOKENS
        tokens, logprobs = hf_greedy_choices(hf_model, ids, result.token_ids)
        assert result.token_ids == tokens
        for ours, theirs in zip(result.logprobs, logprobs):
            assert abs(ours.logprob - theirs) < 1e-3


def test_greedy_one_at_a_time_matches_transformers(smollm2_llm, oracle, hf_smollm2):
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=0)
    _check([smollm2_llm.generate([ids], params)[0] for ids in oracle], oracle, hf_smollm2[0])


def test_greedy_concurrent_chunked_batch_matches_transformers(smollm2_llm, oracle, hf_smollm2):
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=0)
    results = smollm2_llm.generate(oracle, params)
    _check(results, oracle, hf_smollm2[0])


def test_chat_answer_mentions_paris(smollm2_llm):
    result = smollm2_llm.generate([[{"role": "user", "content": "What is the capital of France?"}]],
                                  SamplingParams(max_tokens=32, temperature=0.0))[0]
    assert "Paris" in result.text
    assert result.finish_reason == "stop"


def test_tiny_hf_llama_matches_transformers(tiny_llama_dir):
    from transformers import AutoModelForCausalLM
    import torch
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    llm = LLM(config=EngineConfig.from_flat({"model": str(tiny_llama_dir), "num_blocks": 64,
                                             "max_num_batched_tokens": 16}))
    prompts = [[5, 17, 300, 42, 9, 1000, 77], list(range(100, 140)), [7]]
    expected = [hf_greedy(hf, p, 24)[0] for p in prompts]
    results = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    assert [r.token_ids for r in results] == expected


def test_cli_generate_chat_prints_paris():
    """The exact model (dequantize) answers the README's question; the default (auto: the Q4_1 file packed, int8
    activations) says in the load log what it chose (its greedy text parts from the exact one's on this question)."""
    command = [sys.executable, "-m", "backend_lib.frontend.cli.main", "generate", "--chat", "--max-tokens", "10"]
    exact = subprocess.run([*command, "--weight-format", "dequantize", "What is the capital of France?"],
                           capture_output=True, text=True, timeout=600)
    assert exact.returncode == 0, exact.stderr
    assert "Paris" in exact.stdout
    default = subprocess.run([*command, "--max-tokens", "2", "Hi"], capture_output=True, text=True, timeout=600)
    assert default.returncode == 0, default.stderr
    assert "packed weights (weight_format auto" in default.stderr and default.stdout.strip()
