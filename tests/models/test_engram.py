"""Engram against a port of DeepSeek's reference (``tests/helpers/engram_reference.py``) inside the V4 oracle and inside
transformers' DeepSeek-V3: the hash bit for bit, greedy ids through chunked prefill, batching, preemption, sessions,
speculation and two ranks, decode logprobs equal to a prefill's, and checkpoints that must not load."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from backend_lib.core.sampling_params import SamplingParams
from backend_lib.core.outputs import SessionControl
from backend_lib.engine.offline import LLM
from backend_lib.models.engram.config import EngramConfig
from backend_lib.models.engram.ngram_hash import EngramVocabulary, NgramHasher, compressed_vocabulary, head_table_sizes
from backend_lib.models.loading.loader import load_model
from backend_lib.tools.tiny import make_tiny
from tests.helpers.engram_reference import EngramReferenceV4, EngramTransformersV3, reference_lookup
from tests.helpers.v4_reference import ReferenceV4
from tests.helpers.engines import drive, make_engine

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/models/conftest.py

# head counts, n-gram orders, conv widths, stream counts and layer placements (first, last, consecutive)
CONFIGS = {
    "trigram": dict(layers=(1, 3), engram={}, model={}),
    "bigram_k1": dict(layers=(0,), engram=dict(max_ngram_size=2, engram_vocab_size=[257], kernel_size=1,
                                                n_head_per_ngram=2, n_embed_per_ngram=16), model={}),
    "fourgram_two_streams": dict(layers=(2, 3), engram=dict(max_ngram_size=4, engram_vocab_size=[97, 61, 31],
                                                             n_head_per_ngram=3, n_embed_per_ngram=24, kernel_size=3,
                                                             seed=5), model=dict(hc_mult=2)),
}


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(3, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _make(path, name: str, mtp_layers: int = 0):
    spec = CONFIGS[name]
    return make_tiny("deepseek_v4", path, seed=21, initializer_range=0.15, mtp_layers=mtp_layers,
                     overrides=spec["model"], engram_layers=spec["layers"], engram=spec["engram"])


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def case(request, tmp_path_factory):
    path = _make(tmp_path_factory.mktemp(request.param), request.param)
    return request.param, path, EngramReferenceV4(path)


@pytest.fixture(scope="module")
def with_mtp(tmp_path_factory):
    path = _make(tmp_path_factory.mktemp("engram_mtp"), "trigram", mtp_layers=1)
    return path, EngramReferenceV4(path)


ENGINE = {"max_model_len": 1024, "block_size": 16, "max_num_seqs": 4}



def _ids(outputs: list) -> list[int]:
    return [t for o in outputs for t in o.new_token_ids]


GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)


def test_compressed_vocabulary_and_hash_equal_the_reference_arithmetic(case):
    """Our compressed ids (tokenizers' decode) equal the reference's (transformers' AutoTokenizer); our torch int64
    hash equals its numpy hash on random ids, at the padded start and on ids whose compressed ids collide."""
    name, path, ref = case
    lookup = compressed_vocabulary(path / "tokenizer.json")
    assert np.array_equal(lookup, reference_lookup(path))
    assert len(np.unique(lookup)) < len(lookup)  # the tiny tokenizer has ids that compress together
    config = EngramConfig.from_dict(ref.engram_cfg)
    vocab, sizes = EngramVocabulary.build(lookup, config), head_table_sizes(config)
    assert sizes == ref.hashing.sizes
    colliding = [int(i) for i in np.flatnonzero(lookup == np.bincount(lookup).argmax())]
    rng = np.random.default_rng(0)
    ids = np.concatenate([rng.integers(0, len(lookup), 300), np.resize(colliding, 20)])[None]
    width = config.max_ngram_size
    padded = np.concatenate([np.full((1, width - 1), -1), ids], axis=1)
    context = torch.from_numpy(np.lib.stride_tricks.sliding_window_view(padded[0], width).copy())
    for layer in config.layer_ids:
        hasher = NgramHasher(config, vocab, layer, sizes[layer])
        expected = ref.hashing(ids, layer)[0] + hasher.offsets.numpy()
        assert np.array_equal(hasher(context).numpy(), expected)


def test_the_oracle_engram_changes_the_model_and_its_decode_equals_its_prefill(case):
    name, path, ref = case
    ids = _tokens(120, 1)
    assert (ref.teacher_forced(ids, 37) - ref.prefill(ids)).abs().max() <= 1e-4
    plain = ReferenceV4(path)  # the same backbone without Engram: the tests below could not pass by ignoring it
    assert (plain.prefill(ids) - ref.prefill(ids)).abs().max() > 1e-2


def test_engine_greedy_equals_the_reference_batched_and_chunked(case):
    """Prompts inside and far past every n-gram and conv window, prefilled in chunks of 1-7 tokens (a 7-token step
    budget shared with the others' decodes), next to each other: the reference's greedy ids."""
    name, path, ref = case
    prompts = {f"r{n}": _tokens(n, 30 + n) for n in (1, 2, 5, 23, 150)}
    outputs = drive(make_engine(path, ENGINE, max_num_batched_tokens=7), {r: (p, GREEDY) for r, p in prompts.items()})
    for rid, prompt in prompts.items():
        assert _ids(outputs[rid]) == ref.greedy(prompt, 40), rid


def test_decode_logprobs_equal_a_prefill_of_the_same_tokens(case):
    name, path, _ = case
    engine = make_engine(path, ENGINE, max_num_batched_tokens=256)
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True, logprobs=0)
    for n in (3, 70):
        prompt = _tokens(n, 50 + n)
        out = drive(engine, {"gen": (prompt, params)})["gen"]
        decoded = [lp.logprob for o in out for lp in o.new_logprobs]
        again = drive(engine, {"pre": (prompt + _ids(out), SamplingParams(max_tokens=1, prompt_logprobs=0))})["pre"]
        entries = next(o.prompt_logprobs for o in again if o.prompt_logprobs is not None).entries
        prefilled = [e.logprob for e in entries[n - 1:]]
        assert max(abs(a - b) for a, b in zip(decoded, prefilled)) <= 1e-4, n


def test_preemption_and_session_turns_keep_the_reference_greedy_ids(with_mtp):
    path, ref = with_mtp
    engine = make_engine(path, ENGINE, max_num_batched_tokens=32, num_blocks=14)
    prompts = {f"r{n}": _tokens(n, 60 + n) for n in (3, 90, 50, 130)}
    outputs = drive(engine, {r: (p, GREEDY) for r, p in prompts.items()})
    for rid, prompt in prompts.items():
        assert _ids(outputs[rid]) == ref.greedy(prompt, 40), rid
    assert engine.stats().num_preemptions > 0

    def turn(rid: str, prompt: list[int], session: SessionControl) -> list[int]:
        engine.add_request(rid, prompt, GREEDY, session=session)
        return _ids(drive(engine)[rid])

    first, second = _tokens(70, 71), _tokens(9, 72)
    turn1 = turn("t1", first, SessionControl("s", start=True))
    turn2 = turn("t2", second, SessionControl("s", end=True))
    assert turn1 == ref.greedy(first, 40)
    assert turn2 == ref.greedy(first + turn1 + second, 40)


@pytest.mark.parametrize("settings", [
    pytest.param({"tensor_parallel_size": 2}, marks=pytest.mark.slow),
    pytest.param({"tensor_parallel_size": 2, "enable_expert_parallel": True}, marks=pytest.mark.slow),
    {"method": "ngram", "num_speculative_tokens": 3},
    {"method": "mtp", "num_speculative_tokens": 2},
])
def test_ranks_and_speculation_keep_the_reference_greedy_ids(with_mtp, settings):
    """Two ranks (each holding half of every table, the halves added by one all-reduce) and drafts verified in one
    pass (rejected drafts leave nothing in the conv ring that a later step reads)."""
    path, ref = with_mtp
    prompts = [_tokens(n, 80 + n) for n in (9, 150)]
    with LLM(str(path), num_blocks=96, max_num_batched_tokens=64, **settings) as llm:
        results = llm.generate(prompts, SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True))
    for prompt, result in zip(prompts, results):
        assert result.error is None and result.token_ids == ref.greedy(prompt, 48)


def _rewrite(path, edit_tensors=None, edit_config=None) -> None:
    file = path / "model-engram.safetensors"
    tensors = load_file(str(file))
    if edit_tensors:
        edit_tensors(tensors)
        save_file(tensors, str(file), metadata={"format": "pt"})
        index = json.loads((path / "model.safetensors.index.json").read_text())
        index["weight_map"] = {k: v for k, v in index["weight_map"].items()
                               if v != "model-engram.safetensors" or k in tensors}
        (path / "model.safetensors.index.json").write_text(json.dumps(index))
    if edit_config:
        cfg = json.loads((path / "config.json").read_text())
        edit_config(cfg)
        (path / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("breakage, message", [
    (lambda t: t.pop("layers.1.engram.key_projs.2.weight"), "layers.1.engram.key_projs.2.weight"),
    (lambda t: t.update({"layers.3.engram.multi_head_embedding.embedding.weight":
                         t["layers.3.engram.multi_head_embedding.embedding.weight"][:-5]}), "primes"),
    ("layer_ids", "layer_ids [7]"),
    ("vocab", "engram_vocab_size has 1 entries"),
])
def test_bad_engram_checkpoints_fail_the_load_naming_what_is_wrong(tmp_path, breakage, message):
    path = _make(tmp_path / "bad", "trigram")
    if breakage == "layer_ids":
        _rewrite(path, edit_config=lambda cfg: cfg["engram"].update(layer_ids=[1, 7]))
    elif breakage == "vocab":
        _rewrite(path, edit_config=lambda cfg: cfg["engram"].update(engram_vocab_size=[400]))
    else:
        _rewrite(path, edit_tensors=breakage)
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        load_model(str(path), torch.float32, progress=False)


def test_compiled_decode_regions_gather_on_the_host_and_equal_the_reference(with_mtp, tmp_path):
    """Graphs see the gathered rows as a static-shape input (the int64 hash and the lookup stay outside)."""
    path, ref = with_mtp
    engine = make_engine(path, ENGINE, num_blocks=64, max_num_batched_tokens=32, compile_backend="aot_eager",
                     batch_buckets="2", width_buckets="16", compile_progress=False,
                     compile_cache_dir=str(tmp_path / "cache"))
    prompts = {f"r{n}": _tokens(n, 90 + n) for n in (6, 61)}
    outputs = drive(engine, {r: (p, GREEDY) for r, p in prompts.items()})
    for rid, prompt in prompts.items():
        assert _ids(outputs[rid]) == ref.greedy(prompt, 40), rid
    assert engine.runner.model.stats.compiled_steps > 5


def test_an_fp8_table_stays_fp8_and_equals_the_reference_over_its_dequantized_rows(tmp_path):
    spec = CONFIGS["trigram"]
    path = make_tiny("deepseek_v4", tmp_path / "fp8", seed=22, initializer_range=0.15, overrides=spec["model"],
                     engram_layers=spec["layers"], engram_fp8_table=True)
    model = load_model(str(path), torch.float32, progress=False)
    table = model.layers[1].engram.multi_head_embedding.embedding
    assert table.weight.dtype == torch.float8_e4m3fn and table.scale.shape == (table.weight.shape[0], 1)
    ref = EngramReferenceV4(path)
    prompts = {f"r{n}": _tokens(n, 40 + n) for n in (4, 77)}
    outputs = drive(make_engine(path, ENGINE, max_num_batched_tokens=16), {r: (p, GREEDY) for r, p in prompts.items()})
    for rid, prompt in prompts.items():
        assert _ids(outputs[rid]) == ref.greedy(prompt, 40), rid


@pytest.fixture(scope="module")
def v3(tmp_path_factory):
    path = make_tiny("deepseek_v3", tmp_path_factory.mktemp("engram_v3"), seed=23, mtp_layers=1,
                     engram_layers=(0, 2))
    return path, EngramTransformersV3(path)


def test_v3_greedy_equals_transformers_with_the_reference_engram(v3):
    """DeepSeek-V3 (one residual stream; its latent cache plus Engram's state slots): chunks of 1-7 tokens, batching,
    a pool small enough to preempt, then a two-turn session."""
    path, ref = v3
    engine = make_engine(path, ENGINE, max_num_batched_tokens=7, num_blocks=10)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    prompts = {f"r{n}": _tokens(n, 100 + n) for n in (2, 9, 45, 70)}
    outputs = drive(engine, {r: (p, params) for r, p in prompts.items()})
    for rid, prompt in prompts.items():
        assert _ids(outputs[rid]) == ref.greedy(prompt, 24), rid
    assert engine.stats().num_preemptions > 0
    first, second = _tokens(20, 7), _tokens(5, 8)
    engine.add_request("t1", first, params, session=SessionControl("s", start=True))
    turn1 = _ids(drive(engine)["t1"])
    engine.add_request("t2", second, params, session=SessionControl("s", end=True))
    assert _ids(drive(engine)["t2"]) == ref.greedy(first + turn1 + second, 24)


@pytest.mark.parametrize("settings", [
    pytest.param({"tensor_parallel_size": 2, "enable_expert_parallel": True}, marks=pytest.mark.slow),
    {"method": "mtp", "num_speculative_tokens": 2},
    {"method": "ngram", "num_speculative_tokens": 3},
])
def test_v3_ranks_and_speculation_keep_the_greedy_ids(v3, settings):
    path, ref = v3
    prompts = [_tokens(n, 110 + n) for n in (6, 60)]
    with LLM(str(path), num_blocks=64, max_num_batched_tokens=32, **settings) as llm:
        results = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    for prompt, result in zip(prompts, results):
        assert result.error is None and result.token_ids == ref.greedy(prompt, 24)
