"""DeepSeek-V3 against transformers (fp32) on tiny random configs: logits of mixed batches over the paged
latent cache, greedy decoding (single and concurrent with chunked prefill), fp8 checkpoints, make-tiny."""
from __future__ import annotations

import json

import pytest
import torch

from backend_lib.models.deepseek_v3.model import DeepseekV3ForCausalLM
from backend_lib.models.loading.loader import load_model
from backend_lib.tools.tiny import make_tiny
from kernels.attention_metadata import AttentionMetadata
from tests.helpers.paged_runner import PagedRunner

NEW_TOKENS = 32
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32,
        "mscale": 1.0, "mscale_all_dim": 0.8, "beta_fast": 32, "beta_slow": 1}
CONFIGS = {
    # q_lora_rank None (plain q_proj), two dense layers, one group, no top-k renormalization
    "plain_q_dense": dict(q_lora_rank=None, num_hidden_layers=4, first_k_dense_replace=2, n_group=1, topk_group=1,
                          norm_topk_prob=False, routed_scaling_factor=1.0),
    # q LoRA, YaRN (attention factor and mscale_all_dim), 4 groups of 4 experts with topk_group 2 < n_group
    "yarn_groups": dict(n_routed_experts=16, num_experts_per_tok=3, n_group=4, topk_group=2,
                        max_position_embeddings=128, rope_parameters=YARN),
    # non-interleaved rope, attention bias, two shared experts, small odd dims
    "bias_halfrope": dict(hidden_size=48, intermediate_size=80, moe_intermediate_size=24, kv_lora_rank=20,
                          q_lora_rank=40, qk_rope_head_dim=8, qk_nope_head_dim=12, v_head_dim=10,
                          num_attention_heads=3, num_key_value_heads=3, rope_interleave=False, attention_bias=True,
                          n_shared_experts=2, n_routed_experts=6, n_group=3, topk_group=2),
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def pair(request, tmp_path_factory):
    """(ours, transformers) loaded from the same make-tiny directory."""
    from transformers import AutoModelForCausalLM
    path = make_tiny("deepseek_v3", tmp_path_factory.mktemp(request.param), seed=3,
                     overrides=CONFIGS[request.param])
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    return load_model(str(path), torch.float32, progress=False), hf


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(3, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_mixed_batch_logits_match_transformers(pair):
    ours, hf = pair
    run = PagedRunner(ours)
    seqs = {"a": _tokens(7, 1), "b": _tokens(13, 2), "c": _tokens(4, 3)}
    logits: dict[str, list[torch.Tensor]] = {r: [] for r in seqs}

    def record(out: torch.Tensor, parts: list[tuple[str, int]]) -> None:
        start = 0
        for rid, n in parts:
            logits[rid].append(out[start:start + n])
            start += n

    record(run.step([], [("a", seqs["a"]), ("b", seqs["b"][:5]), ("c", seqs["c"])]), [("a", 7), ("b", 5), ("c", 4)])
    extra = {r: _tokens(4, 10 + i) for i, r in enumerate(seqs)}
    # decodes while "b" continues its cached 5-token prefix as a second chunk
    record(run.step([("a", extra["a"][:1]), ("c", extra["c"][:1])], [("b", seqs["b"][5:])]),
           [("a", 1), ("c", 1), ("b", 8)])
    record(run.step([(r, extra[r][1:2]) for r in "abc"], []), [(r, 1) for r in "abc"])
    record(run.step([(r, extra[r][2:4]) for r in "abc"], []), [(r, 2) for r in "abc"])  # Q = 2 (drafts)
    full = {"a": seqs["a"] + extra["a"], "b": seqs["b"] + extra["b"][1:], "c": seqs["c"] + extra["c"]}
    for rid, parts in logits.items():
        ours_logits = torch.cat(parts)
        with torch.inference_mode():
            ref = hf(torch.tensor([full[rid]])).logits[0]
        assert ours_logits.shape == ref.shape
        assert (ours_logits - ref).abs().max() <= 1e-4, rid


def test_prefix_cached_blocks_are_reused(pair):
    ours, hf = pair
    run = PagedRunner(ours)
    shared = _tokens(8, 30)  # two full blocks of 4
    run.step([], [("a", shared + _tokens(3, 31))])
    run.share_prefix("a", "b", 2)
    tail = _tokens(5, 32)
    out = run.step([], [("b", tail)])
    with torch.inference_mode():
        ref = hf(torch.tensor([shared + tail])).logits[0, 8:]
    assert (out - ref).abs().max() <= 1e-4


def _hf_generate(hf, prompt: list[int]) -> list[int]:
    with torch.inference_mode():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                          do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def _greedy(model: DeepseekV3ForCausalLM, prompts: list[list[int]], budget: int) -> list[list[int]]:
    """Continuous batching in miniature: decodes first, then prefill chunks within a per-step token budget."""
    run = PagedRunner(model)
    done_prefill = [0] * len(prompts)
    outputs: list[list[int]] = [[] for _ in prompts]
    while any(len(o) < NEW_TOKENS for o in outputs):
        decodes = [(str(i), [o[-1]]) for i, o in enumerate(outputs) if o and len(o) < NEW_TOKENS]
        left, prefills = budget - len(decodes), []
        for i, p in enumerate(prompts):
            if done_prefill[i] < len(p) and left > 0:
                n = min(left, len(p) - done_prefill[i])
                prefills.append((str(i), p[done_prefill[i]:done_prefill[i] + n]))
                done_prefill[i] += n
                left -= n
        out = run.step(decodes, prefills)
        row = 0
        for rid, toks in decodes + prefills:
            row += len(toks)
            i = int(rid)
            if done_prefill[i] == len(prompts[i]) and len(outputs[i]) < NEW_TOKENS and (
                    outputs[i] or (rid, toks) in prefills):
                outputs[i].append(int(out[row - 1].argmax()))
    return outputs


def test_greedy_single_request_matches_transformers(pair):
    ours, hf = pair
    prompt = _tokens(9, 5)
    assert _greedy(ours, [prompt], budget=64) == [_hf_generate(hf, prompt)]


def test_greedy_concurrent_chunked_batch_matches_transformers(pair):
    ours, hf = pair
    prompts = [_tokens(n, 20 + n) for n in (5, 19, 11, 2)]
    assert _greedy(ours, prompts, budget=8) == [_hf_generate(hf, p) for p in prompts]


def test_static_moe_gives_the_same_tokens(pair):
    ours, hf = pair
    prompt = _tokens(6, 8)
    ours.set_moe_impl("static")
    try:
        assert _greedy(ours, [prompt], budget=64) == [_hf_generate(hf, prompt)]
    finally:
        ours.set_moe_impl("dynamic")


@pytest.mark.parametrize("scale_fmt", ["float", "ue8m0"])
def test_fp8_checkpoint_greedy_matches_transformers(scale_fmt, tmp_path):
    from transformers import AutoModelForCausalLM
    path = make_tiny("deepseek_v3", tmp_path / scale_fmt, fp8=True, scale_fmt=scale_fmt, seed=1)
    config = json.loads((path / "config.json").read_text())
    assert config["quantization_config"]["weight_block_size"] == [128, 128]
    # transformers dequantizes fp8 on CPU at load (FineGrainedFP8, dequantize=True)
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    kept = load_model(str(path), torch.float32, progress=False, weight_format="dequantize")  # fp8 widened per linear
    dequantized = load_model(str(path), torch.float32, progress=False, dequantize_fp8_at_load=True)
    q_b = kept.layers[0].self_attn.q_b_proj
    assert q_b.weight.dtype == torch.float8_e4m3fn and q_b.weight_scale_inv is not None
    experts = kept.layers[1].mlp.experts  # routed experts: dequantized at load under weight_format=dequantize
    assert experts.gate_proj.dtype == torch.float32 and experts.gate_proj_scale_inv is None
    assert dequantized.layers[0].self_attn.q_b_proj.weight.dtype == torch.float32
    hf_w = hf.model.layers[0].self_attn.q_b_proj.weight
    assert torch.equal(q_b.dense_weight(torch.float32), hf_w)
    prompts = [_tokens(7, 40), _tokens(12, 41)]
    expected = [_hf_generate(hf, p) for p in prompts]
    assert _greedy(kept, prompts, budget=8) == expected
    assert _greedy(dequantized, prompts, budget=8) == expected


def test_mtp_weights_load_as_optional_submodule(tmp_path):
    path = make_tiny("deepseek_v3", tmp_path, mtp_layers=1, fp8=True)
    model = load_model(str(path), torch.float32, progress=False)
    assert model.has_mtp_weights and len(model.mtp) == 1
    mtp = model.mtp[0]
    for weight in (mtp.enorm.weight, mtp.hnorm.weight, mtp.eh_proj.weight, mtp.shared_head.norm.weight,
                   mtp.shared_head.head.weight):
        assert weight is not None and torch.isfinite(weight.float()).all()
    assert mtp.self_attn.q_b_proj.weight.dtype == torch.float8_e4m3fn
    assert model.kv_cache_shapes(8) == [(3, 8, 96 + 32)]  # the MTP layer's cache is the proposer's business


@pytest.mark.parametrize("arch", ["deepseek_v3", "llama"])
def test_make_tiny_loads_in_transformers_and_ours(arch, tmp_path):
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM
    from backend_lib.tools.tiny import main
    assert main(["--arch", arch, "--out", str(tmp_path)]) == 0
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == 2
    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    ids = tok.encode("The capital of France is Paris.").ids
    assert tok.decode(ids) == "The capital of France is Paris."
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    assert hf.config.vocab_size >= tok.get_vocab_size()
    ours = load_model(str(tmp_path), torch.float32, progress=False)
    with torch.inference_mode():
        ref = hf(torch.tensor([ids])).logits[0]
    if arch == "deepseek_v3":
        run = PagedRunner(ours)
        assert (run.step([], [("r", ids)]) - ref).abs().max() <= 1e-4
    else:
        assert type(ours).__name__ == "LlamaForCausalLM"


def test_engine_greedy_concurrent_matches_transformers(tmp_path):
    """Through LLMEngine: scheduler, paged blocks, chunked prefill (budget 8) and the model runner."""
    from transformers import AutoModelForCausalLM
    from backend_lib.core.config import EngineConfig
    from backend_lib.core.sampling_params import SamplingParams
    from backend_lib.engine.offline import LLM
    path = make_tiny("deepseek_v3", tmp_path, seed=4, overrides=CONFIGS["yarn_groups"])
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    llm = LLM(config=EngineConfig.from_flat({"model": str(path), "max_num_batched_tokens": 8, "max_num_seqs": 4,
                                             "num_blocks": 64, "block_size": 4}))
    prompts = [_tokens(n, 60 + n) for n in (5, 19, 11, 2)]
    results = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))
    assert [r.token_ids for r in results] == [_hf_generate(hf, p) for p in prompts]


