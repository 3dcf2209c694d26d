"""Engine behaviour: seeded sampling, stop strings, streaming, prefix caching, aborts and preemption, bad input."""
from __future__ import annotations

import random

import pytest

from backend_lib.core.config import EngineConfig
from backend_lib.core.errors import ErrorKind, RequestError
from backend_lib.core.outputs import SessionControl
from backend_lib.core.sampling_params import SamplingParams
from backend_lib.engine.async_engine import AsyncEngine
from backend_lib.engine.offline import LLM
from tests.helpers.engines import drive, final_outputs, full_texts, make_engine


@pytest.fixture(scope="module")
def smollm2(smollm2_path):
    # dequantize: the texts below are the fp32 model's (the packed default's int8 activations word them otherwise)
    return LLM(config=EngineConfig.from_flat({"model": smollm2_path, "weight_format": "dequantize", "num_blocks": 512,
                                              "max_num_seqs": 16}))


ENGINE = {"max_model_len": 256}


def test_seeded_sampling_is_batch_invariant(smollm2):
    prompt = "Write a sentence about the sea."
    params = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, seed=1234, ignore_eos=True)
    alone = smollm2.generate([prompt], params)[0].token_ids
    others = [SamplingParams(max_tokens=24, temperature=t, top_k=k, seed=s, ignore_eos=True)
              for t, k, s in [(0.0, -1, None), (1.2, 50, 7), (0.5, 5, 8), (1.0, -1, None)] * 2]
    batch = smollm2.generate([f"Other prompt {i}: tell me about bread." for i in range(8)] + [prompt],
                             others + [params])
    assert batch[-1].token_ids == alone
    different = smollm2.generate([prompt], params.clone(seed=4321))[0].token_ids
    assert different != alone


def test_stop_string_spanning_tokens_is_cut_and_deltas_concatenate(smollm2):
    prompt = [{"role": "user", "content": "What is the capital of France?"}]
    free = smollm2.generate([prompt], SamplingParams(max_tokens=32, temperature=0.0))[0].text
    assert "capital of France" in free
    stop = "of Fra"  # spans at least two tokens (" of", " France")
    engine = smollm2.engine
    engine.add_request("stop-test", prompt, SamplingParams(max_tokens=32, temperature=0.0, stop=[stop]))
    outputs = drive(engine)
    text, final = full_texts(outputs)["stop-test"], final_outputs(outputs)["stop-test"]
    assert final.finish_reason == "stop" and final.stop_reason == stop
    assert text == free[:free.index(stop)]
    assert stop not in text


def test_prefix_cache_computes_only_new_tokens(smollm2, smollm2_path):
    llm = smollm2  # prefix caching on (the default); its earlier requests share no prefix with these prompts
    engine = llm.engine
    shared = " ".join(f"word{i}" for i in range(120))  # well over 200 tokens
    first, second = shared + " The end.", shared + " Another ending here."
    params = SamplingParams(max_tokens=8, temperature=0.0)
    with LLM(config=EngineConfig.from_flat({"model": smollm2_path, "num_blocks": 256,
                                            "enable_prefix_caching": False})) as uncached:
        cold = uncached.generate([second], params)[0]
    assert engine.config.cache.enable_prefix_caching
    llm.generate([first], params)
    before = engine.stats()
    warm = llm.generate([second], params)[0]
    after = engine.stats()
    prefix_len = len(engine.tokenize(shared))
    assert prefix_len >= 200
    computed = after.num_computed_prompt_tokens - before.num_computed_prompt_tokens
    assert warm.num_cached_tokens >= prefix_len - engine.config.cache.block_size
    assert computed == warm.num_prompt_tokens - warm.num_cached_tokens
    assert computed <= warm.num_prompt_tokens - prefix_len + engine.config.cache.block_size
    assert warm.token_ids == cold.token_ids


