"""kv_cache_dtype=fp8_e4m3 through the engine: the same outputs as the same engine on a dequantized reference cache.

The reference is the ``auto`` engine whose K/V writes go through e4m3 and back (quantize, dequantize, store in the
model dtype): its cache holds exactly the values the fp8 cache's codes mean, so fp8 rounding of K/V is the only
difference from a full-precision run, and any other difference (a code read at the wrong slot, a stale block after
a rollback, a scale applied twice) shows up as different tokens or log-probabilities. Both engines run the same
attention kernels; the reference's writes go through torch (its fused RoPE + KV-write op and one-op decode loop are
switched off), fp8's through its C++ store and one-op loop, whose codes and results equal the module path's
(tests/kernels/test_kv_fp8_store.py), so the outputs are equal to the bit, not within a tolerance.
"""
from __future__ import annotations

import random
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import backend_lib.models.llama.model as llama_module
from backend_lib.core.config import EngineConfig
from backend_lib.core.outputs import SessionControl
from backend_lib.core.sampling_params import SamplingParams
from backend_lib.engine.llm_engine import LLMEngine
from backend_lib.engine.offline import LLM
from backend_lib.frontend.triton.parameters import engine_config_from_parameters
from backend_lib.neuron.platform import detect_platform
from backend_lib.worker.kv_dtype import kv_storage_dtype
from kernels.attention import write_kv
from kernels.kv_fp8 import dequantize_kv, quantize_kv
from tests.helpers.engines import drive, make_engine

# `make test` only (not test-fast): fp8 KV engines against a reference engine (SmolLM2 among them), compiled too.
pytestmark = pytest.mark.slow

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=2)


def _write_through_e4m3(cache, values, slot_mapping, scale=1.0, fp8_max=448.0):
    """The reference cache's store: e4m3 and back, in the cache's own dtype."""
    if cache.dtype.is_floating_point:
        values = dequantize_kv(quantize_kv(values, scale, fp8_max), scale, values.dtype)
    write_kv(cache, values, slot_mapping, scale, fp8_max)


@pytest.fixture()
def reference_writes(monkeypatch):
    monkeypatch.setattr(llama_module, "write_kv", _write_through_e4m3)


def _engine(path, reference: bool, **settings) -> LLMEngine:
    engine = make_engine(path, {"max_model_len": 256, "num_blocks": 256}, settings,
                         kv_cache_dtype="auto" if reference else "fp8_e4m3")
    if reference:  # its writes must reach the patched write_kv: the module path for every write and layer
        model = engine.model
        model._decode_weight_lists = ()
        for layer in model.layers:
            layer.self_attn.host_fused = False
    else:
        assert all(c.dtype.itemsize == 1 for c in engine.runner.kv_caches)
    return engine


def _run(engine: LLMEngine, prompts, params) -> list:
    llm = LLM.__new__(LLM)
    llm.engine = engine
    return llm.generate(prompts, params)


def _same(a, b) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.error is None and y.error is None
        assert x.token_ids == y.token_ids
        assert [lp.logprob for lp in x.logprobs] == [lp.logprob for lp in y.logprobs]
        assert [lp.top for lp in x.logprobs] == [lp.top for lp in y.logprobs]


PROMPTS = ["The capital of France is", "Once upon a time there was a", "1, 2, 3, 4, 5,",
           " ".join(f"w{i}" for i in range(70))]


@pytest.mark.parametrize("settings", [
    {"host_attention": "cpp"},
    {"host_attention": "torch"},
    {"max_num_batched_tokens": 16},  # chunked prefill: every prompt in several chunks
    {"dtype": "bfloat16"},
])
def test_fp8_equals_the_dequantized_reference_cache(tiny_llama_dir, reference_writes, settings):
    _same(_run(_engine(tiny_llama_dir, False, **settings), PROMPTS, GREEDY),
          _run(_engine(tiny_llama_dir, True, **settings), PROMPTS, GREEDY))