def test_real_deepseek_v3_config_parses_with_transformers_yarn():
    """DeepSeek-V3's own config.json (old ``rope_scaling`` format, fp8): rope and softmax scale as transformers."""
    from transformers import DeepseekV3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import yarn_apply_mscale
    from backend_lib.models.deepseek_v3.layers import build_rope
    from backend_lib.models.deepseek_v3.model import DeepseekV3Args
    real = {"architectures": ["DeepseekV3ForCausalLM"], "max_position_embeddings": 163840, "rope_theta": 10000,
            "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                             "original_max_position_embeddings": 4096, "type": "yarn"},
            "q_lora_rank": 1536, "num_nextn_predict_layers": 1,
            "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                    "weight_block_size": [128, 128]}}
    args = DeepseekV3Args.from_hf_config(real)
    assert (args.latent_dim, args.fp8_scale_fmt, args.num_nextn_predict_layers) == (576, "float", 1)
    rope = build_rope(args.qk_rope_head_dim, args.rope_theta, args.rope_scaling, args.max_position_embeddings,
                      args.rope_interleave)
    hf_config = DeepseekV3Config(**{k: v for k, v in real.items() if k != "quantization_config"})
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](hf_config)
    assert torch.equal(rope.inv_freq, inv_freq) and rope.attention_factor == attention_factor
    scale = args.qk_nope_head_dim + args.qk_rope_head_dim
    assert scale ** -0.5 * rope.softmax_mscale * rope.softmax_mscale == yarn_apply_mscale(
        hf_config.rope_parameters, scale ** -0.5)
    with pytest.raises(ValueError, match="hidden_act"):
        DeepseekV3Args.from_hf_config({**real, "hidden_act": "gelu"})


