"""Context parallelism on the host: `context_parallel_size=2` (two gloo ranks, each holding every other KV block)
gives the greedy ids of one rank, for Llama (SmolLM2 and a tiny random one) and DeepSeek-V3's MLA, through chunked
prefill with split rows, mixed long and short batches, fp8 KV, sessions, n-gram drafts, preemption, TP=2 x CP=2;
MTP drafts; a context longer than one rank's pool serves; a lost context rank fails the engine naming it."""
from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from backend_lib.core.config import EngineConfig
from backend_lib.core.outputs import SessionControl
from backend_lib.core.sampling_params import SamplingParams
from backend_lib.engine.offline import LLM
from backend_lib.tools.tiny import make_tiny
from backend_lib.worker.executor.workers import RankFailure
from tests.helpers.engines import drive, make_engine, new_tokens

# `make test` only (not test-fast): each test starts two-rank engines (processes, gloo groups, the model loaded per
# rank).
pytestmark = pytest.mark.slow

STORY = "Once upon a time there was a lighthouse keeper who counted the ships. "
PROMPTS = ["What is the capital of France?", STORY * 10, "0123456789 + - * / =", "Hi"]
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=2)
CP2 = {"context_parallel_size": 2, "context_parallel_min_tokens": 32}


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("cp")
    return {"llama": make_tiny("llama", root / "llama"),
            "deepseek": make_tiny("deepseek_v3", root / "deepseek", mtp_layers=1),
            "deepseek_v4": make_tiny("deepseek_v4", root / "deepseek_v4")}


def _generate(model: str, prompts=PROMPTS, params: SamplingParams = GREEDY, **settings):
    settings = {"num_blocks": 160, "max_num_batched_tokens": 128, **settings}
    with LLM(model, **settings) as llm:
        return llm.generate(prompts, params)


@pytest.fixture(scope="module")
def one_rank(tiny_dirs):
    """(model name, settings) -> one rank's results over PROMPTS: the reference the multi-rank runs are checked
    against, computed once for the module (several tests and params compare against the same one)."""
    done: dict[tuple[str, str], list] = {}

    def reference(name: str, **settings) -> list:
        key = (name, repr(sorted(settings.items())))
        if key not in done:
            done[key] = _generate(str(tiny_dirs[name]), **settings)
        return done[key]
    return reference


def _assert_same(reference, results, logprob_tol: float | None = 1e-4) -> None:
    assert len(reference) == len(results)
    for ref, got in zip(reference, results):
        assert got.error is None and got.token_ids == ref.token_ids
        if logprob_tol is not None:
            for ref_lp, lp in zip(ref.logprobs, got.logprobs):
                assert abs(ref_lp.logprob - lp.logprob) < logprob_tol


MTP = {"method": "mtp", "num_speculative_tokens": 2}


@pytest.mark.parametrize("model, settings, cp_only, tol", [
    ("llama", {}, {}, 1e-4),
    ("deepseek", {}, {}, 1e-4),
    ("deepseek", {}, MTP, 1e-4),  # drafts verified across the context ranks give the tokens without drafts
    ("llama", {"kv_cache_dtype": "fp8_e4m3"}, {}, None),
    ("deepseek", {"kv_cache_dtype": "fp8_e4m3"}, {}, None),
])
def test_two_context_ranks_match_one(tiny_dirs, one_rank, model, settings, cp_only, tol):
    _assert_same(one_rank(model, **settings), _generate(str(tiny_dirs[model]), **CP2, **settings, **cp_only), tol)


def test_smollm2_long_and_short_prompts_in_one_batch(smollm2_path):
    """One token to ~1,000 tokens, prefilled in 256-token chunks whose rows the two ranks split, beside decodes
    (benchmarks/context_parallel.py checks 16k-token prompts)."""
    prompts = [[7], "The capital of France is", STORY * 70]
    settings = {"max_num_batched_tokens": 256, "num_blocks": 160}
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=1)
    reference = _generate(smollm2_path, prompts, params, **settings)
    assert reference[2].num_prompt_tokens > 950
    _assert_same(reference, _generate(smollm2_path, prompts, params, **settings, **CP2), 2e-4)


def test_several_thousand_tokens_in_256_token_chunks(tiny_dirs):
    """A 3,000-token prompt (past the tiny model's 1,024 trained positions: RoPE extended) beside a short one."""
    prompts, model = [STORY * 57, "Hi"], str(tiny_dirs["llama"])
    settings = {"max_model_len": 3200, "max_num_batched_tokens": 256, "num_blocks": 220}
    reference = _generate(model, prompts, **settings)
    assert reference[0].num_prompt_tokens > 3000
    _assert_same(reference, _generate(model, prompts, **settings, **CP2))


@pytest.mark.parametrize("model", ["llama", "deepseek_v4"])
def test_tensor_and_context_parallel_on_four_ranks(tiny_dirs, one_rank, model):
    _assert_same(one_rank(model), _generate(str(tiny_dirs[model]), tensor_parallel_size=2, **CP2))


def test_a_context_longer_than_one_ranks_pool_serves(tiny_dirs):
    """24 blocks of 16 per rank: a 530-token prompt cannot fit one rank's pool, and fits two."""
    model, prompt = str(tiny_dirs["llama"]), [STORY * 10]
    (alone,) = _generate(model, prompt, num_blocks=24)
    assert alone.error is not None
    (split,) = _generate(model, prompt, num_blocks=24, **CP2)
    (roomy,) = _generate(model, prompt, num_blocks=48)
    assert split.num_prompt_tokens > 24 * 16
    _assert_same([roomy], [split])


