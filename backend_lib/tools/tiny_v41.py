"""``deepinfer make-tiny --arch deepseek_v41``: a tiny random DeepSeek-V4.1 in the release's own tensor names
(``layers.{i}.attn.wq_a``, ``attn.compressor.*`` on KV sources, ``attn.indexer.*`` on index sources,
``hc_attn_fn``, ``ffn.gate.bias_vl``, ``ffn.experts.{j}.w1`` ...; ``embed``, ``norm``, ``head`` at the top) and
its composite config.json (``text_config``, ``vision_config``, ``image_token_id``).

No transformers release has V4.1, so the tensors are drawn here from the names and shapes the release uses
(NeMo's ``state_dict_adapter.py`` regex table, transformers main's modules). The default schedule has every layer
kind: window-only (0), a ratio-2 KV source with two Reuse layers, a ratio-1 KV source that is also the candidate
source, a Reuse layer, a Reindex layer scoring inside the candidate pool, and a last Reuse layer. Dimensions keep
the quantization-aware activations live: head_dim and index_head_dim are multiples of 32 (fp8 window KV and fp4
index q / k in 32-blocks, fp4 compressed KV in 16-blocks); a window of 8, candidate blocks of 2 entries and a pool
of 2 blocks make a 40-token prompt cross five windows and change the pool often.
"""
from __future__ import annotations

import re
from typing import Any

import torch

from backend_lib.models.deepseek_v41.config import DeepseekV41Config, DeepseekV41TextArgs

TEXT_DEFAULTS: dict[str, Any] = dict(
    vocab_size=320, hidden_size=64, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=1, head_dim=32,
    qk_rope_head_dim=16, q_lora_rank=32, o_lora_rank=16, o_groups=2, moe_intermediate_size=32, n_routed_experts=8,
    n_shared_experts=1, num_experts_per_tok=2, scoring_func="sqrtsoftplus", gate_temp=1.0, norm_topk_prob=True,
    routed_scaling_factor=1.5, swiglu_limit=2.0, rms_norm_eps=1e-20, rope_theta=10000.0,
    compress_rope_theta=160000.0, max_position_embeddings=4096, sliding_window=8,
    compress_ratios=[0, 2, 2, 2, 1, 1, 1, 1], kv_source_layer_ids=[1, 4], index_source_layer_ids=[1, 4, 6],
    candidate_source_layer_id=4, candidate_topk_blocks=2, candidate_block_size=2, index_n_heads=4,
    index_head_dim=32, index_topk=3, hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6, engram_layer_ids=[],
    engram_num_embeddings=[], num_nextn_predict_layers=0, tie_word_embeddings=False, hidden_act="silu",
    rope_scaling={"type": "yarn", "factor": 4, "beta_fast": 32, "beta_slow": 1,
                  "original_max_position_embeddings": 256},
    bos_token_id=0, eos_token_id=1, pad_token_id=2,
)
VISION_DEFAULTS: dict[str, Any] = dict(  # the release's vision_config (not served; written so the config parses)
    hidden_size=1024, intermediate_size=2816, num_hidden_layers=32, num_attention_heads=16, patch_size=14,
    downsample_ratio=3, rope_theta=10000.0, max_image_tokens=1024, min_pixels=295936,
)


