"""``weight_format=packed`` in the models: the setting's validation, the GGUF loader's blocks, the bundled SmolLM2
Q4_1 holding the file's bytes (documented repack) at ~0.6 bytes a projection weight, and its outputs against
``weight_format=dequantize`` (kernels/packed_gemm.py's int8 path: within its documented bound per logit)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from backend_lib.core.config import EngineConfig, ModelConfig
from backend_lib.core.sampling_params import SamplingParams
from backend_lib.engine.offline import LLM
from backend_lib.frontend.triton.parameters import engine_config_from_parameters
from backend_lib.models.deepseek_v3.moe import RoutedExperts
from backend_lib.models.loading.gguf_file import GGUFFile
from backend_lib.models.loading.gguf_loader import unpermute_rows
from backend_lib.models.interfaces import keeps_hybrid_state
from backend_lib.models.layers import resident_weight_bytes
from backend_lib.models.loading.loader import load_model
from backend_lib.models.parallel import ParallelContext
from backend_lib.models.loading.quantized_blocks import GGUFBlocks
from backend_lib.neuron.graph_lint import lint_region
from backend_lib.tools.tiny import make_tiny
from backend_lib.neuron.buckets import BucketSpec
from backend_lib.neuron.regions import CompiledModel, layer_views
from backend_lib.neuron.static_moe import moe_static
from kernels.moe import moe_dynamic, moe_dynamic_packed
from kernels.packed_embedding import packed_embedding
from kernels.packed_gemm import int8_error_bound
from kernels.packed_weights import GGUF_LAYOUTS, pack_gguf
from kernels.quant import dequantize_block_fp8, quantize_block_fp8

# `make test` only (not test-fast): packs and runs SmolLM2 / the tiny V3 in every weight format, some on two ranks.
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2_pair(smollm2_path):
    """(packed, dequantized) SmolLM2 models, fp32."""
    return (load_model(smollm2_path, progress=False, weight_format="packed"),
            load_model(smollm2_path, progress=False, weight_format="dequantize"))


def test_setting_is_validated_and_refused_where_it_cannot_run():
    assert ModelConfig().weight_format == "auto"  # resolved at load: tests/models/test_weight_format_auto.py
    assert ModelConfig(weight_format="packed").weight_format == "packed"
    with pytest.raises(ValueError, match="weight_format must be one of"):
        ModelConfig(weight_format="int4")
    with pytest.raises(ValueError, match="weight_format=packed runs on the host only"):
        ModelConfig(weight_format="packed", device="neuron")
    with pytest.raises(ValueError, match="weight_format=packed takes float32 or bfloat16"):
        ModelConfig(weight_format="packed", dtype="float16")
    with pytest.raises(ValueError, match="weight_format=packed cannot run with compile_backend=neuron"):
        EngineConfig.from_flat({"weight_format": "packed", "compile_backend": "neuron"})
    with pytest.raises(ValueError, match="packed_gemm_path must be"):
        ModelConfig(weight_format="packed", packed_gemm_path="fp16")
    model = engine_config_from_parameters({"weight_format": "packed", "packed_gemm_path": "fp32"}).model
    assert (model.weight_format, model.packed_gemm_path) == ("packed", "fp32")


def test_hugging_face_directory_is_refused_naming_the_setting(tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    with pytest.raises(ValueError, match="weight_format=packed: .* Hugging Face directory"):
        load_model(str(tmp_path), progress=False, weight_format="packed")


def test_column_split_off_the_blocks_is_refused_naming_it():
    rows = torch.zeros(4, 3 * 20, dtype=torch.uint8)  # Q4_1: 3 blocks of 32 inputs a row
    blocks = GGUFBlocks("blk.0.ffn_down.weight", "q4_1", rows, 96)
    assert blocks.narrow(1, 32, 64).shape == (4, 64) and blocks.narrow(1, 32, 64).rows.shape == (4, 40)
    assert blocks.narrow(0, 1, 2).shape == (2, 96)
    with pytest.raises(ValueError, match="weight_format=packed: the tensor-parallel split of 'blk.0.ffn_down.weight'"):
        blocks.narrow(1, 0, 48)


@pytest.mark.parametrize("qtype", sorted(GGUF_LAYOUTS))
def test_packed_embedding_rows_equal_the_dequantized_rows(qtype):
    block_k, block_bytes, _ = GGUF_LAYOUTS[qtype]
    rng = np.random.default_rng(3)
    rows = rng.integers(0, 256, size=(37, 2 * block_bytes), dtype=np.uint8)
    for field in range(2):  # sane fp16 scales (d, and m / dmin): no inf / nan rows
        rows.reshape(37, 2, block_bytes)[..., 2 * field:2 * field + 2] = (
            rng.uniform(1e-3, 4e-3, (37, 2, 1)).astype(np.float16).view(np.uint8))
    weight = pack_gguf(rows, qtype)
    ids = torch.tensor([0, 36, 17, 5, 17, 31])
    want = GGUFBlocks("t", qtype, torch.from_numpy(rows), 2 * block_k).dequantize()[ids]
    assert torch.equal(packed_embedding(ids, weight.data, weight), want)


def test_smollm2_holds_the_file_bytes_at_0_625_bytes_a_projection_weight(smollm2_path, smollm2_pair):
    packed, _ = smollm2_pair
    file = {t.name: torch.from_numpy(np.array(t.data)) for t in GGUFFile(smollm2_path).tensors}
    layer = packed.layers[0]
    heads, kv_heads = packed.arch.num_heads, packed.arch.num_kv_heads
    qkv = torch.cat([unpermute_rows(file["blk.0.attn_q.weight"], heads),
                     unpermute_rows(file["blk.0.attn_k.weight"], kv_heads), file["blk.0.attn_v.weight"]])
    assert torch.equal(layer.self_attn.qkv_proj.quantized.file_bytes(), qkv)  # rows reordered, blocks the file's
    gate_up = torch.cat([file["blk.0.ffn_gate.weight"], file["blk.0.ffn_up.weight"]])
    assert torch.equal(layer.mlp.gate_up_proj.quantized.file_bytes(), gate_up)
    assert torch.equal(layer.mlp.down_proj.quantized.file_bytes(), file["blk.0.ffn_down.weight"])
    assert torch.equal(packed.embed_tokens.quantized.file_bytes(), file["token_embd.weight"])
    for module in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
        assert module.quantized.fmt == "q4_1" and module.quantized.bytes_per_weight == 0.625
        assert module.weight.numel() == 0  # no fp32 copy
    weights, resident = resident_weight_bytes(packed)
    assert weights == resident_weight_bytes(smollm2_pair[1])[0]
    assert resident / weights < 0.75  # projections 0.625, the Q8_0 embedding 1.0625, norms fp32


def test_smollm2_projections_and_head_within_the_int8_bound(smollm2_pair):
    packed, dequantized = smollm2_pair
    x = torch.randn(5, 576, generator=torch.Generator().manual_seed(0))
    for name in ("layers.0.self_attn.qkv_proj", "layers.7.mlp.gate_up_proj", "layers.29.self_attn.o_proj"):
        p, d = packed.get_submodule(name), dequantized.get_submodule(name)
        err = (p(x).double() - d(x).double()).abs()
        assert bool((err <= int8_error_bound(x, p.quantized, d.weight)).all()), name
    x = torch.randn(5, 1536, generator=torch.Generator().manual_seed(1))
    p, d = packed.layers[3].mlp.down_proj, dequantized.layers[3].mlp.down_proj
    assert bool(((p(x) - d(x)).abs() <= int8_error_bound(x, p.quantized, d.weight)).all())
    h = torch.randn(3, 576, generator=torch.Generator().manual_seed(2))
    err = (packed.compute_logits(h).double() - dequantized.compute_logits(h).double()).abs()
    assert bool((err <= int8_error_bound(h, packed.embed_tokens.quantized, dequantized.embed_tokens.weight)).all())
    ids = torch.tensor([0, 1, 49151, 300])
    assert torch.equal(packed.embed_tokens(ids), dequantized.embed_tokens(ids))


WORKLOAD_PROMPTS = 8  # the shared workload's first 8 prompts (8 topics, every length it mixes)
WORKLOAD_TOKENS = 24


def _workload_prompts() -> list:
    from benchmarks.workload import prompts

    return prompts()[:WORKLOAD_PROMPTS]


@pytest.fixture(scope="module")
def packed_smollm2():
    """One-rank packed SmolLM2 engines by packed_gemm_path ("auto": int8 activations where the CPU has VNNI, the
    default; "fp32": weights widened in registers), shared by the engine tests below instead of one start each."""
    llms = {path: LLM("", weight_format="packed", packed_gemm_path=path, num_blocks=256,
                      max_num_seqs=WORKLOAD_PROMPTS) for path in ("auto", "fp32")}
    yield llms
    for llm in llms.values():
        llm.close()


def test_greedy_on_the_workload_prompts_equals_dequantize_or_parts_only_at_near_ties(packed_smollm2):
    """packed_gemm_path=fp32 (weights widened in registers) computes dequantize's function up to summation order:
    the same greedy ids. The default int8 path rounds each activation row (llama.cpp's Q8 activations), so a
    continuation may part from dequantize's where two tokens are nearly tied; there the packed token must be among
    dequantize's top 3, within 0.5 nats of its pick. Prints the count of differing continuations (pytest -s)."""
    prompts = _workload_prompts()
    params = SamplingParams(temperature=0.0, max_tokens=WORKLOAD_TOKENS, ignore_eos=True, logprobs=3)
    with LLM(max_num_seqs=WORKLOAD_PROMPTS, num_blocks=256) as dequantize:
        results = {"dequantize": dequantize.generate(prompts, params)}
    results["fp32"] = packed_smollm2["fp32"].generate(prompts, params)
    results["int8"] = packed_smollm2["auto"].generate(prompts, params)
    assert [r.token_ids for r in results["fp32"]] == [r.token_ids for r in results["dequantize"]]
    differing = []
    for want, got in zip(results["dequantize"], results["int8"]):
        assert len(got.token_ids) == WORKLOAD_TOKENS and got.error is None
        if want.token_ids == got.token_ids:
            continue
        j = next(i for i, (a, b) in enumerate(zip(want.token_ids, got.token_ids)) if a != b)
        top = dict(want.logprobs[j].top)
        assert got.token_ids[j] in top, (j, got.token_ids[j], top)
        gap = want.logprobs[j].logprob - top[got.token_ids[j]]
        assert gap < 0.5, (j, gap)
        differing.append((j, round(gap, 3)))
    print(f"weight_format=packed (int8 activations): {len(differing)} of {len(prompts)} greedy continuations of "
          f"{WORKLOAD_TOKENS} tokens differ from dequantize; (first differing index, logprob gap there): {differing}")


def test_compiled_regions_trace_the_packed_ops_and_pass_the_graph_lint(smollm2_pair):
    """The packed GEMM and the embedding lookup are opaque registered ops: compiled, a projection, the MLP and the
    embedding give the eager bits; a packed SmolLM2's decode and prefill regions and its head trace in one graph
    each and pass ``deepinfer lint-graphs``' rules. A whole region matches eager to ~1e-2 only: the attention's and
    norms' summation orders differ by ~1e-6 (as for dequantize), and an int8 activation that rounds the other way
    moves by a whole step, layer after layer."""
    packed, _ = smollm2_pair
    x = torch.randn(8, 576, generator=torch.Generator().manual_seed(4))
    for fn, arg in [(packed.layers[0].self_attn.qkv_proj, x), (packed.layers[1].mlp, x),
                    (packed.embed_tokens, torch.tensor([0, 5, 49151, 7])), (packed.compute_logits, x[:2])]:
        compiled = torch.compile(fn, backend="aot_eager", fullgraph=True, dynamic=False)(arg)
        assert torch.equal(compiled, fn(arg))
    buckets = BucketSpec(batch_sizes=(2,), block_table_widths=(4,), prefill_lengths=(8,), block_size=4)
    wrapper = CompiledModel(packed, buckets, "eager", scratch_block=16)
    for kind, rows, queries, width in [("decode", 2, 1, 4), ("prefill", 1, 8, 4)]:
        step = wrapper._dummy_step(rows, queries, width, torch.device("cpu"))
        caches = [[torch.zeros(s) for s in packed.kv_cache_shapes(17 * 4)] for _ in range(2)]  # fresh for each
        compiled = lint_region(wrapper._run, step.input_ids, step.positions, layer_views(caches[0]), step.meta,
                               region=f"packed smollm2 {kind}")
        eager = wrapper._run(step.input_ids, step.positions, layer_views(caches[1]), step.meta)
        assert float((compiled - eager).norm() / eager.norm()) < 3e-2, kind
    lint_region(packed.compute_logits, x[:2], region="packed head")


def test_two_ranks_hold_block_aligned_shards_and_match_one(packed_smollm2):
    """SmolLM2 on two ranks (2 + 1 KV-head groups): o_proj's columns split at input 384 and down_proj's at 768, on
    Q4_1's 32-input blocks. On the fp32 path greedy ids match one rank's (as dequantize's do); the int8 path runs
    too (its ids may part at a near tie: the all-reduce's summation order moves an activation across a rounding
    edge)."""
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = ["What is the capital of France?", "Once upon a time there was", "0123456789 + - * / ="]
    outputs = [[r.token_ids for r in packed_smollm2["fp32"].generate(prompts, params)]]  # one rank
    for path in ("fp32", "int8"):
        with LLM("", weight_format="packed", packed_gemm_path=path, tensor_parallel_size=2, num_blocks=128) as llm:
            outputs.append([r.token_ids for r in llm.generate(prompts, params)])
    assert outputs[0] == outputs[1]
    assert all(len(ids) == 8 for ids in outputs[2])


@pytest.fixture(scope="module")
def tiny_v3_fp8(tmp_path_factory):
    return make_tiny("deepseek_v3", tmp_path_factory.mktemp("v3fp8") / "m", fp8=True, mtp_layers=1)


def test_deepseek_v3_fp8_projections_packed_give_dequantizes_greedy_ids(tiny_v3_fp8):
    """Every fp8 projection (attention, dense and shared-expert MLPs, MTP) in packed tiles, the fp32-widening path:
    block_fp8_linear's function up to summation order, the same greedy ids; fp8 bytes resident, no fp8 copy."""
    packed = load_model(str(tiny_v3_fp8), progress=False, weight_format="packed")
    fp8 = {name: m for name, m in packed.named_modules() if getattr(m, "quantized", None) is not None}
    assert fp8 and all(m.quantized.fmt == "fp8_e4m3" and m.weight.numel() == 0 for m in fp8.values())
    experts = [m for m in packed.modules() if isinstance(m, RoutedExperts)]  # main layers' and MTP's
    assert len(experts) == 3 and all(m.packed_experts() is not None and m.gate_proj is None for m in experts)
    assert any(name.startswith("mtp.") for name in fp8) and any("shared_experts" in name for name in fp8)
    dequantized = load_model(str(tiny_v3_fp8), progress=False)
    for name, p in fp8.items():
        d = dequantized.get_submodule(name)
        x = torch.randn(3, p.in_features, generator=torch.Generator().manual_seed(5))
        torch.testing.assert_close(p(x), d(x), rtol=1e-5, atol=1e-5)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    ids = []
    for fmt in ("dequantize", "packed"):
        with LLM(str(tiny_v3_fp8), weight_format=fmt, num_blocks=64) as llm:
            ids.append([r.token_ids for r in llm.generate(["Hello there", "0123456789", "abc abc"], params)])
    assert ids[0] == ids[1]


def _fp8_routed_experts(inter: int, hidden: int = 256, num: int = 6,
                        par: ParallelContext | None = None) -> dict[bool, RoutedExperts]:
    """The same random fp8 experts twice: as fp8 stacks (dequantized inside each linear) and packed."""
    gen = torch.Generator().manual_seed(inter)
    layers = {packed: RoutedExperts(num, hidden, inter, (128, 128), par or ParallelContext(), packed=packed)
              for packed in (False, True)}
    for e in range(num):
        for proj, shape in (("gate_proj", (inter, hidden)), ("up_proj", (inter, hidden)),
                            ("down_proj", (hidden, inter))):
            q, scale = quantize_block_fp8(torch.randn(*shape, generator=gen) * 0.2)
            for layer in layers.values():
                layer.set_expert(e, proj, q, scale, torch.float32, dequantize=False)
    return layers


@pytest.mark.parametrize("inter", [128, 96])  # on the 128-row blocks: gate and up one GEMM; off them: apart
def test_deepseek_v3_packed_routed_experts_equal_the_fp8_stacks(inter):
    """Each fp8 expert in packed tiles holds the stack's values (dequantized: equal to the bit); the packed
    dispatch computes moe_dynamic's function up to summation order, a sink id (another rank's expert) skipped;
    resident: 1 byte a weight plus the 128x128 scales, no fp8 stack besides."""
    layers = _fp8_routed_experts(inter)
    stacks, packed = layers[False].weights(), layers[True]
    tiles = packed.packed_experts()
    assert packed.gate_proj is None and packed.missing() == []
    assert (tiles.gate_up is not None) == (inter % 128 == 0) and tiles.num_experts == 6
    dense = tiles.dense(torch.float32)
    for got, want, scale in ((dense.gate, stacks.gate, stacks.gate_scale), (dense.up, stacks.up, stacks.up_scale),
                             (dense.down, stacks.down, stacks.down_scale)):
        assert torch.equal(got, dequantize_block_fp8(want, scale))
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(9, 256, generator=gen)
    ids = torch.stack([torch.randperm(6, generator=gen)[:2] for _ in range(9)])
    ids[0, 0] = 6  # the sink
    weights = torch.rand(9, 2, generator=gen)
    want = moe_dynamic(x, weights, ids, stacks)
    got = moe_dynamic_packed(x, weights, ids, tiles)
    assert float(want.abs().min(dim=-1).values.min()) > 0  # every token, the one with a sink id too, got output
    atol = 1e-6 * float(want.abs().max())  # fp32 sums in another order: an error relative to the outputs
    torch.testing.assert_close(got, want, rtol=1e-5, atol=atol)
    torch.testing.assert_close(moe_static(x, weights, ids, dense), want, rtol=1e-5, atol=atol)
    weights_count, resident = packed.packed_experts_bytes()
    assert weights_count == 6 * 3 * inter * 256
    # fp32 scales: gate_up 2 x 2 blocks (or gate and up 1 x 2 each), down 2 x 1; 96 and 128 rows fill whole tiles
    scales = 6 * 4 * (2 * 2 + 2 * 1) if inter == 128 else 6 * 4 * (1 * 2 + 1 * 2 + 2 * 1)
    assert resident == weights_count + scales


def test_deepseek_v3_packed_routed_experts_split_off_the_blocks_is_refused_naming_it():
    """Tensor parallel without expert parallelism cuts each expert's 128 intermediate units at 64: inside a scale
    block, refused naming the expert; with expert parallelism every rank keeps whole experts."""
    with pytest.raises(ValueError, match=r"weight_format=packed: the tensor-parallel split \[64, 128\) of dim 0 of "
                                         r"experts.0.gate_proj"):
        _fp8_routed_experts(128, par=ParallelContext(rank=1, world_size=2, group=object()))
    layers = _fp8_routed_experts(128, par=ParallelContext(rank=1, world_size=2, group=object(),
                                                          expert_parallel=True))
    assert layers[True].expert_start == 3 and layers[True].packed_experts().num_experts == 3


# hidden, heads and intermediate sizes whose two-rank splits fall on the 128x128 fp8 blocks
V3_TP_OVERRIDES = dict(hidden_size=256, intermediate_size=512, moe_intermediate_size=256, num_attention_heads=4,
                       num_key_value_heads=4, kv_lora_rank=128, q_lora_rank=256, qk_rope_head_dim=64,
                       qk_nope_head_dim=64, v_head_dim=64)


def test_deepseek_v3_fp8_experts_packed_on_two_ranks_with_and_without_expert_parallelism(tmp_path):
    """Tiny V3 fp8 sized for two ranks: packed at TP=2 (each expert cut at its 128-unit blocks) and TP=2 with
    expert parallelism (whole experts, each rank packing its own) give one-rank dequantize's greedy ids."""
    path = make_tiny("deepseek_v3", tmp_path / "v3", fp8=True, overrides=V3_TP_OVERRIDES)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    ids = []
    for settings in ({"weight_format": "dequantize"}, {"weight_format": "packed", "tensor_parallel_size": 2},
                     {"weight_format": "packed", "tensor_parallel_size": 2, "enable_expert_parallel": True}):
        with LLM(str(path), num_blocks=64, **settings) as llm:
            ids.append([r.token_ids for r in llm.generate(["Hello there", "0123456789", "abc abc"], params)])
    assert ids[0] == ids[1] == ids[2]


def test_deepseek_v3_fp8_split_off_the_128_blocks_is_refused_naming_it(tiny_v3_fp8):
    """The tiny model's 128-wide hidden size splits at 64 on two ranks: inside one 128x128 block."""
    with pytest.raises(Exception, match="weight_format=packed: the tensor-parallel split"):
        with LLM(str(tiny_v3_fp8), weight_format="packed", tensor_parallel_size=2, num_blocks=64):
            pass


def test_deepseek_v4_fp8_projections_packed_give_dequantizes_greedy_ids(tmp_path):
    """V4 with fp8 projections and fp4 routed experts: the fp8 projections (but wo_a, read whole by its grouped
    product) and every fp4 expert in packed tiles on the fp32-widening path, the same greedy ids as dequantize."""
    path = make_tiny("deepseek_v4", tmp_path / "v4", fp8=True, fp4_experts=True, mtp_layers=1)
    packed = load_model(str(path), progress=False, weight_format="packed")
    fp8 = {name: m for name, m in packed.named_modules() if getattr(m, "quantized", None) is not None}
    assert fp8 and not any(name.endswith("wo_a") for name in fp8)
    moe = packed.layers[0].ffn
    assert moe.gate_up.numel() == 0 and moe.gate_up_tiles is not None and moe.packed_shapes
    dequantized = load_model(str(path), progress=False)
    x = torch.randn(5, moe.d.hidden, generator=torch.Generator().manual_seed(7))
    for e in range(moe.num_local_experts):  # each fp4 expert: its tiles' GEMM against the int8 stack's dequantized
        want = torch.nn.functional.linear(x, dequantized.layers[0].ffn._dense("gate_up", x.dtype, e))
        torch.testing.assert_close(moe._expert_linear(x, "gate_up", e), want, rtol=1e-5, atol=1e-5)
        assert torch.equal(moe._dense("down", x.dtype, e), dequantized.layers[0].ffn._dense("down", x.dtype, e))
    for name, p in fp8.items():
        x = torch.randn(3, p.in_features, generator=torch.Generator().manual_seed(6))
        torch.testing.assert_close(p(x), dequantized.get_submodule(name)(x), rtol=1e-5, atol=1e-5)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    ids = []
    for fmt in ("dequantize", "packed"):
        with LLM(str(path), weight_format=fmt, num_blocks=64) as llm:
            ids.append([r.token_ids for r in llm.generate(["Hello there", "0123456789", "abc abc"], params)])
    assert ids[0] == ids[1]


def test_deepseek_v4_fp4_experts_packed_with_expert_parallelism_match_one_rank(tmp_path):
    """Two ranks with expert parallelism: each packs its own whole fp4 experts; greedy ids equal one rank's."""
    path = make_tiny("deepseek_v4", tmp_path / "v4", fp4_experts=True)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    ids = []
    for settings in ({}, {"tensor_parallel_size": 2, "enable_expert_parallel": True}):
        with LLM(str(path), weight_format="packed", num_blocks=64, **settings) as llm:
            ids.append([r.token_ids for r in llm.generate(["Hello there", "0123456789", "abc abc"], params)])
    assert ids[0] == ids[1]


@pytest.mark.parametrize("arch", ["deepseek_v3", "deepseek_v4"])
def test_deepseek_packed_regions_trace_and_pass_the_graph_lint(arch, tmp_path):
    """Tiny V3 fp8 / V4 fp8 + fp4, packed, static MoE (what compiled regions run): decode and prefill regions
    trace whole, pass the lint, and compute what the eager static path computes (fp32 widening everywhere)."""
    # V4: one layer of each attention kind and 4 Sinkhorn steps (not 4 layers and 20): the same ops in the graphs,
    # a quarter of the tracing gone
    small = dict(num_hidden_layers=3, hc_sinkhorn_iters=4, mlp_layer_types=["hash_moe", "moe", "moe"],
                 layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"])
    path = make_tiny(arch, tmp_path / arch, fp8=True, fp4_experts=arch == "deepseek_v4",
                     overrides=small if arch == "deepseek_v4" else None)
    model = load_model(str(path), progress=False, weight_format="packed")
    model.set_moe_impl("static")
    buckets = BucketSpec(batch_sizes=(2,), block_table_widths=(4,), prefill_lengths=(8,), block_size=4)
    wrapper = CompiledModel(model, buckets, "eager", scratch_block=16)
    for kind, rows, queries, width in [("decode", 2, 1, 4), ("prefill", 1, 8, 4)]:
        step = wrapper._dummy_step(rows, queries, width, torch.device("cpu"))
        caches = []
        for _ in range(2):
            if keeps_hybrid_state(model):
                paged, state = model.hybrid_cache_shapes(17, 4, 5)
                caches.append([torch.zeros(s) for s in paged + state])
            else:
                caches.append([torch.zeros(s) for s in model.kv_cache_shapes(17 * 4)])
        compiled = lint_region(wrapper._run, step.input_ids, step.positions, layer_views(caches[0]), step.meta,
                               region=f"packed {arch} {kind}")
        eager = wrapper._run(step.input_ids, step.positions, layer_views(caches[1]), step.meta)
        torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-4)


def test_one_op_decode_loop_on_packed_weights_equals_the_module_path(packed_smollm2):
    """Eager host decode steps of a packed SmolLM2 run ``deepinfer::llama_decode_layers`` with its packed-GEMM path
    (kernels/csrc/llama_decode.cpp): the module path's ids and logprobs to the bit, on both GEMM paths."""
    prompts = ["The cat sat on the mat. The cat", "Count: one two three", "Hello"]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=2)
    for path, llm in packed_smollm2.items():
        model = llm.engine.model
        collect, results, served = type(model)._host_decode_weights, [], []
        for use_op in (False, True):
            def weights(num_tokens, meta, use_op=use_op):
                found = collect(model, num_tokens, meta) if use_op else None
                served.append(found is not None)
                return found
            model._host_decode_weights = weights
            try:
                outs = llm.generate(prompts, params)
            finally:
                del model._host_decode_weights
            results.append(([o.token_ids for o in outs], [o.logprobs for o in outs]))
        assert any(served) and results[0] == results[1], path
