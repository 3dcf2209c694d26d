"""DeepSeek-V4.1 with its DSpark drafter (``mtp.*``, spec_method=dspark) and the same blocks without heads (dflash)
through the engine: greedy output equals no speculation token for token with chunked prefill, four requests
batched, a pool small enough to preempt them, and a two-turn session; the drafter's Markov head planted with the
target's own bigrams (tests/helpers/dspark_v41_cases.py), so drafts are partly accepted and the rejected rest rolls
back (the target's window / compressor rings and Engram history, the drafter's context cache); that cache, read after many rejections,
equals what a plain prefill of the same tokens writes."""
from __future__ import annotations

import shutil

import pytest
import torch

from backend_lib.core.outputs import SessionControl
from backend_lib.core.sampling_params import SamplingParams
from backend_lib.models.deepseek_v41.model import DeepseekV41ForCausalLM
from backend_lib.tools.tiny import make_tiny
from tests.helpers.deepseek_v41_cases import tokens
from tests.helpers.dspark_v41_cases import plant_bigrams
from tests.helpers.engines import drive, make_engine

FLAT = {"max_model_len": 512, "block_size": 16, "max_num_seqs": 4, "max_num_batched_tokens": 32, "num_blocks": 14}
PROMPTS = {f"r{n}": tokens(n, 60 + n) for n in (3, 90, 50, 130)}
PARAMS = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module", autouse=True)
def exact_and_one_thread():
    threads, qat = torch.get_num_threads(), DeepseekV41ForCausalLM.qat_activations
    torch.set_num_threads(1)
    # QAT off: its fp8 / fp4 roundings flip with the summation order of different batch shapes
    DeepseekV41ForCausalLM.qat_activations = False
    yield
    torch.set_num_threads(threads)
    DeepseekV41ForCausalLM.qat_activations = qat


def _tokens(outputs) -> dict[str, list[int]]:
    return {rid: [t for o in outs for t in o.new_token_ids] for rid, outs in outputs.items()}


def _two_turns(engine) -> list[list[int]]:
    out = []
    for rid, prompt, session in (("t1", tokens(70, 71), SessionControl("s", start=True)),
                                 ("t2", tokens(9, 72), SessionControl("s", end=True))):
        engine.add_request(rid, prompt, PARAMS, session=session)
        out.append(_tokens(drive(engine))[rid])
    return out


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    # Engram on layer 2: its token history rolls back with the rejected drafts too
    path = make_tiny("deepseek_v41", tmp_path_factory.mktemp("v41_dspark"), seed=5, dspark=True,
                     overrides={"dspark_markov_rank": 160}, engram_layers=(2,))
    plain = make_engine(path, FLAT)
    expected = _tokens(drive(plain, {r: (p, PARAMS) for r, p in PROMPTS.items()}))
    turns = _two_turns(plain)
    planted = plant_bigrams(path, [PROMPTS[r] + expected[r] for r in PROMPTS] + turns)
    assert planted > 32
    return path, expected, turns, plain


def _spec_engine(path, method: str):
    return make_engine(path, FLAT, method=method, num_speculative_tokens=3, speculative_model=str(path),
                       spec_schedule="fixed")


@pytest.fixture(scope="module")
def dspark(case):
    return _spec_engine(case[0], "dspark")


def _check(engine, expected, turns, method: str) -> None:
    assert _tokens(drive(engine, {r: (p, PARAMS) for r, p in PROMPTS.items()})) == expected
    stats = engine.stats()
    assert stats.num_preemptions > 0
    if method == "dspark":  # the planted bigrams: partly accepted, partly rolled back
        assert 0 < stats.spec_accepted_tokens < stats.spec_draft_tokens
    assert _two_turns(engine) == turns


def test_dspark_greedy_equals_no_speculation_batched_chunked_preempted_and_in_a_session(case, dspark):
    _check(dspark, case[1], case[2], "dspark")


@pytest.mark.slow
def test_dflash_greedy_equals_no_speculation_batched_chunked_preempted_and_in_a_session(case):
    _check(_spec_engine(case[0], "dflash"), case[1], case[2], "dflash")