def test_decode_step_compiles_fullgraph_with_static_moe(tmp_path):
    """The decode path (absorbed MLA, static MoE, kept-fp8 linears) has no graph breaks or host syncs."""
    path = make_tiny("deepseek_v3", tmp_path, fp8=True, seed=2)
    model = load_model(str(path), torch.float32, progress=False, weight_format="dequantize")
    model.set_moe_impl("static")
    run = PagedRunner(model)
    for rid in "ab":
        run.step([], [(rid, _tokens(5, ord(rid)))])
    ids, pos = torch.tensor([7, 8]), torch.tensor([5, 5])
    slots = torch.tensor([run.blocks[r][1] * 4 + 1 for r in "ab"])
    meta = AttentionMetadata(4, slots, 2, 1, torch.tensor([run.blocks[r] + [run.scratch] * 2 for r in "ab"],
                                                          dtype=torch.int32),
                             torch.tensor([6, 6], dtype=torch.int32), 0, [], [], torch.zeros(0, 4, dtype=torch.int32))
    with torch.inference_mode():
        eager = model(ids, pos, run.caches, meta)
        compiled = torch.compile(model, fullgraph=True, dynamic=False, backend="aot_eager")(
            ids, pos, run.caches, meta)
    assert torch.equal(compiled, eager)