def _random_workload(rng: random.Random, n: int, vocab: int):
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(1, 60))] for _ in range(n)]
    params = [SamplingParams(max_tokens=rng.randint(1, 20), temperature=0.0, ignore_eos=True) for _ in range(n)]
    return prompts, params


def test_random_requests_aborts_and_preemption_return_every_block(tiny_llama_dir):
    rng = random.Random(0)
    reference = make_engine(tiny_llama_dir, ENGINE, num_blocks=512, max_num_seqs=64)
    vocab = reference.vocab_size
    prompts, params = _random_workload(rng, 300, vocab)
    expected = LLM.__new__(LLM)
    expected.engine = reference
    want = [r.token_ids for r in expected.generate(prompts, params)]

    engine = make_engine(tiny_llama_dir, ENGINE, num_blocks=12, max_num_seqs=16, max_num_batched_tokens=48)
    pending = list(range(300))
    live: set[str] = set()
    got: dict[str, list[int]] = {}
    finish: dict[str, str] = {}
    while pending or engine.has_unfinished_requests():
        for _ in range(rng.randint(0, 6)):
            if pending:
                i = pending.pop(0)
                engine.add_request(str(i), prompts[i], params[i])
                live.add(str(i))
                got[str(i)] = []
        if live and rng.random() < 0.15:
            victim = rng.choice(sorted(live))
            out = engine.abort(victim)
            assert out is not None and out.finish_reason == "abort"
            live.discard(victim)
            finish[victim] = "abort"
        for out in engine.step():
            got[out.request_id] += out.new_token_ids
            if out.finished:
                live.discard(out.request_id)
                finish[out.request_id] = out.finish_reason
    stats = engine.stats()
    assert stats.num_preemptions > 0
    assert stats.kv_blocks_used == 0
    engine.scheduler.check_integrity()
    completed = [rid for rid, reason in finish.items() if reason == "length"]
    assert len(completed) > 150
    for rid in completed:
        assert got[rid] == want[int(rid)], rid


def test_bad_input_is_rejected_with_the_field_name(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir, ENGINE, num_blocks=32)
    cases = [
        ("", SamplingParams(), "prompt is empty", "prompt"),
        ([], SamplingParams(), "input_ids is empty", "input_ids"),
        (list(range(300)), SamplingParams(), "max_model_len", "prompt"),
        (list(range(200)), SamplingParams(max_tokens=100), "max_tokens is 100", "max_tokens"),
        ([engine.vocab_size], SamplingParams(), "outside the vocabulary", "input_ids"),
        ([-1], SamplingParams(), "input_ids must be >= 0", "input_ids"),
        ("hi", SamplingParams(stop_token_ids=[engine.vocab_size + 5]), "stop_token_ids", "stop_token_ids"),
    ]
    for prompt, params, message, field in cases:
        with pytest.raises(RequestError, match=message) as info:
            engine.add_request("bad", prompt, params)
        assert info.value.field == field and info.value.kind is ErrorKind.INVALID
    assert not engine.has_unfinished_requests()
    for field, value, message in [("temperature", -1, "temperature"), ("top_p", 0.0, "top_p"),
                                  ("top_p", 1.5, "top_p"), ("top_k", 0, "top_k"), ("top_k", -2, "top_k"),
                                  ("max_tokens", 0, "max_tokens")]:
        with pytest.raises(ValueError, match=message):
            SamplingParams(**{field: value})
    with pytest.raises(ValueError, match="unknown sampling field 'foo'"):
        SamplingParams.from_dict({"foo": 1})


def test_async_engine_streams_and_aborts(tiny_llama_dir):
    engine = AsyncEngine(EngineConfig.from_flat({"model": str(tiny_llama_dir), "num_blocks": 128,
                                                 "max_model_len": 1024}))
    try:
        params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        streams = [engine.add_request(f"r{i}", [3 + i, 5, 7], params) for i in range(4)]
        long = engine.add_request("long", [9, 9, 9], SamplingParams(max_tokens=900, temperature=0.0,
                                                                    ignore_eos=True))
        outs = [list(s) for s in streams]
        for out in outs:
            assert out[-1].finished and out[-1].finish_reason == "length"
            assert sum(len(o.new_token_ids) for o in out) == 12
        engine.abort("long")
        last = list(long)[-1]
        assert last.finished and last.finish_reason == "abort"
        assert engine.stats().kv_blocks_used == 0
    finally:
        engine.shutdown()


