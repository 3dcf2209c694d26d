"""Our DeepSeek-V4.1 (backend_lib/models/deepseek_v41/) against the oracle (tests/helpers/deepseek_v41_reference.py,
fp32, QAT activations off), teacher-forced at every position: prefill chunks of odd sizes, then one decode step per
token, over shuffled paged blocks and a state slot (the model runner's inputs, built by hand)."""
from __future__ import annotations

import pytest
import torch

from backend_lib.models.loading.loader import load_model
from backend_lib.tools.tiny import make_tiny
from tests.helpers.deepseek_v41_cases import CONFIGS, tokens
from tests.helpers.deepseek_v41_reference import ReferenceV41
from tests.helpers.paged_runner import HybridPagedRunner

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/models/conftest.py

# (context length, tokens prefilled before the teacher-forced decode steps); default runs past 1,000 positions
LENGTHS = {"default": (1040, 900), "two_groups": (300, 180), "reindex_r2": (300, 180), "wide": (300, 180)}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def case(request, tmp_path_factory):
    name = request.param
    path = make_tiny("deepseek_v41", tmp_path_factory.mktemp(name), seed=7, overrides=CONFIGS[name])
    return name, path


def _ours_teacher_forced(path, ids: list[int], prefill_len: int, qat: bool = False,
                         chunks=(13, 7, 61, 1, 29)) -> torch.Tensor:
    model = load_model(str(path), torch.float32, progress=False)
    model.qat = qat
    run = HybridPagedRunner(model, num_blocks=len(ids) // 4 + 8)
    rows, start, i = [], 0, 0
    while start < prefill_len:
        n = min(chunks[i % len(chunks)], prefill_len - start)
        rows.append(run.step([], [("r", ids[start:start + n])]))
        start, i = start + n, i + 1
    rows += [run.step([("r", [t])], []) for t in ids[prefill_len:]]
    return torch.cat(rows)


def test_teacher_forced_logits_equal_the_oracle_at_every_position(case):
    name, path = case
    length, prefill_len = LENGTHS[name]
    ids = tokens(length, 2)
    expected = ReferenceV41(path, qat=False).forward(torch.tensor(ids))
    diff = (_ours_teacher_forced(path, ids, prefill_len) - expected).abs().amax(dim=-1)
    assert diff.max() <= 1e-4, f"first position off: {int((diff > 1e-4).nonzero()[0])}, max {diff.max():.2e}"


def test_fp8_fp4_checkpoint_equals_the_oracle_over_dequantized_weights(tmp_path):
    """fp8 e4m3 projections (32x32 ue8m0 blocks; weight_format auto runs them as packed tiles) and fp4 routed
    experts (kept packed) against the oracle over the same weights dequantized."""
    path = make_tiny("deepseek_v41", tmp_path, seed=7, fp8=True, fp4_experts=True)
    ids = tokens(120, 3)
    expected = ReferenceV41(path, qat=False).forward(torch.tensor(ids))
    assert (_ours_teacher_forced(path, ids, 80) - expected).abs().max() <= 1e-4


def _engine(path, **settings):
    from backend_lib.core.config import EngineConfig
    from backend_lib.engine.llm_engine import LLMEngine
    return LLMEngine(EngineConfig.from_flat({"model": str(path), "max_model_len": 512, "block_size": 16,
                                             "max_num_seqs": 4, **settings}))


def _run(engine, requests: dict) -> dict[str, list]:
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    outputs: dict[str, list] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    return outputs


@pytest.fixture(scope="module")
def default_tiny(tmp_path_factory):
    return make_tiny("deepseek_v41", tmp_path_factory.mktemp("engine"), seed=7)


def test_engine_greedy_with_qat_equals_the_oracle_batched_and_chunked(default_tiny):
    """QAT activations on (the model's math), through the engine: prompts inside and past the window, prefilled in
    61-token chunks next to each other's decodes, give the oracle's greedy ids (the oracle re-run uncached for every
    token)."""
    from backend_lib.core.sampling_params import SamplingParams
    ref = ReferenceV41(default_tiny, qat=True)
    prompts = {f"r{n}": tokens(n, 30 + n) for n in (5, 70)}
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    outputs = _run(_engine(default_tiny, max_num_batched_tokens=61), {r: (p, params) for r, p in prompts.items()})
    for rid, prompt in prompts.items():
        ids, expected = list(prompt), []
        for _ in range(16):
            expected.append(int(ref.forward(torch.tensor(ids))[-1].argmax()))
            ids.append(expected[-1])
        assert [t for o in outputs[rid] for t in o.new_token_ids] == expected, rid


def test_decode_logprobs_equal_a_prefill_of_the_same_tokens(default_tiny, monkeypatch):
    """No outside oracle (QAT off): the logprobs of tokens generated step by step equal the prompt logprobs of one
    prefill of prompt + output."""
    from backend_lib.core.sampling_params import SamplingParams
    from backend_lib.models.deepseek_v41.model import DeepseekV41ForCausalLM
    monkeypatch.setattr(DeepseekV41ForCausalLM, "qat_activations", False)
    engine = _engine(default_tiny, max_num_batched_tokens=256)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, logprobs=0)
    for n in (5, 90):
        prompt = tokens(n, 50 + n)
        out = _run(engine, {"gen": (prompt, params)})["gen"]
        generated = [t for o in out for t in o.new_token_ids]
        decoded = [lp.logprob for o in out for lp in o.new_logprobs]
        again = _run(engine, {"pre": (prompt + generated, SamplingParams(max_tokens=1, prompt_logprobs=0))})["pre"]
        entries = next(o.prompt_logprobs for o in again if o.prompt_logprobs is not None).entries
        prefilled = [e.logprob for e in entries[n - 1:]]
        assert len(prefilled) == len(decoded) == 40
        assert max(abs(a - b) for a, b in zip(prefilled, decoded)) <= 1e-4


