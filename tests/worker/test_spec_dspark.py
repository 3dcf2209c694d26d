"""DSpark / DFlash block drafts through the engine (SmolLM2 with a random drafter, which accepts little: losslessness
is what counts): greedy output equals the plain engine's token for token, alone and batched with chunked prefill,
at a fixed length and confidence-scheduled; seeded sampling too; with a pool small enough to preempt, a grammar
cutting the drafts, a seeded penalized row and a two-turn session, the tokens stay the plain engine's; rollback
leaves the target's and the drafter's caches as if the rejected drafts never came; the settings are refused by
name."""
from __future__ import annotations

import re

import pytest
import torch

from backend_lib.core.config import EngineConfig
from backend_lib.core.outputs import SessionControl
from backend_lib.core.sampling_params import SamplingParams
from backend_lib.engine.llm_engine import LLMEngine
from backend_lib.engine.offline import LLM
from backend_lib.structured_output.constraints import parse_constraint
from backend_lib.tools.drafter import write_random_drafter
from tests.helpers.engines import drive, make_engine, new_tokens

PROMPTS = [
    [{"role": "user", "content": "Name three colours."}],
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
    [{"role": "user", "content": "Write one sentence about the sea and another about the mountains."}],
]
# small step budget: the longer prompts prefill in several chunks, next to other requests' decodes
FLAT = {"num_blocks": 128, "max_num_seqs": 8, "max_num_batched_tokens": 24, "enable_prefix_caching": False}


@pytest.fixture(scope="module")
def drafter_dir(smollm2_path, tmp_path_factory):
    return write_random_drafter(smollm2_path, str(tmp_path_factory.mktemp("drafter")), seed=3, block_size=4,
                                markov_rank=32, num_draft_layers=1)


def _engine(smollm2_path: str, **spec) -> LLM:
    return make_engine(smollm2_path, FLAT, engine_type=lambda config: LLM(config=config), **spec)


def _spec(drafter_dir: str, method: str) -> dict:
    return {"method": method, "num_speculative_tokens": 3, "speculative_model": drafter_dir, "spec_schedule": "fixed"}


@pytest.fixture(scope="module")
def plain(smollm2_path):
    return _engine(smollm2_path)


@pytest.fixture(scope="module")
def dspark(smollm2_path, drafter_dir):
    return _engine(smollm2_path, **_spec(drafter_dir, "dspark"))


@pytest.fixture(scope="module")
def dflash(smollm2_path, drafter_dir):
    return _engine(smollm2_path, **_spec(drafter_dir, "dflash"))


def _ids(outputs) -> list[list[int]]:
    return [o.token_ids for o in outputs]


def test_greedy_equals_plain_alone_and_batched(plain, dspark, dflash):
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    expected = _ids(plain.generate(PROMPTS, params))
    for spec in (dspark, dflash):
        before = spec.engine.stats().spec_draft_tokens
        assert _ids(spec.generate(PROMPTS, params)) == expected
        assert spec.engine.stats().spec_draft_tokens - before > 3 * 12  # 3 drafts verified nearly every step
    # /metrics' survival calibration: DSpark's head predicted every position (fixed length 3); DFlash has no head
    survival = dspark.engine.stats().spec_survival
    assert len(survival.predicted) == len(survival.observed) == 3
    assert all(0 <= p <= 1 for p in survival.predicted + survival.observed)
    assert dflash.engine.stats().spec_survival.predicted == []
    assert plain.engine.stats().spec_survival is None
    # the confidence schedule chooses lengths in [0, 3] per step: still the same tokens
    drafter = dspark.engine.runner.block_drafter
    drafter.fixed_length = False
    try:
        assert _ids(dspark.generate(PROMPTS, params)) == expected
    finally:
        drafter.fixed_length = True


def test_seeded_sampling_equals_plain(plain, dspark):
    params = SamplingParams(max_tokens=10, temperature=0.8, top_p=0.95, seed=1234, ignore_eos=True)
    assert _ids(dspark.generate(PROMPTS[:2], params)) == _ids(plain.generate(PROMPTS[:2], params))


COLOURS = r"(red|green|blue)(, (red|green|blue)){2,6}"