def test_async_engine_takes_new_requests_without_waiting_for_the_step_in_flight(tiny_llama_dir):
    """While a step holds the engine, add_request still returns at once (a bad request still fails the call; a
    refused session turn ends its stream, rejected), and every request that came in meanwhile starts in the same
    next step, not one per step; aborting one that has not started yet, or shutting down, still ends its stream
    and frees its blocks."""
    import threading

    engine = AsyncEngine(EngineConfig.from_flat({"model": str(tiny_llama_dir), "num_blocks": 128,
                                                 "max_model_len": 256, "max_num_seqs": 8}))
    try:
        params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        with engine._lock:  # stands in for a long step: the loop cannot run while this is held
            streams = [engine.add_request(f"r{i}", [3 + i, 5, 7], params) for i in range(6)]
            with pytest.raises(ValueError, match="outside the vocabulary"):
                engine.add_request("bad", [10**6], params)
            with pytest.raises(ValueError, match="already in use"):
                engine.add_request("r0", [3, 5, 7], params)
            refused = engine.add_request("turn", [3, 5, 7], params, SessionControl("s1"))  # no START: unknown
            waiting = engine.add_request("aborted", [3, 5, 7], SamplingParams(max_tokens=200, ignore_eos=True))
            aborter = threading.Thread(target=engine.abort, args=("aborted",))
            aborter.start()
        aborter.join(timeout=60)
        outputs = [list(s) for s in streams]
        assert all(out[-1].finish_reason == "length" for out in outputs)
        assert len({out[0].metrics.first_scheduled_time for out in outputs if out[0].metrics}) == 1
        assert list(waiting)[-1].finish_reason == "abort"
        [rejected] = list(refused)
        assert rejected.rejected and rejected.finish_reason == "error" and "unknown session s1" in rejected.error
        assert rejected.refusal.field == "sequence_id" and not rejected.busy

        with engine._lock:
            late = engine.add_request("late", [3, 5, 7], SamplingParams(max_tokens=200, ignore_eos=True))
            stopper = threading.Thread(target=engine.shutdown)
            stopper.start()
        stopper.join(timeout=60)
        assert list(late)[-1].finish_reason == "abort"
        assert engine.engine.stats().kv_blocks_used == 0
    finally:
        engine.shutdown()


def test_async_engine_builds_on_its_step_thread_and_reraises_build_errors(tiny_llama_dir):
    """The model loads on the step thread (one OpenMP pool: see async_engine.py); a failed build raises in the
    caller and leaves no thread behind."""
    import threading

    before = threading.active_count()
    with pytest.raises(FileNotFoundError):
        AsyncEngine(EngineConfig.from_flat({"model": str(tiny_llama_dir / "missing.gguf")}))
    assert threading.active_count() == before


def test_host_attention_setting_picks_the_kernel_and_both_give_the_same_greedy_text(tiny_llama_dir):
    prompts = ["The sea is", "Paris is the capital of", "1, 2, 3,"]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outputs = {}
    for attention in ("cpp", "torch"):
        llm = LLM(str(tiny_llama_dir), max_model_len=256, host_attention=attention)
        assert [layer.self_attn.cpu_decode_kernel for layer in llm.engine.model.layers] == \
            [attention == "cpp"] * len(llm.engine.model.layers)
        outputs[attention] = [r.token_ids for r in llm.generate(prompts, params)]
    assert outputs["cpp"] == outputs["torch"]
    with pytest.raises(ValueError, match="host_attention must be 'cpp' or 'torch', got 'fast'"):
        EngineConfig.from_flat({"host_attention": "fast"})