def test_fp8_prefix_cache_hits_and_preemption(tiny_llama_dir, reference_writes):
    shared = " ".join(f"word{i}" for i in range(40))
    prompts = [shared + f" ending {i}" for i in range(6)]
    fp8, ref = _engine(tiny_llama_dir, False), _engine(tiny_llama_dir, True)
    _same(_run(fp8, prompts[:1], GREEDY), _run(ref, prompts[:1], GREEDY))  # fills the prefix cache
    _same(_run(fp8, prompts, GREEDY), _run(ref, prompts, GREEDY))  # shared fp8 blocks read by later requests
    assert fp8.stats().prefix_cache_hits > 0
    rng = random.Random(1)
    distinct = [[rng.randrange(300) for _ in range(rng.randint(20, 40))] for _ in range(12)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=2)
    tight = {"num_blocks": 10, "max_num_seqs": 8, "max_num_batched_tokens": 32}  # 8 requests need ~24 blocks
    fp8, ref = _engine(tiny_llama_dir, False, **tight), _engine(tiny_llama_dir, True, **tight)
    _same(_run(fp8, distinct, params), _run(ref, distinct, params))
    stats = fp8.stats()
    assert stats.num_preemptions > 0 and stats.kv_blocks_used == 0
    fp8.scheduler.check_integrity()


def test_fp8_sessions_keep_their_codes_between_turns(tiny_llama_dir, reference_writes):
    outputs = []
    for reference in (False, True):
        engine = _engine(tiny_llama_dir, reference)
        turns = []
        for i, (text, flags) in enumerate([("Hello there,", (True, False)), (" and then", (False, False)),
                                           (" finally", (False, True))]):
            engine.add_request(f"t{i}", text, GREEDY, SessionControl("s", start=flags[0], end=flags[1]))
            turns += [(o.request_id, o.new_token_ids, [lp.logprob for lp in o.new_logprobs or []])
                      for o in drive(engine)[f"t{i}"]]
        outputs.append(turns)
    assert outputs[0] == outputs[1] and len(outputs[0]) > 3


def test_fp8_ngram_speculation_rolls_back_rejected_records(smollm2_path, reference_writes):
    """SmolLM2 copying a text: n-gram drafts are accepted for runs and rejected where the copy departs, so rejected
    drafts' codes are written and then rolled back (overwritten by the accepted tokens' K/V)."""
    text = ("The lighthouse keeper climbed the spiral stairs every evening at dusk, lit the great lamp, and wrote "
            "the names of passing ships in a worn leather book.")
    prompts = [[{"role": "user", "content": f"Repeat the following text exactly.\n\n{text}"}],
               "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n"]
    params = SamplingParams(max_tokens=40, temperature=0.0, logprobs=2)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "max_model_len": 512}
    fp8 = _engine(smollm2_path, False, **spec)
    got = _run(fp8, prompts, params)
    _same(got, _run(_engine(smollm2_path, True, **spec), prompts, params))
    stats = fp8.stats()
    assert stats.spec_draft_tokens > stats.spec_accepted_tokens > 10  # accepted runs, and rejected drafts
    plain = _run(_engine(smollm2_path, False, max_model_len=512), prompts, params)
    assert [r.token_ids for r in got] == [r.token_ids for r in plain]  # speculation changes nothing