@pytest.mark.parametrize("settings", [{}, {"method": "ngram", "num_speculative_tokens": 3}])
def test_preemption_sessions_and_drafts_keep_the_oracle_greedy_ids(default_tiny, monkeypatch, settings):
    """QAT off. A pool small enough that requests are preempted and recomputed mid-decode (with n-gram drafts
    verified in one batched pass: window and open-pair rings roll back), then a two-turn session whose second turn
    prefills only its new tokens on the kept state: the oracle's tokens throughout."""
    from backend_lib.core.outputs import SessionControl
    from backend_lib.core.sampling_params import SamplingParams
    from backend_lib.models.deepseek_v41.model import DeepseekV41ForCausalLM
    monkeypatch.setattr(DeepseekV41ForCausalLM, "qat_activations", False)
    ref = ReferenceV41(default_tiny, qat=False)
    engine = _engine(default_tiny, max_num_batched_tokens=32, num_blocks=14, **settings)
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    prompts = {f"r{n}": tokens(n, 60 + n) for n in (3, 90, 50, 130)}
    outputs = _run(engine, {r: (p, params) for r, p in prompts.items()})
    for rid, prompt in prompts.items():
        assert [t for o in outputs[rid] for t in o.new_token_ids] == ref.greedy(prompt, 30), rid
    assert engine.stats().num_preemptions > 0
    if settings:
        assert engine.stats().spec_num_drafts > 0

    def turn(rid: str, prompt: list[int], session: SessionControl) -> list[int]:
        engine.add_request(rid, prompt, params, session=session)
        return [t for o in _run(engine, {})[rid] for t in o.new_token_ids]

    first, second = tokens(70, 71), tokens(9, 72)
    turn1 = turn("t1", first, SessionControl("s", start=True))
    turn2 = turn("t2", second, SessionControl("s", end=True))
    assert turn1 == ref.greedy(first, 30)
    assert turn2 == ref.greedy(first + turn1 + second, 30)


@pytest.mark.parametrize("settings", [{"tensor_parallel_size": 2},
                                      {"tensor_parallel_size": 2, "enable_expert_parallel": True},
                                      {"context_parallel_size": 2, "context_parallel_min_tokens": 32}])
def test_two_ranks_keep_the_oracle_greedy_ids(default_tiny, settings):
    """Two ranks, QAT on: the oracle's ids. Tensor parallel: query heads and output groups split, experts'
    intermediate units or whole experts split; the compressor and the indexer whole on each, so every rank picks the
    same entries. Context parallel: every other block's entries and index keys on each rank, the picks and the
    candidate pool made over both ranks' scores, the window and sinks on rank 0, merged by log-sum-exp."""
    from backend_lib.core.sampling_params import SamplingParams
    from backend_lib.engine.offline import LLM
    ref = ReferenceV41(default_tiny, qat=True)
    prompts = [tokens(n, 80 + n) for n in (9, 60)]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    with LLM(str(default_tiny), num_blocks=96, max_num_batched_tokens=64, **settings) as llm:
        results = llm.generate(prompts, params)
    for prompt, result in zip(prompts, results):
        assert result.error is None and result.token_ids == ref.greedy(prompt, 16)
