"""Compiled regions (backend_lib/neuron/regions.py) against the eager model, sampler and engine.

Each region is compiled with fullgraph=True, dynamic=False and checked against eager on the same inputs: greedy
tokens identical, logits within 1e-4 in fp32; the pool outside the written slots is left untouched; the graph
count is bounded by the buckets and a run after warm-up does not recompile.
"""
from __future__ import annotations

import random

import pytest
import torch

from backend_lib.core.config import CompileConfig, EngineConfig
from backend_lib.core.sampling_params import SamplingParams
from backend_lib.engine.llm_engine import LLMEngine
from backend_lib.engine.offline import LLM
from backend_lib.models.layers import HostGemmPlan
from backend_lib.models.loading.loader import load_model
from backend_lib.tools.tiny import make_tiny
from backend_lib.worker import prompt_logprobs
from backend_lib.neuron.buckets import BucketSpec
from backend_lib.neuron.platform import detect_platform
from backend_lib.worker.compiled_sampler import CompiledSampler, build_regions
from backend_lib.neuron.regions import (CompiledModel, compile_region,
                                                resolve_backend)
from backend_lib.worker.sampler import Sampler, SamplingMetadata, SamplingRow
from backend_lib.worker.spec_decode.rejection import DraftLayout, rejection_sample
from kernels.attention_metadata import AttentionMetadata
from kernels.cpu_kernels import load_cpu_kernels
from kernels.gemv import GemvPolicy

BS = 4
# inductor's codegen (gcc, tens of seconds a graph on 2 busy cores) runs in `make test`, not test-fast.
INDUCTOR = pytest.param("inductor", marks=pytest.mark.slow)


