"""DeepSeek-V4 against transformers 5.24 (fp32) on tiny random configs: the release layout make-tiny writes, logits
of mixed batches over the hybrid cache (sliding-window and compressor rings in fixed state slots, paged compressed
entries; CSA with its indexer, HCA, mHC), and greedy ids through the engine (chunked prefill in odd sizes, batches of
other lengths, preemption, session turns); prefix caching is off for V4, and nothing leaks."""
from __future__ import annotations

import json

import pytest
import torch

from backend_lib.core.errors import RequestError
from backend_lib.engine.llm_engine import LLMEngine
from backend_lib.models.loading.loader import load_model
from backend_lib.core.outputs import SessionControl
from backend_lib.core.sampling_params import SamplingParams
from backend_lib.tools.tiny import make_tiny
from tests.helpers.paged_runner import HybridPagedRunner
from tests.helpers.engines import drive, make_engine, new_tokens

# `make test` only (not test-fast): the tiny V4 against transformers per config, through the model and the engine.
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]

NEW_TOKENS = 24
CONFIGS = {
    # make-tiny's defaults: window 8, CSA rate 4 (top-3 of the indexer), HCA rate 8, sqrtsoftplus routing
    "default": {},
    # rates that divide neither the block size nor each other, 4 output groups, sigmoid scores, top-2 indexer,
    # YaRN on the compress rotary
    "odd_rates": dict(compress_rates={"compressed_sparse_attention": 3, "heavily_compressed_attention": 5},
                      rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                                       "beta_fast": 32, "beta_slow": 1},
                      sliding_window=6, index_topk=2, o_groups=4, scoring_func="sigmoid",
                      layer_types=["heavily_compressed_attention", "compressed_sparse_attention",
                                   "sliding_attention", "compressed_sparse_attention"],
                      mlp_layer_types=["hash_moe", "moe", "hash_moe", "moe"]),
}


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(3, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def tiny(request, tmp_path_factory):
    """(directory, ours, transformers) for one config."""
    from transformers import AutoModelForCausalLM
    path = make_tiny("deepseek_v4", tmp_path_factory.mktemp(request.param), seed=5, overrides=CONFIGS[request.param])
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    return path, load_model(str(path), torch.float32, progress=False), hf


def _hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf(torch.tensor([ids])).logits[0]


def _hf_generate(hf, prompt: list[int], new_tokens: int = NEW_TOKENS) -> list[int]:
    with torch.inference_mode():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                          do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_make_tiny_writes_the_release_layout_that_both_load(tmp_path):
    from transformers import AutoModelForCausalLM
    from backend_lib.tools.tiny import main
    assert main(["--arch", "deepseek_v4", "--out", str(tmp_path)]) == 0
    names = set(json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"])
    for name in ("model.layers.1.attn.compressor.wkv.weight", "model.layers.1.attn.indexer.wq_b.weight",
                 "model.layers.2.attn.compressor.ape", "model.layers.0.ffn.gate.tid2eid",
                 "model.layers.3.ffn.gate.bias", "model.layers.0.ffn.experts.7.w3.weight",
                 "model.layers.0.hc_attn_fn", "model.hc_head.hc_fn", "head.weight"):
        assert name in names, name
    config = json.loads((tmp_path / "config.json").read_text())
    assert set(config["layer_types"]) == {"sliding_attention", "compressed_sparse_attention",
                                          "heavily_compressed_attention"}
    assert set(config["mlp_layer_types"]) == {"hash_moe", "moe"} and config["hc_mult"] == 4
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    ours = load_model(str(tmp_path), torch.float32, progress=False)
    assert type(ours).__name__ == "DeepseekV4ForCausalLM"
    ids = _tokens(40, 0)
    assert (HybridPagedRunner(ours).step([], [("r", ids)]) - _hf_logits(hf, ids)).abs().max() <= 1e-4


def test_mixed_batch_logits_match_transformers(tiny):
    """Decodes (Q = 1 and Q = 2) next to prefill chunks that continue their cached prefix, across many windows."""
    _, ours, hf = tiny
    run = HybridPagedRunner(ours)
    seqs = {"a": _tokens(40, 1), "b": _tokens(23, 2), "c": _tokens(5, 3)}
    extra = {r: _tokens(12, 10 + i) for i, r in enumerate(seqs)}
    logits: dict[str, list[torch.Tensor]] = {r: [] for r in seqs}

    def record(out: torch.Tensor, parts: list[tuple[str, int]]) -> None:
        start = 0
        for rid, n in parts:
            logits[rid].append(out[start:start + n])
            start += n

    record(run.step([], [("a", seqs["a"][:13]), ("b", seqs["b"][:7]), ("c", seqs["c"])]),
           [("a", 13), ("b", 7), ("c", 5)])
    record(run.step([("c", extra["c"][:1])], [("a", seqs["a"][13:30]), ("b", seqs["b"][7:])]),
           [("c", 1), ("a", 17), ("b", 16)])
    record(run.step([("b", extra["b"][:1]), ("c", extra["c"][1:2])], [("a", seqs["a"][30:])]),
           [("b", 1), ("c", 1), ("a", 10)])
    full = {"a": seqs["a"], "b": seqs["b"] + extra["b"][:1], "c": seqs["c"] + extra["c"][:2]}
    used = {"a": 0, "b": 1, "c": 2}
    for _ in range(4):  # Q = 2 (as with drafts), then Q = 1
        for q in (2, 1):
            step = [(r, extra[r][used[r]:used[r] + q]) for r in "abc"]
            record(run.step(step, []), [(r, q) for r in "abc"])
            for r, toks in step:
                full[r] += toks
                used[r] += q
    for rid, parts in logits.items():
        ours_logits = torch.cat(parts)
        ref = _hf_logits(hf, full[rid])
        assert ours_logits.shape == ref.shape
        assert (ours_logits - ref).abs().max() <= 1e-4, rid


class _LazyTensor:
    """All a lazy checkpoint tensor offers the model: ``shape``, ``dtype`` and ``narrow`` (which reads)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self._tensor, self.shape, self.dtype = tensor, tensor.shape, tensor.dtype

    def narrow(self, dim: int, start: int, size: int) -> torch.Tensor:
        return self._tensor.narrow(dim, start, size).clone()


def _load_lazily(path):
    from backend_lib.models.deepseek_v4.model import DeepseekV4ForCausalLM
    from backend_lib.models.loading.loader import iter_safetensors, safetensors_files
    model = DeepseekV4ForCausalLM.from_hf_config(json.loads((path / "config.json").read_text()), torch.float32)
    model.load_weights((n, _LazyTensor(t)) for n, t in iter_safetensors(safetensors_files(str(path)), False))
    return model.eval()


ENGINE = {"max_model_len": 256, "block_size": 4, "max_num_seqs": 4}


def test_engine_greedy_matches_transformers_chunked_batched_preempted_and_in_sessions(tiny):
    """Prompts shorter than the window and across many compressor windows, prefilled in chunks of 7 tokens next to
    each other, in a pool small enough to preempt; then a two-turn session that prefills only its new tokens."""
    path, _, hf = tiny
    engine = make_engine(path, ENGINE, max_num_batched_tokens=7, num_blocks=24)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    prompts = {f"r{n}": _tokens(n, 40 + n) for n in (3, 40, 13, 23)}  # 3: before the first CSA window closes
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, params)
    got = new_tokens(drive(engine))
    assert got == {rid: _hf_generate(hf, prompt) for rid, prompt in prompts.items()}
    stats = engine.stats()
    assert stats.num_preemptions > 0

    first, second = _tokens(11, 50), _tokens(6, 51)
    engine.add_request("t1", first, params, session=SessionControl("s", start=True))
    turn1 = new_tokens(drive(engine))["t1"]
    computed = engine.stats().num_computed_prompt_tokens
    engine.add_request("t2", second, params, session=SessionControl("s", end=True))
    turn2 = new_tokens(drive(engine))["t2"]
    assert turn1 == _hf_generate(hf, first)
    assert turn2 == _hf_generate(hf, first + turn1 + second)
    assert engine.stats().num_computed_prompt_tokens - computed <= len(second) + 1

    engine.add_request("aborted", _tokens(30, 52), params)  # aborted mid-prefill: every block and slot comes back
    engine.step()
    assert engine.abort("aborted").finish_reason == "abort"
    kv = engine.scheduler.kv_cache
    assert engine.stats().kv_blocks_used == 0 and kv.num_free_state_slots == kv.num_state_slots
    engine.scheduler.check_integrity()


@pytest.mark.parametrize("fp4_experts", [True, False])
def test_fp8_attention_and_fp4_experts_match_transformers_over_the_dequantized_weights(fp4_experts, tmp_path):
    """Attention and shared-expert projections fp8 e4m3 (128x128 ue8m0 blocks, kept fp8 and dequantized inside the
    linear, or at load); routed experts fp4 e2m1 (ue8m0 per 32 inputs; kept packed, or dequantized at load) or fp8
    (dequantized at load). transformers dequantizes everything on the host."""
    from transformers import AutoModelForCausalLM
    path = make_tiny("deepseek_v4", tmp_path, seed=9, fp8=True, fp4_experts=fp4_experts)
    config = json.loads((path / "config.json").read_text())["quantization_config"]
    assert config["expert_dtype"] == ("fp4" if fp4_experts else "fp8") and config["scale_fmt"] == "ue8m0"
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    kept = _load_lazily(path)
    assert kept.layers[1].attn.wq_b.weight.dtype == torch.float8_e4m3fn
    assert kept.layers[1].ffn.shared_experts.w2.weight_scale_inv is not None
    assert kept.layers[2].ffn.gate_up.dtype == (torch.int8 if fp4_experts else torch.float32)
    ids = _tokens(33, 90)
    assert (HybridPagedRunner(kept).step([], [("r", ids)]) - _hf_logits(hf, ids)).abs().max() <= 1e-4
    kept.set_moe_impl("static")
    assert (HybridPagedRunner(kept).step([], [("r", ids)]) - _hf_logits(hf, ids)).abs().max() <= 1e-4
    kept.set_moe_impl("dynamic")
    if fp4_experts:
        engine = make_engine(path, ENGINE, max_num_batched_tokens=9, num_blocks=48, weight_format="dequantize")
        params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
        prompts = {f"r{n}": _tokens(n, 91 + n) for n in (7, 26)}
        for rid, prompt in prompts.items():
            engine.add_request(rid, prompt, params)
        assert new_tokens(drive(engine)) == {rid: _hf_generate(hf, prompt) for rid, prompt in prompts.items()}
    dequantized = load_model(str(path), torch.float32, progress=False, dequantize_fp8_at_load=True)
    assert dequantized.layers[1].attn.wq_b.weight.dtype == dequantized.layers[2].ffn.gate_up.dtype == torch.float32
    assert (HybridPagedRunner(dequantized).step([], [("r", ids)]) - _hf_logits(hf, ids)).abs().max() <= 1e-4


def test_prefix_caching_is_off_with_a_log_line_and_results_stay_exact(tiny, caplog):
    """The rings hold state only at the position their request reached, so a shared prefix is recomputed (never
    read from another request's blocks): the log says so and both requests give transformers' ids."""
    from backend_lib.engine.offline import LLM
    path, _, hf = tiny
    with caplog.at_level("INFO", logger="deepinfer.engine"):
        llm = LLM(str(path), max_model_len=256, block_size=4, num_blocks=64, max_num_batched_tokens=64)
    assert any("prefix caching is off" in r.getMessage() for r in caplog.records)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prefix = _tokens(26, 120)
    first = llm.generate([prefix + _tokens(5, 121)], params)[0]
    second = llm.generate([prefix + _tokens(7, 122)], params)[0]
    assert second.num_cached_tokens == 0
    assert first.token_ids == _hf_generate(hf, prefix + _tokens(5, 121), 12)
    assert second.token_ids == _hf_generate(hf, prefix + _tokens(7, 122), 12)


def test_memory_grows_by_compressed_entries_only_and_sessions_hold_slots(tmp_path):
    """The engine's allocator: a block of 8 positions (both tiny rates, 4 and 8, divide it) holds n_csa * (D + Di) / 4
    + n_hca * D / 8 values per position; a state slot holds the rings, whatever the context length. Slots are
    max_num_seqs + max_sessions: a session past max_sessions gets the busy error, and END frees its slot."""
    from backend_lib.worker.kv_sizing import kv_bytes_per_block, state_bytes_per_slot
    path = make_tiny("deepseek_v4", tmp_path, seed=3)
    engine = make_engine(path, ENGINE, num_blocks=16, block_size=8, max_sessions=2)
    a = engine.model.args
    d, di, w, n_csa, n_hca, layers = a.head_dim, a.index_head_dim, a.sliding_window, a.count("compressed_sparse_attention"), \
        a.count("heavily_compressed_attention"), a.num_hidden_layers
    assert (a.rate("compressed_sparse_attention"), a.rate("heavily_compressed_attention")) == (4, 8)
    per_position = n_csa * (d + di) / 4 + n_hca * d / 8
    assert kv_bytes_per_block(engine.model, 8, torch.float32) == per_position * 8 * 4
    per_slot = layers * w * d + n_csa * 2 * 4 * (4 * d + 4 * di) + n_hca * 8 * 2 * d
    assert state_bytes_per_slot(engine.model, 8, torch.float32) == per_slot * 4
    allocated = sum(t.numel() for t in engine.runner.kv_caches)
    slots = engine.scheduler.kv_cache.num_state_slots
    assert slots == 4 + 2  # max_num_seqs + max_sessions
    assert allocated == (16 + 1) * per_position * 8 + (slots + 1) * per_slot  # + the scratch block and slot

    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    for sid in ("s0", "s1"):  # each open session keeps a slot between turns; a third one is refused, not queued
        engine.add_request(sid, _tokens(9, 7), params, session=SessionControl(sid, start=True))
    with pytest.raises(RequestError, match="max_sessions 2") as info:
        engine.add_request("s2", _tokens(9, 7), params, session=SessionControl("s2", start=True))
    assert info.value.busy and info.value.limit == "max_sessions"
    drive(engine)
    assert engine.scheduler.kv_cache.num_free_state_slots == slots - 2
    for sid in ("s0", "s1"):
        engine.add_request(f"{sid}-end", _tokens(2, 8), params, session=SessionControl(sid, end=True))
    drive(engine)
    assert engine.scheduler.kv_cache.num_free_state_slots == slots and engine.stats().kv_blocks_used == 0


def test_static_moe_gives_the_same_logits(tiny):
    _, ours, hf = tiny
    ids = _tokens(21, 60)
    ours.set_moe_impl("static")
    try:
        out = HybridPagedRunner(ours).step([], [("r", ids)])
    finally:
        ours.set_moe_impl("dynamic")
    assert (out - _hf_logits(hf, ids)).abs().max() <= 1e-4


def test_yarn_compress_rope_matches_transformers():
    from transformers import DeepseekV4Config
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RotaryEmbedding
    from backend_lib.models.deepseek_v4.model import DeepseekV4ForCausalLM
    from backend_lib.models.deepseek_v4.args import DeepseekV4Args
    yarn = {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 64, "beta_fast": 32,
            "beta_slow": 1}
    kw = dict(vocab_size=64, hidden_size=32, moe_intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
              head_dim=32, q_lora_rank=16, n_routed_experts=4, num_experts_per_tok=2, o_groups=2, o_lora_rank=8,
              index_n_heads=2, index_head_dim=16, max_position_embeddings=1024, rope_parameters=yarn)
    hf_config = DeepseekV4Config(**kw)
    rotary = DeepseekV4RotaryEmbedding(hf_config)
    args = DeepseekV4Args.from_hf_config(json.loads(hf_config.to_json_string()))
    ours = DeepseekV4ForCausalLM(args)
    assert args.compress_rope_scaling is not None and args.rope_head_dim == 4
    for kind, rope in (("main", ours.main_rope), ("compress", ours.compress_rope)):
        assert torch.equal(rope.inv_freq, getattr(rotary, f"{kind}_inv_freq")), kind
        assert rope.attention_scaling == getattr(rotary, f"{kind}_attention_scaling"), kind


def test_mtp_without_mtp_weights_is_refused_with_a_clear_error(tmp_path):
    """A V4 checkpoint without its nextn depths (make-tiny's default; transformers' save drops mtp.*, even where
    the config keeps num_nextn_predict_layers = 1) loads, and spec_method mtp fails at engine build naming the
    field, not drafting garbage."""
    path = make_tiny("deepseek_v4", tmp_path, seed=10)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    with pytest.raises(ValueError, match="num_nextn_predict_layers"):
        make_engine(path, ENGINE, num_blocks=16, method="mtp", num_speculative_tokens=1)


def test_config_errors_name_the_field():
    from backend_lib.models.deepseek_v4.args import DeepseekV4Args
    base = dict(num_hidden_layers=2, layer_types=["sliding_attention"] * 2, mlp_layer_types=["moe"] * 2)
    with pytest.raises(ValueError, match="layer_types"):
        DeepseekV4Args.from_hf_config({**base, "layer_types": ["sliding_attention", "full_attention"]})
    with pytest.raises(ValueError, match="num_key_value_heads"):
        DeepseekV4Args.from_hf_config({**base, "num_key_value_heads": 2})
    with pytest.raises(ValueError, match="scoring_func"):
        DeepseekV4Args.from_hf_config({**base, "scoring_func": "relu"})
    with pytest.raises(ValueError, match="quant_method"):
        DeepseekV4Args.from_hf_config({**base, "quantization_config": {"quant_method": "awq"}})
    with pytest.raises(ValueError, match="expert_dtype"):
        DeepseekV4Args.from_hf_config({**base, "quantization_config": {"quant_method": "fp8", "expert_dtype": "fp6"}})


@pytest.mark.parametrize("backend", [
    "aot_eager",
    "aot_eager-layer",  # compile_scope="layer": one graph per layer type, shared by the layers of that type
    # inductor's cold compile of the decode, lm_head and sampler graphs runs gcc: ~90-110 s of CPU (150-270 s wall on the
    # loaded 2-core machine), so it is a slow test
    pytest.param("inductor", marks=pytest.mark.slow),
])
def test_compiled_decode_regions_give_the_same_greedy_ids(backend, tmp_path):
    """Decode graphs (static MoE, fullgraph) over the hybrid cache (rings and paged entries as graph inputs updated
    in place) give the eager engine's and transformers' greedy ids; inductor is what a host deployment runs."""
    from transformers import AutoModelForCausalLM
    from backend_lib.neuron.regions import CompiledModel
    layer_types = ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"]
    if backend == "inductor":  # inductor's compile time grows with the graph; a CSA layer runs a sliding branch too
        layer_types = layer_types[1:]
    small = dict(num_hidden_layers=len(layer_types), hc_sinkhorn_iters=4, layer_types=layer_types,
                 mlp_layer_types=["hash_moe", "moe", "moe"][:len(layer_types)])
    path = make_tiny("deepseek_v4", tmp_path / "model", seed=6, overrides=small)  # one layer per type: a small graph
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = {f"r{n}": _tokens(n, 70 + n) for n in (6, 31)}  # 31: decode crosses the window and CSA windows

    def run(**settings) -> tuple[dict[str, list[int]], LLMEngine]:
        engine = make_engine(path, ENGINE, num_blocks=48, max_num_batched_tokens=16, **settings)
        for rid, prompt in prompts.items():
            engine.add_request(rid, prompt, params)
        return new_tokens(drive(engine)), engine

    backend, _, scope = backend.partition("-")
    compiled, engine = run(compile_backend=backend, batch_buckets="2", width_buckets="16", compile_progress=False,
                           compile_cache_dir=str(tmp_path / "compile-cache"),  # cold: no other run's graphs
                           compile_scope=scope or "model")
    eager, _ = run()
    assert compiled == eager == {rid: _hf_generate(hf, prompt, 12) for rid, prompt in prompts.items()}
    model = engine.runner.model
    assert isinstance(model, CompiledModel) and model.stats.compiled_steps > 5, model.stats


def _tp_rank(rank: int, world: int, path: str, init: str, expert_parallel: bool, out: str) -> None:
    """One tensor-parallel rank: its shard of the checkpoint, the mixed-batch steps, logits saved by rank 0."""
    import torch.distributed as dist
    from backend_lib.models.deepseek_v4.model import DeepseekV4ForCausalLM
    from backend_lib.models.loading.loader import iter_safetensors, safetensors_files
    from backend_lib.models.parallel import ParallelContext
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        par = ParallelContext(rank, world, expert_parallel, dist.group.WORLD)
        config = json.loads(open(f"{path}/config.json").read())
        model = DeepseekV4ForCausalLM.from_hf_config(config, torch.float32, par=par)
        tensors = iter_safetensors(safetensors_files(path), progress=False)
        model.load_weights((name, _LazyTensor(t)) for name, t in tensors)  # each rank narrows out its shard
        attn, moe = model.layers[1].attn, model.layers[1].ffn
        assert (attn.num_heads, attn.o_groups, model.head.weight.shape[0]) == (2, 1, 160)
        assert (moe.num_local_experts, moe.inter_size) == ((4, 32) if expert_parallel else (8, 16))
        logits = _tp_workload(model)
        if rank == 0:
            torch.save(logits, out)
    finally:
        dist.destroy_process_group()


def _tp_workload(model) -> torch.Tensor:
    run = HybridPagedRunner(model)
    parts = [run.step([], [("a", _tokens(19, 80)), ("b", _tokens(7, 81))])]
    for i in range(6):
        parts.append(run.step([("a", _tokens(1, 90 + i)), ("b", _tokens(1, 100 + i))], []))
    return torch.cat(parts)


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_tensor_parallel_two_ranks_match_one(expert_parallel, tmp_path):
    """Heads, output groups, expert intermediates (or whole experts) and the vocabulary split over two gloo ranks
    give one rank's logits."""
    import torch.multiprocessing as mp
    path = make_tiny("deepseek_v4", tmp_path / "model", seed=8)
    single = _tp_workload(load_model(str(path), torch.float32, progress=False))
    out = tmp_path / "rank0.pt"
    mp.spawn(_tp_rank, args=(2, str(path), f"file://{tmp_path}/rendezvous", expert_parallel, str(out)), nprocs=2)
    assert (torch.load(out) - single).abs().max() <= 1e-4


def test_ngram_drafts_are_lossless(tiny):
    """Draft verification runs decode rows with 1 + k queries (and padded rows) over the V4 cache: greedy ids equal
    the plain engine's."""
    path, _, _ = tiny
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    repeating = _tokens(6, 110) * 4  # n-gram drafts find matches in a repeating prompt

    def run(**settings) -> tuple[dict[str, list[int]], LLMEngine]:
        engine = make_engine(path, ENGINE, max_num_batched_tokens=16, num_blocks=64, **settings)
        for rid, prompt in {"rep": repeating, "rand": _tokens(17, 111)}.items():
            engine.add_request(rid, prompt, params)
        return new_tokens(drive(engine)), engine

    plain, _ = run()
    spec, engine = run(method="ngram", num_speculative_tokens=3)
    assert spec == plain and engine.stats().spec_draft_tokens > 0