def test_fp8_two_ranks_match_one(tiny_llama_dir):
    one = _run(_engine(tiny_llama_dir, False), PROMPTS, GREEDY)
    with LLM(str(tiny_llama_dir), max_model_len=256, num_blocks=256, kv_cache_dtype="fp8",
             tensor_parallel_size=2) as llm:
        two = llm.generate(PROMPTS, GREEDY)
    for a, b in zip(one, two):
        assert a.token_ids == b.token_ids
        assert max(abs(x.logprob - y.logprob) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4


def test_fp8_pool_holds_twice_bf16_and_four_times_fp32_in_the_same_memory(tiny_llama_dir):
    blocks = {}
    budget_gb = 2.0**-7  # 8 MiB: a whole number of blocks at every element size
    for dtype, kv in (("float32", "auto"), ("bfloat16", "auto"), ("bfloat16", "fp8_e4m3"), ("float32", "fp8")):
        engine = LLMEngine(EngineConfig.from_flat({"model": str(tiny_llama_dir), "max_model_len": 256,
                                                   "dtype": dtype, "kv_cache_dtype": kv,
                                                   "kv_cache_memory_gb": budget_gb}))
        blocks[dtype, kv] = engine.num_blocks
        pool = sum(c.numel() * c.element_size() for c in engine.runner.kv_caches)  # + the scratch block
        assert pool * engine.num_blocks // (engine.num_blocks + 1) == budget_gb * 2**30
    assert blocks["bfloat16", "fp8_e4m3"] == blocks["float32", "fp8"] == 2 * blocks["bfloat16", "auto"] \
        == 4 * blocks["float32", "auto"]


def test_models_without_fp8_kv_refuse_it_naming_the_setting():
    host = detect_platform({}, neuron_importable=False)
    config = EngineConfig.from_flat({"kv_cache_dtype": "fp8"})
    with pytest.raises(ValueError, match=r"kv_cache_dtype='fp8_e4m3' is not supported for Linear yet"):
        kv_storage_dtype(config, torch.nn.Linear(2, 2), torch.float32, host)  # a model class without use_fp8_kv
    assert kv_storage_dtype(EngineConfig(), torch.nn.Linear(2, 2), torch.bfloat16, host) == torch.bfloat16  # auto
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        EngineConfig.from_flat({"kv_cache_dtype": "int8"})
    assert EngineConfig.from_flat({"kv_cache_dtype": "fp8"}).cache.kv_cache_dtype == "fp8_e4m3"
    config = engine_config_from_parameters({"kv_cache_dtype": "fp8", "dtype": "bfloat16"})  # config.pbtxt's way
    assert config.cache.kv_cache_dtype == "fp8_e4m3" and config.kv_dtype_name == "fp8_e4m3"
    assert engine_config_from_parameters({"kv_cache_dtype": ""}).kv_dtype_name == "float32"  # auto: the model's
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        engine_config_from_parameters({"kv_cache_dtype": "e5m2"})


@pytest.mark.parametrize("attention", ["cpp", "torch"])
def test_fp8_compiled_regions_equal_eager(tiny_llama_dir, attention):
    """Decode graphs (aot_eager) store and read the codes as the eager steps do: the C++ fp8 op inside the graph,
    or the fused gather + dequantize form."""
    settings = {"host_attention": attention, "max_num_seqs": 4}
    eager = _run(_engine(tiny_llama_dir, False, **settings), PROMPTS, GREEDY)
    graphs = _run(_engine(tiny_llama_dir, False, compile_backend="aot_eager", batch_buckets="1,2,4",
                          width_buckets="8,16", compile_progress=False, **settings), PROMPTS, GREEDY)
    for a, b in zip(eager, graphs):
        assert a.token_ids == b.token_ids
        assert max(abs(x.logprob - y.logprob) for x, y in zip(a.logprobs, b.logprobs)) < 1e-5


def test_checkpoint_kv_scales_are_used_and_logged(tiny_llama_dir, tmp_path, caplog):
    """llm-compressor's per-tensor scales (self_attn.k_scale / v_scale) set the layer's KVQuant; without them 1.0."""
    directory = tmp_path / "scaled"
    shutil.copytree(tiny_llama_dir, directory)
    weights = load_file(directory / "model.safetensors")
    weights["model.layers.1.self_attn.k_scale"] = torch.tensor(0.5)
    weights["model.layers.1.self_attn.v_scale"] = torch.tensor([0.25])
    save_file(weights, directory / "model.safetensors", metadata={"format": "pt"})
    with caplog.at_level("INFO"):
        engine = _engine(directory, False)
    quants = [layer.self_attn.kv_quant for layer in engine.model.layers]
    assert [(q.k_scale, q.v_scale, q.fp8_max) for q in quants] == [(1.0, 1.0, 448.0), (0.5, 0.25, 448.0)]
    assert "k_scale / v_scale from the checkpoint (1 of 2 layers; 1.0 elsewhere)" in caplog.text
    assert "KV cache of fp8_e4m3:" in caplog.text
    assert _run(engine, PROMPTS[:1], GREEDY)[0].error is None
    with caplog.at_level("INFO"):
        _engine(tiny_llama_dir, False)
    assert "k_scale = v_scale = 1.0 (the checkpoint has none)" in caplog.text
    plain = _engine(directory, True)  # auto: the scales are read and ignored
    assert all(layer.self_attn.kv_quant is None for layer in plain.model.layers)