def v41_config(overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """The composite config.json of a tiny V4.1 (``overrides`` replaces ``text_config`` fields)."""
    text = {**TEXT_DEFAULTS, **(overrides or {})}
    config = {"model_type": "deepseek_v41", "architectures": ["DeepseekV41ForCausalLM"], "text_config": text,
              "vision_config": dict(VISION_DEFAULTS), "image_token_id": text["vocab_size"] - 1,
              "torch_dtype": "float32", "tie_word_embeddings": False}
    DeepseekV41Config.from_hf_config(config)  # a bad override fails here, naming the field
    return config


def _linear(out: int, inp: int, std: float, gen: torch.Generator) -> torch.Tensor:
    # std / sqrt(in): unit-scale outputs whatever the width (0.02 collapses greedy output to one token)
    return torch.randn(out, inp, generator=gen) * (std / inp ** 0.5)


def v41_tensors(config: dict[str, Any], gen: torch.Generator, std: float = 2.0) -> dict[str, torch.Tensor]:
    """Random fp32 tensors under the release names (mHC, sinks and gate biases fp32 as the release stores them)."""
    a: DeepseekV41TextArgs = DeepseekV41Config.from_hf_config(config).text
    h, hd, hc = a.hidden_size, a.head_dim, a.hc_mult
    mix = (2 + hc) * hc

    def norm(dim: int) -> torch.Tensor:
        return 1 + 0.1 * torch.randn(dim, generator=gen)

    t: dict[str, torch.Tensor] = {"embed.weight": torch.randn(a.vocab_size, h, generator=gen),
                                  "norm.weight": norm(h), "head.weight": _linear(a.vocab_size, h, std, gen)}
    for i, role in enumerate(a.roles):
        p = f"layers.{i}."
        t[p + "attn_norm.weight"], t[p + "ffn_norm.weight"] = norm(h), norm(h)
        for site in ("attn", "ffn"):
            t[f"{p}hc_{site}_fn"] = 0.5 * _linear(mix, hc * h, 1.0, gen)
            t[f"{p}hc_{site}_base"] = 0.5 * torch.randn(mix, generator=gen)
            t[f"{p}hc_{site}_scale"] = 1 + 0.2 * torch.randn(3, generator=gen)
        t[p + "attn.wq_a.weight"] = _linear(a.q_lora_rank, h, std, gen)
        t[p + "attn.q_norm.weight"] = norm(a.q_lora_rank)
        t[p + "attn.wq_b.weight"] = _linear(a.num_attention_heads * hd, a.q_lora_rank, std, gen)
        t[p + "attn.wkv.weight"] = _linear(hd, h, std, gen)
        t[p + "attn.kv_norm.weight"] = norm(hd)
        group_in = a.num_attention_heads * hd // a.o_groups
        t[p + "attn.wo_a.weight"] = _linear(a.o_groups * a.o_lora_rank, group_in, std, gen)
        t[p + "attn.wo_b.weight"] = _linear(h, a.o_groups * a.o_lora_rank, std, gen)
        t[p + "attn.attn_sink"] = torch.randn(a.num_attention_heads, generator=gen)
        if role.mode == "full":
            t[p + "attn.compressor.wkv.weight"] = _linear(hd, h, std, gen)
            if role.ratio > 1:
                t[p + "attn.compressor.wgate.weight"] = _linear(hd, h, std, gen)
            t[p + "attn.compressor.norm.weight"] = norm(hd)
            t[p + "attn.indexer.wk.weight"] = _linear(a.index_head_dim, hd, std, gen)
            t[p + "attn.indexer.k_norm.weight"] = norm(a.index_head_dim)
        if role.scores:
            t[p + "attn.indexer.wq_b.weight"] = _linear(a.index_n_heads * a.index_head_dim, a.q_lora_rank, std, gen)
            t[p + "attn.indexer.weights_proj.weight"] = _linear(a.index_n_heads, h, std, gen)
        t[p + "ffn.gate.weight"] = _linear(a.n_routed_experts, h, std, gen)
        t[p + "ffn.gate.bias"] = 0.05 * torch.randn(a.n_routed_experts, generator=gen)
        t[p + "ffn.gate.bias_vl"] = 0.05 * torch.randn(a.n_routed_experts, generator=gen)
        inter = a.moe_intermediate_size
        experts = [f"ffn.experts.{j}." for j in range(a.n_routed_experts)] + ["ffn.shared_experts."]
        for e in experts:
            t[f"{p}{e}w1.weight"] = _linear(inter, h, std, gen)
            t[f"{p}{e}w3.weight"] = _linear(inter, h, std, gen)
            t[f"{p}{e}w2.weight"] = _linear(h, inter, std, gen)
    return t


_FP8 = re.compile(r"^layers\.\d+\.(attn\.(wq_a|wq_b|wkv|wo_a|wo_b|indexer\.wq_b)|ffn\.shared_experts\.w[123])\.weight$")


def quantize_v41(config: dict[str, Any], tensors: dict[str, torch.Tensor], fp8: bool,
                 fp4_experts: bool) -> None:
    """In place, as the release quantizes (NeMo's adapter, "from the shard headers"): attention, indexer ``wq_b`` and
    shared-expert projections fp8 e4m3 with ue8m0 scales over 32x32 blocks (``--fp8``); routed experts fp4 e2m1,
    two a byte, a ue8m0 scale per 32 inputs (``--fp4-experts``), or fp8 like the rest (``--fp8`` alone). Scales go
    under ``<module>.scale`` (power-of-two values stored as fp32); norms, compressors, ``indexer.wk``, mHC, sinks,
    router, ``embed`` and ``head`` stay as they are."""
    from kernels.fp4 import quantize_fp4
    from kernels.quant import quantize_block_fp8

    for name in [n for n in tensors if n.endswith(".weight")]:
        base = name[: -len(".weight")]
        expert = ".ffn.experts." in name
        if fp4_experts and expert:
            tensors[name], tensors[base + ".scale"] = quantize_fp4(tensors[name])
        elif fp8 and (expert or _FP8.match(name)):
            tensors[name], tensors[base + ".scale"] = quantize_block_fp8(tensors[name], (32, 32), "ue8m0")
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": [32, 32], "scale_fmt": "ue8m0",
                                     "expert_dtype": "fp4" if fp4_experts else "fp8"}