ENGINE = {"num_blocks": 160, "max_num_batched_tokens": 64}



def test_sessions_ngram_drafts_and_preemption(tiny_dirs):
    """Session turns keep their KV split between the ranks; n-gram drafts verify across them; a pool too small for
    the batch preempts and recomputes; every output equals one rank's, no block is left."""
    model = str(tiny_dirs["llama"])
    turns = [("Hello there, " * 20, True, False), (" and then", False, False), (" finally", False, True)]
    copy_prompt = "a b c d e f g h a b c d e f g h a b c d e f g h a b c d"

    def run(tight_blocks: int, **settings) -> tuple[dict, dict, dict]:
        engine = make_engine(model, ENGINE, **settings)  # one multi-rank engine at a time in a process (one default group)
        try:
            session = {}
            for i, (text, start, end) in enumerate(turns):
                engine.add_request(f"t{i}", text, GREEDY, SessionControl("s", start=start, end=end))
                session.update(new_tokens(drive(engine)))
            for i, prompt in enumerate([copy_prompt, STORY * 10]):
                engine.add_request(f"n{i}", prompt, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
            spec = new_tokens(drive(engine))
        finally:
            engine.close()
        # The same global pool: 28 blocks on one rank, 14 on each of two.
        tight = make_engine(model, ENGINE, num_blocks=tight_blocks, max_num_seqs=4,
                        **{k: v for k, v in settings.items() if k.startswith("context")})
        try:
            for i in range(4):
                tight.add_request(f"p{i}", f"{i} " + STORY * 2, SamplingParams(max_tokens=24, temperature=0.0,
                                                                                ignore_eos=True))
            preempted = new_tokens(drive(tight))
            stats = tight.stats()
            assert stats.kv_blocks_used == 0 and stats.num_preemptions > 0
            tight.scheduler.check_integrity()
            return session, spec, preempted
        finally:
            tight.close()

    reference = run(28)
    got = run(14, method="ngram", num_speculative_tokens=3, **CP2)
    assert got == reference


def test_killed_context_rank_fails_the_step_naming_it(tiny_dirs, child_worker_pids):
    llm = LLM(str(tiny_dirs["llama"]), num_blocks=64, distributed_timeout_s=20, **CP2)
    try:
        (pid,) = child_worker_pids()
        os.kill(pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(RankFailure, match="context-parallel rank 1"):
            llm.generate(PROMPTS, GREEDY)
        assert time.monotonic() - start < 10
    finally:
        llm.close()
    assert child_worker_pids() == []


def test_a_hung_context_rank_fails_the_step_within_the_timeout_naming_it(tiny_dirs, child_worker_pids):
    """A stopped rank answers no collective: the context group's own timeout (distributed_timeout_s, not gloo's
    30-minute default for subgroups) fails the step, and the error names the rank. 10 s, not less: the same timeout
    bounds rank 1's join at start, which took over 4 s on the loaded 2-core machine (RankFailure at load)."""
    llm = LLM(str(tiny_dirs["llama"]), num_blocks=64, distributed_timeout_s=10, **CP2)
    try:
        (pid,) = child_worker_pids()
        os.kill(pid, signal.SIGSTOP)
        start = time.monotonic()
        with pytest.raises(RankFailure, match="context-parallel rank 1.*stopped"):
            llm.generate(PROMPTS[:1], GREEDY)
        assert time.monotonic() - start < 25  # the 10 s timeout and a margin: not gloo's 30 minutes
    finally:
        llm.close()  # kills the stopped rank
    assert child_worker_pids() == []


@pytest.mark.parametrize("settings, message", [
    ({"compile_backend": "inductor"}, "compile_backend 'none'"),
    ({"context_parallel_size": 0}, "context_parallel_size must be in"),
])
def test_refused_settings_name_the_field(tiny_dirs, settings, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig.from_flat({"model": str(tiny_dirs["llama"]), **CP2, **settings})


def test_a_model_without_context_parallel_attention_is_refused_by_name(tmp_path, child_worker_pids):
    model = make_tiny("deepseek_v3", tmp_path / "v3_engram", engram_layers=[1])  # Engram's rows are not split yet
    with pytest.raises(ValueError, match="DeepseekV3.*no context-parallel attention"):
        LLM(str(model), num_blocks=64, **CP2)
    assert child_worker_pids() == []


@pytest.mark.parametrize("config", ["release_small", "odd_rates"])
def test_deepseek_v4_two_context_ranks_give_the_reference_greedy(tmp_path, config):
    """DeepSeek-V4's compressed entries split across two ranks (the indexer's top-k taken over both ranks'
    scores, ties in entry order; the window and sinks on rank 0), against DeepSeek's own inference code (ported in
    tests/helpers/v4_reference.py): prompts inside and far past the window, in 61-token chunks beside decodes, and
    with MTP drafts."""
    from tests.helpers.v4_reference import REFERENCE_CONFIGS, ReferenceV4
    path = make_tiny("deepseek_v4", tmp_path / config, seed=11, initializer_range=0.15,
                     overrides=REFERENCE_CONFIGS[config], mtp_layers=1)
    reference = ReferenceV4(path)
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 300, (n,), generator=generator).tolist() for n in (5, 70, 300)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    expected = [reference.greedy(p, 24) for p in prompts]
    for extra in ({}, MTP):
        results = _generate(str(path), prompts, params, max_model_len=1024, max_num_batched_tokens=61,
                            num_blocks=24, **CP2, **extra)
        assert [r.token_ids for r in results] == expected, extra