def test_confidence_schedule_keeps_the_tokens(case, dspark):
    """Lengths in [0, 3] chosen per step from the confidence head's survival: the same tokens."""
    drafter = dspark.runner.block_drafter
    drafter.fixed_length = False
    try:
        some = {r: PROMPTS[r] for r in ("r3", "r50")}
        before = sum(dspark.stats().spec_chosen_lengths)
        assert _tokens(drive(dspark, {r: (p, PARAMS) for r, p in some.items()})) == {r: case[1][r] for r in some}
        assert sum(dspark.stats().spec_chosen_lengths) > before  # each decode step's choice counted (/metrics)
    finally:
        drafter.fixed_length = True


def test_seeded_sampling_equals_no_speculation(case, dspark):
    params = SamplingParams(max_tokens=16, temperature=0.8, top_p=0.95, seed=1234, ignore_eos=True)
    some = {r: (PROMPTS[r], params) for r in ("r3", "r50")}
    assert _tokens(drive(dspark, some)) == _tokens(drive(case[3], some))


def _running(engine, request_id: str):
    return next((r for r in engine.scheduler.running if r.request_id == request_id), None)


def _drafter_cache(engine, request_id: str) -> tuple[torch.Tensor, list[int]]:  # [L, P, D], the tokens
    request = _running(engine, request_id)
    cache, bs = engine.runner.block_drafter.cache, engine.config.cache.block_size
    slots = [request.block_ids[p // bs] * bs + p % bs for p in range(request.num_computed_tokens)]
    return cache[:, slots].clone(), request.all_token_ids[:request.num_computed_tokens]


def test_rollback_leaves_the_drafter_cache_as_without_the_rejected_drafts(case, dspark):
    """Mid-generation, after rejected drafts, the drafter's context latents at every computed position equal what a
    plain prefill of the same tokens writes (rejected rows wrote past the anchor, rewritten since)."""
    before = dspark.stats().spec_draft_tokens - dspark.stats().spec_accepted_tokens
    dspark.add_request("decoding", PROMPTS["r50"], PARAMS)
    for _ in range(12):
        dspark.step()
    assert dspark.stats().spec_draft_tokens - dspark.stats().spec_accepted_tokens > before  # some were rejected
    cache, seen = _drafter_cache(dspark, "decoding")
    assert len(seen) > len(PROMPTS["r50"]) + 4
    dspark.add_request("prefill", seen, PARAMS)
    while _running(dspark, "prefill") is None or _running(dspark, "prefill").num_computed_tokens < len(seen):
        dspark.step()
    fresh, _ = _drafter_cache(dspark, "prefill")
    torch.testing.assert_close(cache, fresh[:, :cache.shape[1]], atol=1e-5, rtol=1e-5)
    dspark.abort("decoding")
    dspark.abort("prefill")
    drive(dspark)


@pytest.mark.slow
def test_two_ranks_equal_one(case, monkeypatch, tmp_path):
    """tensor_parallel_size=2: the target and the drafter split (heads, output groups, experts' intermediate units),
    every rank running the draft pass the driver plans: the one-rank tokens. QAT on (the worker processes build
    the model class as shipped), against one rank without speculation with QAT on; the bigrams planted in a copy
    from those tokens, so drafts are partly accepted here too."""
    monkeypatch.setattr(DeepseekV41ForCausalLM, "qat_activations", True)
    path = shutil.copytree(case[0], tmp_path / "ckpt")
    some = {r: PROMPTS[r] for r in ("r3", "r90")}
    expected = _tokens(drive(make_engine(path, FLAT), {r: (p, PARAMS) for r, p in some.items()}))
    plant_bigrams(path, [some[r] + expected[r] for r in some])
    engine = make_engine(path, FLAT, method="dspark", num_speculative_tokens=3, speculative_model=str(path),
                         spec_schedule="fixed", tensor_parallel_size=2, num_blocks=48)
    try:
        assert _tokens(drive(engine, {r: (p, PARAMS) for r, p in some.items()})) == expected
        stats = engine.stats()
        assert 0 < stats.spec_accepted_tokens < stats.spec_draft_tokens
    finally:
        engine.close()
