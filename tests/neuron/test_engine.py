"""The engine with compiled regions: greedy output equals the eager engine and transformers (SmolLM2 GGUF, a tiny
DeepSeek-V3 with fp8 weights and static MoE), with and without speculative decoding."""
from __future__ import annotations

import pytest
import torch

from backend_lib.core.config import EngineConfig
from backend_lib.core.sampling_params import SamplingParams
from backend_lib.engine.offline import LLM
from backend_lib.tools.tiny import make_tiny
from tests.helpers.greedy_agreement import hf_greedy, hf_greedy_choices

# `make test` only (not test-fast): compiles SmolLM2's regions (aot_eager) and runs them against the eager engine.
pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ", "1, 2, 3, 4, 5,",
           [{"role": "user", "content": "What is the capital of France?"}]]
NEW_TOKENS = 24
# Only the graphs the runs below use (warm-up compiles every bucket; each SmolLM2 graph is ~10 s of tracing): the
# batched runs decode 4 (or 3, padded to 4) rows, the one-prompt run decodes 1 row after a single prefill chunk of
# <= 32 tokens; the batched first steps (several prefills) run eagerly.
REGIONS = {"compile_backend": "aot_eager", "batch_buckets": "1,4", "width_buckets": "8",
           "prefill_buckets": "32", "compile_progress": False}


def _compiled_llm(flat: dict) -> LLM:
    return LLM(config=EngineConfig.from_flat({**flat, **REGIONS}))


def _ids(results) -> list[list[int]]:
    return [r.token_ids for r in results]


@pytest.fixture(scope="module")
def smol_flat(smollm2_path) -> dict:
    # max_model_len 128 = 8 blocks of 16: every decode fits the one width bucket.
    return {"model": smollm2_path, "weight_format": "dequantize", "num_blocks": 64, "max_num_seqs": 4,
            "max_model_len": 128, "max_num_batched_tokens": 64}


@pytest.fixture(scope="module")
def smol_eager_ids(smol_flat) -> list[list[int]]:
    """The eager engine's greedy ids: what every compiled SmolLM2 engine below must give."""
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    return _ids(LLM(config=EngineConfig.from_flat(smol_flat)).generate(PROMPTS, params))


def test_smollm2_compiled_greedy_equals_eager_and_transformers_with_and_without_ngram(smol_flat, smol_eager_ids,
                                                                                      hf_smollm2):
    """One compiled engine (its graphs take most of this test's time) serves requests that opt out of speculation
    and requests that draft n-grams: both give the eager engine's greedy ids."""
    hf, tokenizer = hf_smollm2
    plain = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, speculative=False)
    compiled = _compiled_llm({**smol_flat, "method": "ngram", "num_speculative_tokens": 3})
    got = _ids(compiled.generate(PROMPTS, plain))
    assert got == smol_eager_ids
    for prompt, tokens in zip(PROMPTS, got):
        ids = compiled.engine.tokenize(prompt)
        assert tokens == hf_greedy_choices(hf, ids, tokens)[0]
    stats = compiled.engine.runner.model.stats
    assert stats.compiled_steps > NEW_TOKENS // 2  # decodes (and single prefills) really ran as graphs
    # one at a time: every prefill is a single chunk (a prefill graph), every decode a batch-1 graph
    before = stats.eager_steps
    assert _ids(compiled.generate(PROMPTS[:1], plain)) == got[:1]
    assert stats.eager_steps == before
    assert compiled.engine.stats().spec_draft_tokens == 0  # the opted-out requests drafted nothing
    assert _ids(compiled.generate(PROMPTS, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0,
                                                          ignore_eos=True))) == smol_eager_ids
    assert compiled.engine.stats().spec_draft_tokens > 0


@pytest.fixture(scope="module")
def tiny_ds(tmp_path_factory):
    return make_tiny("deepseek_v3", tmp_path_factory.mktemp("ds_engine"), fp8=True, mtp_layers=1, seed=5)


@pytest.mark.parametrize("spec", [{}, {"method": "mtp", "num_speculative_tokens": 2}])
def test_tiny_deepseek_compiled_greedy_equals_eager_and_transformers(tiny_ds, spec):
    from transformers import AutoModelForCausalLM
    flat = {"model": str(tiny_ds), "weight_format": "dequantize", "num_blocks": 64, "max_num_seqs": 4,
            "max_model_len": 128, "max_num_batched_tokens": 64, **spec}
    prompts = [[5, 9, 200, 31, 7], [44, 3, 3, 3, 17, 90, 12], [300, 2, 77]]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    compiled = _compiled_llm(flat)
    got = _ids(compiled.generate(prompts, params))
    assert got == _ids(LLM(config=EngineConfig.from_flat(flat)).generate(prompts, params))
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_ds), dtype=torch.float32).eval()
    for prompt, tokens in zip(prompts, got):
        assert tokens == hf_greedy(hf, prompt, 12)[0]
