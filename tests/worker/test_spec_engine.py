"""Speculative decoding through the engine is lossless: greedy tokens equal the plain engine's (SmolLM2 with n-gram
drafts; a tiny DeepSeek-V3 with MTP, 1 and 3 drafts) alone and in concurrent batches with chunked prefill,
preemption, sessions and aborts; seeded sampled requests emit the same tokens as without speculation, whatever their
batch; per-request opt-out; the spec counters."""
from __future__ import annotations

import pytest
import torch

from backend_lib.core.config import EngineConfig
from backend_lib.core.outputs import SessionControl
from backend_lib.core.sampling_params import SamplingParams
from backend_lib.engine.llm_engine import LLMEngine
from backend_lib.engine.offline import LLM
from backend_lib.tools.tiny import make_tiny
from tests.helpers.engines import drive, make_engine, new_tokens

TEXT = ("The lighthouse keeper climbed the spiral stairs every evening at dusk, lit the great lamp, and wrote the "
        "names of passing ships in a worn leather book.")
COPY_PROMPTS = [
    [{"role": "user", "content": f"Repeat the following text exactly.\n\n{TEXT}"}],
    [{"role": "user", "content": f"Rewrite this text, replacing 'lighthouse keeper' with 'old sailor':\n\n{TEXT}"}],
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
    [{"role": "user", "content": "Name three colours."}],
]


@pytest.fixture(scope="module")
def smol(smollm2_path):
    flat = {"model": smollm2_path, "num_blocks": 256, "max_num_seqs": 16}
    return (LLM(config=EngineConfig.from_flat(flat)),
            LLM(config=EngineConfig.from_flat({**flat, "method": "ngram", "num_speculative_tokens": 4})))


def _ids(outputs) -> list[list[int]]:
    return [o.token_ids for o in outputs]


def test_ngram_greedy_equals_plain_alone_and_batched(smol):
    plain, spec = smol
    params = SamplingParams(max_tokens=40, temperature=0.0)
    expected = _ids(plain.generate(COPY_PROMPTS, params))
    before = spec.engine.stats()
    assert _ids(spec.generate(COPY_PROMPTS, params)) == expected
    for prompt, want in zip(COPY_PROMPTS[:2], expected[:2]):
        assert _ids(spec.generate([prompt], params)) == [want]
    stats = spec.engine.stats()
    accepted = stats.spec_accepted_tokens - before.spec_accepted_tokens
    assert accepted > 20  # the copy prompts really are accepted, several tokens a step
    assert stats.spec_mean_accepted_length > 1.5
    assert len(stats.spec_accepted_per_position) == 4
    assert all(0 <= r <= 1 for r in stats.spec_acceptance_rate_per_position)
    assert stats.kv_blocks_used == 0


def test_seeded_sampling_equals_plain_and_ignores_the_batch(smol):
    plain, spec = smol
    params = SamplingParams(max_tokens=32, temperature=0.8, top_p=0.95, seed=1234, ignore_eos=True, logprobs=2)
    penalized = SamplingParams(max_tokens=24, temperature=0.7, seed=99, repetition_penalty=1.3,
                               frequency_penalty=0.2, ignore_eos=True, min_tokens=5)
    prompts = [COPY_PROMPTS[0], COPY_PROMPTS[2]]
    base = plain.generate(prompts, [params, penalized])
    alone = [spec.generate([p], [sp])[0] for p, sp in zip(prompts, [params, penalized])]
    others = [SamplingParams(max_tokens=20, temperature=t, seed=s) for t, s in [(0.0, 1), (1.0, 2), (0.5, 3)]]
    mixed = spec.generate(COPY_PROMPTS[1:2] + prompts + COPY_PROMPTS[3:], others[:1] + [params, penalized] + others[1:2])
    # Deterministic drafts are verified with the sampler's own seeded draw: the same tokens as without speculation.
    assert _ids(alone) == _ids(base) == _ids(mixed[1:3])
    for ours, theirs in zip(alone[0].logprobs, base[0].logprobs):
        assert ours.token_id == theirs.token_id and abs(ours.logprob - theirs.logprob) < 1e-4
        assert [t for t, _ in ours.top] == [t for t, _ in theirs.top]


def test_per_request_opt_out(smol):
    _, spec = smol
    before = spec.engine.stats().spec_draft_tokens
    spec.generate([COPY_PROMPTS[0]], SamplingParams(max_tokens=24, temperature=0.0, speculative=False))
    assert spec.engine.stats().spec_draft_tokens == before


# ---- MTP on a tiny DeepSeek-V3 ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_mtp(tmp_path_factory):
    return make_tiny("deepseek_v3", tmp_path_factory.mktemp("tiny_mtp"), seed=7, mtp_layers=1)


ENGINE = {"max_model_len": 256, "block_size": 4, "max_num_batched_tokens": 16}



def _workload(engine: LLMEngine) -> dict[str, list[int]]:
    """Four concurrent requests (chunked prefill, a pool small enough to preempt), then a two-turn session."""
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    for i, n in enumerate((5, 19, 40, 11)):
        prompt = torch.randint(3, 300, (n,), generator=torch.Generator().manual_seed(n)).tolist()
        engine.add_request(f"r{i}", prompt, params)
    out = new_tokens(drive(engine))
    engine.add_request("t1", [7, 8, 9, 10, 11, 12], params, session=SessionControl("s", start=True))
    out.update(new_tokens(drive(engine)))
    engine.add_request("t2", [13, 14, 15], params, session=SessionControl("s", end=True))
    out.update(new_tokens(drive(engine)))
    return out


@pytest.mark.parametrize("k", [1, 3])
def test_mtp_greedy_equals_plain(tiny_mtp, k):
    expected = _workload(make_engine(tiny_mtp, ENGINE, num_blocks=40))
    engine = make_engine(tiny_mtp, ENGINE, num_blocks=40, method="mtp", num_speculative_tokens=k)
    assert _workload(engine) == expected
    stats = engine.stats()
    assert stats.num_preemptions > 0 and stats.spec_draft_tokens > 0
    assert len(stats.spec_drafts_per_position) == k
    engine.scheduler.check_integrity()
    assert stats.kv_blocks_used == 0


def test_mtp_abort_mid_request_frees_blocks(tiny_mtp):
    engine = make_engine(tiny_mtp, ENGINE, num_blocks=64, method="mtp", num_speculative_tokens=2)
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    engine.add_request("a", [5, 6, 7, 8, 9], params)
    engine.add_request("b", [9, 8, 7], params)
    tokens_of_a = []

    def abort_a_after_four(out) -> None:
        if out.request_id == "a":
            tokens_of_a.extend(out.new_token_ids)
            if len(tokens_of_a) >= 4:
                engine.abort("a")
    out = new_tokens(drive(engine, on_output=abort_a_after_four))
    assert 4 <= len(out["a"]) < 30 and len(out["b"]) == 30
    engine.scheduler.check_integrity()
    assert engine.stats().kv_blocks_used == 0