def _paged_decode_inputs(num_blocks: int, lens: list[int], width: int, vocab: int, seed: int):
    """A decode step for len(lens) requests whose contexts (lens[i] tokens) live in disjoint random blocks."""
    gen = torch.Generator().manual_seed(seed)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, slots = [], []
    for i, n in enumerate(lens):
        blocks = perm[i * width:(i + 1) * width][: -(-n // BS)]
        tables.append(blocks)
        slots.append(blocks[(n - 1) // BS] * BS + (n - 1) % BS)
    w = max(len(t) for t in tables)
    table = torch.tensor([t + [num_blocks] * (w - len(t)) for t in tables], dtype=torch.int32)
    meta = AttentionMetadata(BS, torch.tensor(slots), len(lens), 1, table, torch.tensor(lens, dtype=torch.int32),
                             0, [], [], torch.zeros(0, w, dtype=torch.int32))
    ids = torch.randint(0, vocab, (len(lens),), generator=gen)
    return ids, torch.tensor(lens) - 1, meta


def _random_caches(model, num_blocks: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen) for s in model.kv_cache_shapes((num_blocks + 1) * BS)]


@pytest.fixture(scope="module")
def tiny_llama(tiny_llama_dir):
    return load_model(str(tiny_llama_dir), torch.float32).eval()


@pytest.fixture(scope="module")
def tiny_llama_onednn(tiny_llama_dir):
    """The engine's host kernels: every projection and the head on the blocked few-row GEMM (here for 1 row, so
    that the 2- and 4-row buckets take oneDNN's packed GEMM) and decode attention on the C++ kernel, each an opaque
    custom op inside the graphs (kernels/gemv.py, kernels/onednn_gemm.py, kernels/cpu_kernels.py)."""
    model = load_model(str(tiny_llama_dir), torch.float32).eval()
    assert load_cpu_kernels()
    model.pack_for_cpu(HostGemmPlan(policy=GemvPolicy(max_rows=1)))
    model.use_cpu_attention()
    return model


@pytest.fixture(scope="module")
def tiny_deepseek(tmp_path_factory):
    path = make_tiny("deepseek_v3", tmp_path_factory.mktemp("ds"), fp8=True, seed=3)
    model = load_model(str(path), torch.float32, progress=False, weight_format="dequantize").eval()
    model.set_moe_impl("static")
    return model


@pytest.mark.parametrize("backend", ["aot_eager", INDUCTOR])
@pytest.mark.parametrize("arch", ["llama", "llama-onednn", "deepseek"])
def test_decode_graphs_match_eager_at_each_bucket(arch, backend, tiny_llama, tiny_llama_onednn, tiny_deepseek):
    model = {"llama": tiny_llama, "llama-onednn": tiny_llama_onednn, "deepseek": tiny_deepseek}[arch]
    num_blocks = 24
    spec = BucketSpec(batch_sizes=(1, 2, 4), block_table_widths=(2, 4), prefill_lengths=(8,), block_size=BS)
    compiled = CompiledModel(model, spec, backend, scratch_block=num_blocks)
    vocab = model.arch.vocab_size
    steps = [[5], [3, 9], [7, 2, 13]]  # 1 -> bucket 1, 2 -> 2, 3 -> 4 rows; widths 2, 3 -> 4, 4
    if backend == "inductor":  # aot_eager covers the buckets; inductor's codegen once per GEMM path (CI time)
        steps = steps[:2] if arch == "llama-onednn" else steps[1:2]
    with torch.inference_mode():
        for i, lens in enumerate(steps):
            ids, pos, meta = _paged_decode_inputs(num_blocks, lens, 4, vocab, seed=i)
            eager_caches = _random_caches(model, num_blocks, seed=10 + i)
            caches = [c.clone() for c in eager_caches]
            eager = model.compute_logits(model(ids, pos, eager_caches, meta))
            got = compiled.compute_logits(compiled(ids, pos, caches, meta))
            assert compiled.stats.eager_steps == 0
            torch.testing.assert_close(got, eager, atol=1e-4, rtol=0)
            assert torch.equal(got.argmax(-1), eager.argmax(-1))
            # The real slots hold the same K/V; everything else but the scratch block is untouched.
            pool = slice(0, num_blocks * BS)
            for c, e in zip(caches, eager_caches):
                torch.testing.assert_close(c[:, pool], e[:, pool], atol=1e-4, rtol=0)


@pytest.mark.parametrize("arch", ["llama", "llama-onednn", "deepseek"])
def test_layer_scope_shares_one_graph_per_layer_kind_and_matches_eager(arch, tiny_llama, tiny_llama_onednn,
                                                                        tiny_deepseek):
    """compile_scope="layer": one traced graph per bucket and layer kind, run by every layer of that kind (the
    DeepSeek model's dense and MoE layers get one each); logits and the written K/V equal the eager step's.
    llama-onednn: the host kernels on, whose eager steps run the layers from one C++ loop; a padded step must
    still go through the layer graphs."""
    from torch._dynamo.utils import counters
    model = {"llama": tiny_llama, "llama-onednn": tiny_llama_onednn, "deepseek": tiny_deepseek}[arch]
    num_blocks = 24
    spec = BucketSpec(batch_sizes=(2,), block_table_widths=(4,), prefill_lengths=(), block_size=BS)
    compiled = CompiledModel(model, spec, "aot_eager", scratch_block=num_blocks, scope="layer")
    kinds = {tuple(type(m).__name__ for m in layer.modules()) for layer in model.layers}
    assert len(model.layers) > len(kinds)  # some layers must share a graph for the test to mean anything
    with torch.inference_mode():
        before = counters["stats"]["unique_graphs"]
        compiled.warm_up(_random_caches(model, num_blocks, seed=1), progress=False)
        layer_graphs = counters["stats"]["unique_graphs"] - before - 1  # less the lm_head graph
        assert layer_graphs == len(kinds), (layer_graphs, kinds)
        ids, pos, meta = _paged_decode_inputs(num_blocks, [3, 9], 4, model.arch.vocab_size, seed=2)
        eager_caches = _random_caches(model, num_blocks, seed=3)
        caches = [c.clone() for c in eager_caches]
        eager = model.compute_logits(model(ids, pos, eager_caches, meta))
        got = compiled.compute_logits(compiled(ids, pos, caches, meta))
        assert counters["stats"]["unique_graphs"] - before - 1 == len(kinds)  # the step compiled nothing new
    assert compiled.stats.compiled_steps == 1 and compiled.stats.eager_steps == 0
    assert all("forward" not in vars(layer) for layer in model.layers)  # eager steps keep the plain forward
    torch.testing.assert_close(got, eager, atol=1e-4, rtol=0)
    pool = slice(0, num_blocks * BS)
    for c, e in zip(caches, eager_caches):
        torch.testing.assert_close(c[:, pool], e[:, pool], atol=1e-4, rtol=0)


@pytest.mark.parametrize("backend", ["aot_eager", INDUCTOR])
@pytest.mark.parametrize("arch", ["llama", "deepseek"])
def test_prefill_graph_matches_eager(arch, backend, tiny_llama, tiny_deepseek):
    model, num_blocks = (tiny_llama if arch == "llama" else tiny_deepseek), 16
    spec = BucketSpec(batch_sizes=(1,), block_table_widths=(4, 8), prefill_lengths=(8, 16), block_size=BS)
    compiled = CompiledModel(model, spec, backend, scratch_block=num_blocks)
    chunks = ((0, 6), (4, 9))  # buckets 8 and 16 (a continuation chunk: context 13 <= 4 blocks)
    if backend == "inductor":  # aot_eager covers both buckets; inductor's codegen once (CI time)
        chunks = chunks[1:]
    for start, q_len in chunks:
        seq = start + q_len
        blocks = list(range(3, 3 + -(-seq // BS)))
        slots = torch.tensor([blocks[p // BS] * BS + p % BS for p in range(start, seq)])
        meta = AttentionMetadata(BS, slots, 0, 1, torch.zeros(0, len(blocks), dtype=torch.int32),
                                 torch.zeros(0, dtype=torch.int32), 1, [q_len], [seq],
                                 torch.tensor([blocks], dtype=torch.int32))
        ids = torch.randint(0, model.arch.vocab_size, (q_len,), generator=torch.Generator().manual_seed(seq))
        pos = torch.arange(start, seq)
        eager_caches = _random_caches(model, num_blocks, seed=seq)
        caches = [c.clone() for c in eager_caches]
        with torch.inference_mode():
            eager = model.compute_logits(model(ids, pos, eager_caches, meta))
            assert compiled.pad(ids, pos, meta) is not None
            got = compiled.compute_logits(compiled(ids, pos, caches, meta))
        torch.testing.assert_close(got, eager, atol=1e-4, rtol=0)
        assert torch.equal(got.argmax(-1), eager.argmax(-1))
    assert compiled.stats.compiled_steps == len(chunks) and compiled.stats.eager_steps == 0


def _sampling_meta(batch: int, vocab: int, greedy: bool, top_k: int = -1, top_p: float = 1.0) -> SamplingMetadata:
    rows = [SamplingRow(params=SamplingParams(temperature=0.0 if greedy else 0.8, top_k=top_k, top_p=top_p),
                        seed=100 + b, output_position=b * 3, prompt_token_ids=[1], output_token_ids=[])
            for b in range(batch)]
    return SamplingMetadata.build(rows, vocab, "cpu")


@pytest.mark.parametrize("backend", ["aot_eager", INDUCTOR])
def test_sampler_graphs_match_eager(backend):
    vocab = 300
    spec = BucketSpec(batch_sizes=(1, 2, 4, 8), block_table_widths=(1,), prefill_lengths=(), block_size=BS)
    sampler = CompiledSampler(spec, backend, vocab)
    logits = torch.randn(5, vocab, generator=torch.Generator().manual_seed(0)) * 3
    variants = ({"greedy": True}, {"greedy": False}, {"greedy": False, "top_k": 20},
                {"greedy": False, "top_p": 0.7}, {"greedy": False, "top_k": 50, "top_p": 0.9})
    if backend == "inductor":  # aot_eager covers every variant's graph; inductor's codegen for the greedy one and
        variants = variants[::4]  # the one with both filters (each compile is ~70 s of gcc on 2 busy cores)
    for kw in variants:
        meta = _sampling_meta(5, vocab, **kw)
        assert torch.equal(sampler(logits, meta).token_ids, Sampler()(logits, meta).token_ids), kw
    assert sampler.stats.eager_steps == 0 and sampler.stats.compiled_steps == len(variants)


@pytest.mark.parametrize("backend", ["aot_eager", INDUCTOR])
@pytest.mark.parametrize("greedy", [True, False])
def test_verification_region_compiles_and_matches_eager(greedy, backend):
    vocab = 200
    drafts = [[5, 7], [], [9, 9, 1]]
    layout = DraftLayout.build(drafts, "cpu")
    n = sum(len(d) + 1 for d in drafts)
    logits = torch.randn(n, vocab, generator=torch.Generator().manual_seed(1))
    logits[0, 5] = 50.0  # the first draft of request 0 is the argmax: accepted under greedy
    meta = _sampling_meta(n, vocab, greedy=greedy, top_k=40)

    def verify(logits, layout, meta):
        return rejection_sample(logits, layout, meta).token_ids

    got = compile_region(verify, backend)(logits, layout, meta)
    assert torch.equal(got, verify(logits, layout, meta))


def test_graph_count_is_bounded_and_a_200_request_run_does_not_recompile(tiny_llama_dir):
    from torch._dynamo.utils import counters
    config = EngineConfig.from_flat({
        "model": str(tiny_llama_dir), "num_blocks": 96, "block_size": BS, "max_num_seqs": 8,
        "max_model_len": 64, "max_num_batched_tokens": 64, "compile_backend": "aot_eager",
        "batch_buckets": "1,2,4,8", "width_buckets": "4,16", "prefill_buckets": "8,16",
        "compile_sampler_variants": "all", "compile_progress": False})
    engine = LLMEngine(config)  # it hands config.compile to its ModelRunner
    model, sampler = engine.runner.model, engine.runner.sampler
    assert isinstance(model, CompiledModel) and isinstance(sampler, CompiledSampler)
    spec = model.buckets
    assert len(model.stats.compiled_keys) == spec.max_graphs + len(spec.batch_sizes) == 4 * 2 + 2 + 4
    assert len(sampler.stats.compiled_keys) == 4 * 5
    graphs_after_warmup = counters["stats"]["unique_graphs"]
    rng = random.Random(0)
    llm = LLM.__new__(LLM)
    llm.engine = engine
    prompts = [[rng.randrange(3, 1000) for _ in range(rng.randrange(2, 20))] for _ in range(200)]
    params = [SamplingParams(max_tokens=rng.randrange(1, 12), ignore_eos=True,
                             prompt_logprobs=None if i % 7 else 1,  # head slices of the largest bucket (8 rows)
                             **({} if i % 3 else {"temperature": 0.9, "top_p": 0.9, "seed": i}))
              for i in range(200)]
    assert prompt_logprobs.slice_rows(model) == 8
    results = llm.generate(prompts, params)
    assert all(len(r.token_ids) == p.max_tokens for r, p in zip(results, params))
    assert all(len(r.prompt_logprobs.entries) == len(prompt) - 1
               for r, p, prompt in zip(results, params, prompts) if p.prompt_logprobs is not None)
    assert counters["stats"]["unique_graphs"] == graphs_after_warmup
    assert model.stats.compiled_steps > 20 and sampler.stats.compiled_steps > 20
    engine.scheduler.check_integrity()


def test_resolve_backend_honours_enforce_eager_and_config():
    host = detect_platform({}, neuron_importable=False)
    assert resolve_backend(None, host) is None
    assert resolve_backend(CompileConfig(compile_backend="auto"), host) == "inductor"
    assert resolve_backend(CompileConfig(compile_backend="aot_eager"), host) == "aot_eager"
    eager = detect_platform({"DEEPINFER_ENFORCE_EAGER": "1"}, neuron_importable=False)
    assert resolve_backend(CompileConfig(compile_backend="inductor"), eager) is None
    from_env = detect_platform({"DEEPINFER_COMPILE_BACKEND": "aot_eager"}, neuron_importable=False)
    assert resolve_backend(None, from_env) == "aot_eager"


def test_enforce_eager_keeps_the_plain_model(tiny_llama, monkeypatch):
    monkeypatch.setenv("DEEPINFER_ENFORCE_EAGER", "1")
    caches = [torch.zeros(s) for s in tiny_llama.kv_cache_shapes(8 * BS)]
    sampler = Sampler()
    model, got_sampler = build_regions(tiny_llama, sampler, caches, 7, BS, tiny_llama.arch.vocab_size,
                                       detect_platform(), CompileConfig(compile_backend="inductor"))
    assert model is tiny_llama and got_sampler is sampler
