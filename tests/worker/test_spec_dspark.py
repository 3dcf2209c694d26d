"""DSpark / DFlash block drafts through the engine (SmolLM2 with a random drafter, which accepts little: losslessness
is what counts): greedy output equals the plain engine's token for token, alone and batched with chunked prefill,
at a fixed length and confidence-scheduled; seeded sampling too; rollback leaves the drafter's cache as if the
rejected drafts never came; the settings are refused by name."""
from __future__ import annotations

import pytest
import torch

from backend_lib.core.config import EngineConfig
from backend_lib.core.sampling_params import SamplingParams
from backend_lib.engine.llm_engine import LLMEngine
from backend_lib.engine.offline import LLM
from backend_lib.tools.drafter import write_random_drafter
from tests.helpers.engines import make_engine

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


def _running(engine: LLMEngine, request_id: str):
    return next((r for r in engine.scheduler.running if r.request_id == request_id), None)


def _drafter_keys(engine: LLMEngine, request_id: str) -> tuple[torch.Tensor, list[int]]:  # K [L, P, Hkv, D]
    request = _running(engine, request_id)
    drafter, bs = engine.runner.block_drafter, engine.config.cache.block_size
    slots = [request.block_ids[p // bs] * bs + p % bs for p in range(request.num_computed_tokens)]
    return drafter.k_cache[:, slots].clone(), request.all_token_ids[:request.num_computed_tokens]


def test_rollback_leaves_the_drafter_cache_as_without_the_rejected_drafts(dspark):
    """Mid-generation, after many rejected drafts, the drafter's K at every computed position equals what a plain
    prefill of the same tokens writes (rejected drafts' rows wrote garbage past the anchor, all rewritten since)."""
    engine = dspark.engine
    engine.add_request("decoding", PROMPTS[2], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    for _ in range(10):
        engine.step()
    keys, tokens = _drafter_keys(engine, "decoding")
    assert len(tokens) > len(engine.scheduler.running[0].prompt_token_ids) + 4
    engine.add_request("prefill", tokens, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    while _running(engine, "prefill") is None or _running(engine, "prefill").num_computed_tokens < len(tokens):
        engine.step()
    fresh, _ = _drafter_keys(engine, "prefill")
    torch.testing.assert_close(keys, fresh[:, :keys.shape[1]], atol=2e-3, rtol=1e-3)
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