def add_engram_v41(config: dict[str, Any], tensors: dict[str, torch.Tensor], tokenizer_file: Any,
                   layers: list[int], gen: torch.Generator, fp8_table: bool = False) -> None:
    """In place: the released Engram's config fields and ``layers.{i}.engram.*`` tensors on ``layers`` (orders 2-4,
    2 heads of 32 channels, tables a few rows past the sum of their primes; ``fp8_table``: e4m3 rows with a ue8m0
    scale per 32 channels)."""
    from backend_lib.models.deepseek_v41.engram import FP8_BLOCK, engram_primes
    from backend_lib.models.engram.ngram_hash import compressed_vocabulary
    from kernels.quant import quantize_block_fp8

    text = config["text_config"]
    text.update(engram_layer_ids=list(layers), engram_vocab_size=40, engram_max_ngram_size=4, engram_n_heads=2,
                engram_head_dim=32, engram_pad_id=2,
                engram_compressed_vocab_size=int(compressed_vocabulary(tokenizer_file).max()) + 1,
                engram_num_embeddings=[0] * len(layers))
    a = DeepseekV41Config.from_hf_config(config).text
    text["engram_num_embeddings"] = [sum(p) + 3 for p in engram_primes(a)]
    a = DeepseekV41Config.from_hf_config(config).text
    h, hc, cols = a.hidden_size, a.hc_mult, (a.engram_max_ngram_size - 1) * a.engram_n_heads
    for layer, rows in zip(layers, a.engram_num_embeddings):
        p = f"layers.{layer}.engram."
        table = torch.randn(rows, a.engram_head_dim, generator=gen)
        if fp8_table:
            tensors[p + "embed.weight"], tensors[p + "embed.scale"] = quantize_block_fp8(table, (1, FP8_BLOCK),
                                                                                         "ue8m0")
        else:
            tensors[p + "embed.weight"] = table
        tensors[p + "wkv.weight"] = _linear((hc + 1) * h, cols * a.engram_head_dim, 2.0, gen)
        tensors[p + "q_weight"] = 1 + 0.1 * torch.randn(hc, h, generator=gen)
        tensors[p + "k_weight"] = 1 + 0.1 * torch.randn(hc, h, generator=gen)


TINY_VISION: dict[str, Any] = dict(  # --vision: a tower small enough for tests, the release's fields
    hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2, patch_size=14,
    downsample_ratio=3, rope_theta=10000.0, max_image_tokens=40, min_pixels=42 * 42, max_wh_ratio=4.0,
)


def add_vision_v41(config: dict[str, Any], tensors: dict[str, torch.Tensor], gen: torch.Generator,
                   overrides: dict[str, Any] | None = None) -> None:
    """In place: a tiny ``vision_config`` and the tower / aligner / delimiter tensors in the release's names
    (``vision.patch_embed.proj``, ``vision.blocks.{i}.{norm1, attn.wqkv, attn.wo, norm2, mlp.w1, mlp.w2}``,
    ``vision.norm``, ``aligner.w1`` / ``w2``, ``image_start`` / ``image_newline`` / ``image_end`` / ``image_pad``;
    vLLM's ``deepseek_v4/common/vision.py`` says weight names match the HF checkpoint), all fp32, unquantized as
    released."""
    from backend_lib.models.deepseek_v41.vision.config import VisionArgs

    config["vision_config"] = {**TINY_VISION, **(overrides or {})}
    h = config["text_config"]["hidden_size"]
    v = VisionArgs.from_dict(config["vision_config"], h)
    d, r2 = v.hidden_size, v.downsample_ratio ** 2

    def norm(dim: int) -> torch.Tensor:
        return 1 + 0.1 * torch.randn(dim, generator=gen)

    def bias(dim: int) -> torch.Tensor:
        return 0.1 * torch.randn(dim, generator=gen)

    t = {"vision.patch_embed.proj.weight": _linear(d, v.patch_dim, 1.0, gen),
         "vision.patch_embed.proj.bias": bias(d), "vision.norm.weight": norm(d)}
    for i in range(v.num_hidden_layers):
        p = f"vision.blocks.{i}."
        t[p + "norm1.weight"], t[p + "norm2.weight"] = norm(d), norm(d)
        t[p + "attn.wqkv.weight"], t[p + "attn.wqkv.bias"] = _linear(3 * d, d, 2.0, gen), bias(3 * d)
        t[p + "attn.wo.weight"], t[p + "attn.wo.bias"] = _linear(d, d, 1.0, gen), bias(d)
        t[p + "mlp.w1.weight"] = _linear(2 * v.intermediate_size, d, 1.0, gen)
        t[p + "mlp.w2.weight"] = _linear(d, v.intermediate_size, 1.0, gen)
    t["aligner.w1.weight"], t["aligner.w1.bias"] = _linear(h, d * r2, 1.0, gen), bias(h)
    t["aligner.w2.weight"], t["aligner.w2.bias"] = _linear(h, h, 1.0, gen), bias(h)
    for name in ("image_start", "image_newline", "image_end", "image_pad"):
        t[name] = torch.randn(h, generator=gen)
    tensors.update(t)