def _workload(engine: LLMEngine) -> dict[str, list[int]]:
    """Four concurrent requests (chunked prefill; a small pool preempts): greedy, a grammar, seeded sampling with
    penalties (its token history rolls back too); then a two-turn session."""
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    sampled = SamplingParams(max_tokens=12, temperature=0.8, seed=7, repetition_penalty=1.3, frequency_penalty=0.2,
                             ignore_eos=True)
    grammar = SamplingParams(max_tokens=24, temperature=0.0,
                             structured_outputs=parse_constraint({"guided_regex": COLOURS}))
    colours = [{"role": "user", "content": "List some colours, separated by commas."}]
    out = new_tokens(drive(engine, {"greedy": (PROMPTS[0], greedy), "code": (PROMPTS[1], greedy),
                                    "sampled": (PROMPTS[2], sampled), "grammar": (colours, grammar)}))
    engine.add_request("t1", PROMPTS[0], greedy, session=SessionControl("s", start=True))
    out.update(new_tokens(drive(engine)))
    engine.add_request("t2", "And three more, please.", greedy, session=SessionControl("s", end=True))
    out.update(new_tokens(drive(engine)))
    return out


@pytest.mark.slow
def test_preemption_grammar_penalties_and_sessions_equal_plain(smollm2_path, drafter_dir, plain):
    expected = _workload(plain.engine)
    spec = _engine(smollm2_path, **{**_spec(drafter_dir, "dspark"), "spec_schedule": "confidence"}, num_blocks=8)
    got = _workload(spec.engine)
    assert got == expected
    text = spec.engine.tokenizer.decode(got["grammar"])
    assert re.fullmatch(COLOURS, text), text
    stats = spec.engine.stats()
    assert stats.num_preemptions > 0 and stats.spec_draft_tokens > 0
    spec.engine.scheduler.check_integrity()
    assert stats.kv_blocks_used == 0


def _running(engine: LLMEngine, request_id: str):
    return next((r for r in engine.scheduler.running if r.request_id == request_id), None)


def _states(engine: LLMEngine, request_id: str) -> tuple[list[torch.Tensor], list[int]]:
    """The target's K / V and the drafter's K / V at each computed position ([L, P, Hkv, D] each), and the tokens."""
    request = _running(engine, request_id)
    runner, bs = engine.runner, engine.config.cache.block_size
    slots = [request.block_ids[p // bs] * bs + p % bs for p in range(request.num_computed_tokens)]
    caches = [*runner.kv_caches, runner.block_drafter.k_cache, runner.block_drafter.v_cache]
    return [cache[:, slots].clone() for cache in caches], request.all_token_ids[:request.num_computed_tokens]


def test_rollback_leaves_every_cache_as_without_the_rejected_drafts(dspark):
    """Mid-generation, after many rejected drafts, the target's and the drafter's K / V at every computed position
    equal what a plain prefill of the same tokens writes (rejected drafts' rows wrote past the anchor, all
    rewritten since)."""
    engine = dspark.engine
    engine.add_request("decoding", PROMPTS[2], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    for _ in range(10):
        engine.step()
    before = engine.stats()
    states, tokens = _states(engine, "decoding")
    assert len(tokens) > len(engine.scheduler.running[0].prompt_token_ids) + 4
    assert before.spec_draft_tokens > before.spec_accepted_tokens  # drafts were rejected
    engine.add_request("prefill", tokens, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    while _running(engine, "prefill") is None or _running(engine, "prefill").num_computed_tokens < len(tokens):
        engine.step()
    fresh, _ = _states(engine, "prefill")
    for ours, theirs in zip(states, fresh):
        torch.testing.assert_close(ours, theirs[:, :ours.shape[1]], atol=2e-3, rtol=1e-3)
    engine.abort("decoding")
    engine.abort("prefill")
    while engine.has_unfinished_requests():
        engine.step()


def test_settings_are_refused_by_name(smollm2_path, drafter_dir):
    with pytest.raises(ValueError, match="speculative_model"):
        EngineConfig.from_flat({"method": "dspark", "num_speculative_tokens": 3})
    with pytest.raises(ValueError, match="spec_schedule"):
        EngineConfig.from_flat({"method": "dflash", "num_speculative_tokens": 3, "speculative_model": drafter_dir,
                                "spec_schedule": "greedy"})
