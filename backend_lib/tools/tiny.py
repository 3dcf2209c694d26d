"""`deepinfer make-tiny`: small random checkpoints (config.json, sharded safetensors + index, byte-level BPE
tokenizer.json) that load in transformers and in our engine, for tests, demos and benchmarks.

DeepSeek-V4 directories are written by transformers' own ``save_pretrained``, so they hold the release layout
(``attn.wq_a``, ``attn.compressor.wkv``, ``ffn.experts.N.w1``, ``hc_attn_fn``...) that real checkpoints use. The
defaults give every layer type (sliding, CSA, HCA), hash-routed and top-k MoE layers, ``hc_mult`` 4, and a window
of 8 with compress rates 4 and 8, so a 40-token prompt crosses five sliding windows and ten CSA windows.

Weights come from transformers' own random init with ``initializer_range`` 0.2 (0.02 makes greedy output
collapse to one token), with the router correction bias and the norm weights perturbed so that every term of
the math is exercised. ``fp8=True`` quantizes every projection inside the decoder layers to float8_e4m3fn with
128x128 blocks (``scale_fmt`` "float" or "ue8m0"); the default DeepSeek-V3 dimensions are all <= 128 or
multiples of 128, because transformers' fp8 dequantizer derives the block size from the scale grid.
"""
from __future__ import annotations

import argparse
import json
import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from backend_lib.tools.tiny_engram import add_engram
from backend_lib.tools.tiny_dspark_v41 import add_dspark_v41, quantize_dspark_v41
from backend_lib.tools.tiny_v41 import add_engram_v41, add_vision_v41, quantize_v41, v41_config, v41_tensors
from kernels.quant import DEFAULT_BLOCK, quantize_block_fp8

ARCHS = ("deepseek_v3", "deepseek_v4", "deepseek_v41", "llama")
TOKENIZER_VOCAB = 320
SPECIAL_TOKENS = ("<|bos|>", "<|eos|>", "<|pad|>")
_CORPUS = (
    "The quick brown fox jumps over the lazy dog. ",
    "DeepInfer serves large language models through Triton on AWS Neuron. ",
    "What is the capital of France? The capital of France is Paris. ",
    "Once upon a time there was a tiny model that predicted the next token. ",
    "Mixture of experts routes every token to a few experts; latent attention caches a small vector. ",
    "0123456789 + - * / = ( ) [ ] { } < > , . ; : ! ? ' \" \n",
)

DEEPSEEK_V3_DEFAULTS: dict[str, Any] = dict(
    vocab_size=TOKENIZER_VOCAB, hidden_size=128, intermediate_size=256, moe_intermediate_size=128,
    num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8,
    routed_scaling_factor=2.5, kv_lora_rank=96, q_lora_rank=128, qk_rope_head_dim=32, v_head_dim=32,
    qk_nope_head_dim=32, n_group=2, topk_group=1, num_experts_per_tok=2, first_k_dense_replace=1,
    norm_topk_prob=True, max_position_embeddings=1024, rope_interleave=True,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
)
DEEPSEEK_V4_DEFAULTS: dict[str, Any] = dict(
    vocab_size=TOKENIZER_VOCAB, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=4,
    num_attention_heads=4, head_dim=32, q_lora_rank=32, partial_rotary_factor=0.25, num_experts_per_tok=2,
    n_routed_experts=8, n_shared_experts=1, routed_scaling_factor=1.5, scoring_func="sqrtsoftplus",
    layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                 "compressed_sparse_attention"],
    mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe"],
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
    sliding_window=8, o_groups=2, o_lora_rank=16, index_n_heads=8, index_head_dim=16, index_topk=3,
    swiglu_limit=2.0, max_position_embeddings=1024, rope_theta=10000.0, compress_rope_theta=160000.0,
    # 4 Sinkhorn steps, not the release's 20: the same ops (compiled regions unroll the loop, so a quarter of
    # the graph), which is all a tiny model checks
    hc_sinkhorn_iters=4,
)
LLAMA_DEFAULTS: dict[str, Any] = dict(
    vocab_size=TOKENIZER_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=False,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
)


def build_tokenizer(out_dir: Path, vocab_size: int = TOKENIZER_VOCAB) -> int:
    """Train a byte-level BPE on a fixed corpus; write tokenizer.json + tokenizer_config.json. Returns its size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(list(_CORPUS) * 4, trainer)
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|bos|>", "eos_token": "<|eos|>",
        "pad_token": "<|pad|>", "model_max_length": 1024, "clean_up_tokenization_spaces": False,
        "chat_template": ("{% for m in messages %}<|bos|>{{ m['role'] }}\n{{ m['content'] }}<|eos|>\n{% endfor %}"
                          "{% if add_generation_prompt %}<|bos|>assistant\n{% endif %}"),
    }, indent=2))
    return tok.get_vocab_size()


def _perturb(model: torch.nn.Module, gen: torch.Generator) -> None:
    """Non-trivial norm weights and router correction bias (transformers initializes them to 1 and 0)."""
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if name.endswith("norm.weight"):
                tensor.add_(0.1 * torch.randn(tensor.shape, generator=gen))
            elif name.endswith("e_score_correction_bias"):
                tensor.copy_(0.05 * torch.randn(tensor.shape, generator=gen))


def _perturb_v4(model: torch.nn.Module, gen: torch.Generator) -> None:
    """V4 parameters that transformers initializes to constants: attention sinks, compressor position biases,
    mHC biases and scales, and the hash-routing table (zeros would send every token to expert 0)."""
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if name.endswith(".sinks"):
                tensor.copy_(torch.randn(tensor.shape, generator=gen))
            elif name.endswith("position_bias") or name.endswith("hc.base") or name.endswith("hc_base"):
                tensor.copy_(0.5 * torch.randn(tensor.shape, generator=gen))
            elif name.endswith("hc.scale") or name.endswith("hc_scale"):
                tensor.add_(0.2 * torch.randn(tensor.shape, generator=gen))
            elif name.endswith("tid2eid"):
                vocab, top_k = tensor.shape
                num_experts = model.config.n_routed_experts
                tensor.copy_(torch.rand(vocab, num_experts, generator=gen).argsort(dim=-1)[:, :top_k])


def _make_tiny_v4(out: Path, kwargs: dict[str, Any], gen: torch.Generator, num_shards: int) -> None:
    """Random V4 through transformers' own init and ``save_pretrained`` (release tensor names)."""
    import transformers

    config = transformers.DeepseekV4Config(**kwargs)
    model = transformers.DeepseekV4ForCausalLM(config).float().eval()
    _perturb(model, gen)
    _perturb_v4(model, gen)
    total = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    model.save_pretrained(str(out), max_shard_size=total // num_shards + 1)
    depths = int(kwargs.get("num_nextn_predict_layers") or 0)
    if depths:
        from safetensors.torch import load_file

        index = out / "model.safetensors.index.json"
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        tensors: dict[str, torch.Tensor] = {}
        for file in files:
            tensors.update(load_file(str(out / file)))
            (out / file).unlink()
        for k in range(depths):
            tensors.update(_mtp_tensors_v4(kwargs, k, gen, out / f".mtp{k}"))
        _write_shards(tensors, out, num_shards)


def _mtp_tensors_v4(kwargs: dict[str, Any], depth: int, gen: torch.Generator, scratch: Path) -> dict[str, torch.Tensor]:
    """Random ``mtp.{depth}.*`` tensors in the release layout: a one-layer sliding-only, top-k V4 saved by
    transformers gives the block (``attn``, ``ffn``, ``hc_attn_*`` ...), its ``hc_head`` and final ``norm``; the
    MTP glue (``enorm``, ``hnorm``, ``e_proj``, ``h_proj``) is drawn here. transformers ignores ``mtp.*`` on load."""
    import shutil

    import transformers
    from safetensors.torch import load_file

    one = {**kwargs, "num_hidden_layers": 1, "layer_types": ["sliding_attention"], "mlp_layer_types": ["moe"],
           "num_nextn_predict_layers": 0}
    torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=gen)))
    model = transformers.DeepseekV4ForCausalLM(transformers.DeepseekV4Config(**one)).float().eval()
    _perturb(model, gen)
    _perturb_v4(model, gen)
    model.save_pretrained(str(scratch))
    saved: dict[str, torch.Tensor] = {}
    for file in sorted(scratch.glob("*.safetensors")):
        saved.update(load_file(str(file)))
    shutil.rmtree(scratch)
    prefix, out = f"mtp.{depth}.", {}
    for name, tensor in saved.items():
        name = name[len("model."):] if name.startswith("model.") else name
        if name.startswith("layers.0."):
            out[prefix + name[len("layers.0."):]] = tensor
        elif name.startswith("hc_head."):  # transformers' hc_head.hc_fn -> the release's hc_head_fn
            out[prefix + "hc_head_" + name[len("hc_head.hc_"):]] = tensor
        elif name == "norm.weight":
            out[prefix + name] = tensor
    h, std = kwargs["hidden_size"], kwargs["initializer_range"]
    for norm in ("enorm", "hnorm"):
        out[f"{prefix}{norm}.weight"] = 1 + 0.1 * torch.randn(h, generator=gen)
    for proj in ("e_proj", "h_proj"):
        out[f"{prefix}{proj}.weight"] = std * torch.randn(h, h, generator=gen)
    return out


_V4_FP8 = re.compile(r"\.(attn\.(wq_a|wq_b|wkv|wo_a|wo_b|indexer\.wq_b)|ffn\.shared_experts\.w[123])\.weight$")
_V4_EXPERT = re.compile(r"\.ffn\.experts\.\d+\.w[123]\.weight$")


def _quantize_v4(out: Path, fp8: bool, fp4_experts: bool, num_shards: int) -> None:
    """Rewrite a saved V4 as the release quantizes it: attention and shared-expert projections fp8 e4m3 with 128x128
    ue8m0 block scales (``--fp8``); routed experts fp4 e2m1 with a ue8m0 scale per 32 inputs (``--fp4-experts``) or
    fp8 like the rest (``--fp8`` alone). Scales go under the release name ``<module>.scale``."""
    from safetensors.torch import load_file

    from kernels.fp4 import quantize_fp4

    index = out / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        tensors.update(load_file(str(out / file)))
        (out / file).unlink()
    for name in list(tensors):
        base = name[: -len(".weight")]
        if fp4_experts and _V4_EXPERT.search(name):
            tensors[name], tensors[base + ".scale"] = quantize_fp4(tensors[name])
        elif fp8 and (_V4_FP8.search(name) or _V4_EXPERT.search(name)):
            tensors[name], tensors[base + ".scale"] = quantize_block_fp8(tensors[name], DEFAULT_BLOCK, "ue8m0")
    _write_shards(tensors, out, num_shards)
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": list(DEFAULT_BLOCK), "scale_fmt": "ue8m0",
                                  "expert_dtype": "fp4" if fp4_experts else "fp8"}
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))


def _mtp_tensors(config: Any, index: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Random weights of one DeepSeek MTP module at checkpoint layer ``index`` (a MoE decoder layer + extras)."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3ForCausalLM

    one = type(config).from_dict({**config.to_dict(), "num_hidden_layers": 1, "first_k_dense_replace": 0})
    torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=gen)))
    layer_model = DeepseekV3ForCausalLM(one)
    _perturb(layer_model, gen)
    with torch.no_grad():
        tensors = _hf_named_tensors(layer_model)
    out = {name.replace("model.layers.0.", f"model.layers.{index}."): t
           for name, t in tensors.items() if name.startswith("model.layers.0.")}
    h, std = config.hidden_size, config.initializer_range
    prefix = f"model.layers.{index}."
    out[prefix + "enorm.weight"] = 1 + 0.1 * torch.randn(h, generator=gen)
    out[prefix + "hnorm.weight"] = 1 + 0.1 * torch.randn(h, generator=gen)
    out[prefix + "eh_proj.weight"] = std * torch.randn(h, 2 * h, generator=gen)
    out[prefix + "shared_head.norm.weight"] = 1 + 0.1 * torch.randn(h, generator=gen)
    out[prefix + "shared_head.head.weight"] = std * torch.randn(config.vocab_size, h, generator=gen)
    out[prefix + "embed_tokens.weight"] = std * torch.randn(config.vocab_size, h, generator=gen)
    return out


def _hf_named_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Checkpoint-named tensors of a transformers model (per-expert names, as save_pretrained writes them)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        if name.endswith("mlp.experts.gate_up_proj"):
            base = name[: -len("gate_up_proj")]
            inter = t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{base}{e}.gate_proj.weight"] = t[e, :inter].clone()
                out[f"{base}{e}.up_proj.weight"] = t[e, inter:].clone()
        elif name.endswith("mlp.experts.down_proj"):
            base = name[: -len("down_proj")]
            for e in range(t.shape[0]):
                out[f"{base}{e}.down_proj.weight"] = t[e].clone()
        else:
            out[name] = t.detach().clone().contiguous()
    return out


def _is_quantized(name: str) -> bool:
    """DeepSeek-V3 fp8 checkpoints quantize the projections inside decoder layers, not router/norms/MTP glue."""
    return (name.startswith("model.layers.") and name.endswith("_proj.weight")
            and not name.endswith("eh_proj.weight"))


def _write_shards(tensors: dict[str, torch.Tensor], out_dir: Path, num_shards: int) -> None:
    names = sorted(tensors)
    per = math.ceil(len(names) / num_shards)
    weight_map: dict[str, str] = {}
    for i in range(num_shards):
        chunk = names[i * per:(i + 1) * per]
        if not chunk:
            continue
        file = f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors"
        save_file({n: tensors[n].contiguous() for n in chunk}, str(out_dir / file), metadata={"format": "pt"})
        weight_map.update({n: file for n in chunk})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (out_dir / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))


def make_tiny(arch: str, out_dir: str | Path, fp8: bool = False, mtp_layers: int = 0, seed: int = 0,
              scale_fmt: str = "float", num_shards: int = 2, initializer_range: float = 0.2,
              overrides: dict[str, Any] | None = None, fp4_experts: bool = False,
              engram_layers: Sequence[int] = (), engram: dict[str, Any] | None = None,
              engram_fp8_table: bool = False, dspark: bool = False, vision: bool = False,
              vision_overrides: dict[str, Any] | None = None) -> Path:
    """Write a tiny random ``arch`` model to ``out_dir``; ``overrides`` replaces config fields. ``engram_layers``:
    Engram modules on those layers (``engram``: EngramConfig fields replacing the tiny defaults). ``dspark``
    (deepseek_v41): the DSpark drafter ``mtp.{0,1,2}`` too (tools/tiny_dspark_v41.py). ``vision`` (deepseek_v41): a
    tiny vision tower, aligner and image delimiters (``vision_overrides``: vision_config fields)."""
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {ARCHS}, got {arch!r}")
    if fp4_experts and arch not in ("deepseek_v4", "deepseek_v41"):
        raise ValueError("fp4_experts is only defined for archs 'deepseek_v4' and 'deepseek_v41'")
    if fp8 and arch == "llama":
        raise ValueError("fp8 is only supported for the DeepSeek archs")
    if mtp_layers < 0 or (mtp_layers and arch == "llama"):
        raise ValueError(f"mtp_layers must be >= 0 and only set for the DeepSeek archs, got {mtp_layers} for {arch}")
    if dspark and arch != "deepseek_v41":
        raise ValueError(f"dspark: the DSpark drafter is written for arch 'deepseek_v41' only, got {arch!r}")
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    if (vision or vision_overrides) and arch != "deepseek_v41":
        raise ValueError("vision: a vision tower is written for arch 'deepseek_v41' only")
    if engram_layers and arch == "llama":
        raise ValueError("engram_layers: Engram is defined for the DeepSeek archs only")
    import transformers

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok_vocab = build_tokenizer(out)
    defaults = {"deepseek_v3": DEEPSEEK_V3_DEFAULTS, "deepseek_v4": DEEPSEEK_V4_DEFAULTS}.get(arch, LLAMA_DEFAULTS)
    kwargs = {**defaults, **(overrides or {}), "initializer_range": initializer_range,
              "eos_token_id": None, "bos_token_id": None, "pad_token_id": None}
    if kwargs["vocab_size"] < tok_vocab:
        raise ValueError(f"vocab_size must be >= the tokenizer's {tok_vocab}, got {kwargs['vocab_size']}")
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    if arch == "deepseek_v41":  # no transformers release has V4.1: drawn by name (tools/tiny_v41.py)
        if mtp_layers:
            raise ValueError("deepseek_v41: mtp_layers (DSpark) are not written yet")
        config = v41_config(overrides)
        tensors = v41_tensors(config, gen)
        if dspark:
            add_dspark_v41(config, tensors, gen)
            v41_config(config["text_config"])  # the drafter's fields parse
        if vision or vision_overrides:
            add_vision_v41(config, tensors, gen, vision_overrides)
        if engram_layers:
            add_engram_v41(config, tensors, out / "tokenizer.json", list(engram_layers), gen, engram_fp8_table)
        if fp8 or fp4_experts:
            quantize_v41(config, tensors, fp8, fp4_experts)
        if fp8 and dspark:
            quantize_dspark_v41(tensors)
        (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
        _write_shards(tensors, out, num_shards)
        return out
    if arch == "deepseek_v4":
        _make_tiny_v4(out, {**kwargs, "num_nextn_predict_layers": mtp_layers}, gen, num_shards)
        if fp8 or fp4_experts:
            _quantize_v4(out, fp8, fp4_experts, num_shards)
        if engram_layers:
            add_engram(out, list(engram_layers), gen, engram, engram_fp8_table)
        return out
    if arch == "deepseek_v3":
        kwargs["num_mtp_layers"] = mtp_layers
        config = transformers.DeepseekV3Config(**kwargs)
        model_cls = transformers.DeepseekV3ForCausalLM
    else:
        config = transformers.LlamaConfig(**kwargs)
        model_cls = transformers.LlamaForCausalLM
    model = model_cls(config).float().eval()
    _perturb(model, gen)
    tensors = _hf_named_tensors(model)
    for j in range(mtp_layers):
        tensors.update(_mtp_tensors(config, config.num_hidden_layers + j, gen))
    if fp8:
        for name in [n for n in tensors if _is_quantized(n)]:
            q, scale = quantize_block_fp8(tensors[name], DEFAULT_BLOCK, scale_fmt)
            tensors[name] = q
            tensors[name + "_scale_inv"] = scale
    config.save_pretrained(str(out))
    cfg = json.loads((out / "config.json").read_text())
    cfg["architectures"] = [model_cls.__name__]
    if fp8:
        cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                      "weight_block_size": list(DEFAULT_BLOCK), "scale_fmt": scale_fmt}
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
    _write_shards(tensors, out, num_shards)
    if engram_layers:
        add_engram(out, list(engram_layers), gen, engram, engram_fp8_table)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="deepinfer make-tiny", description=__doc__.splitlines()[0])
    parser.add_argument("--arch", choices=ARCHS, required=True)
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--fp8", action="store_true", help="float8_e4m3fn weights with 128x128 block scales")
    parser.add_argument("--scale-fmt", choices=("float", "ue8m0"), default="float")
    parser.add_argument("--fp4-experts", action="store_true",
                        help="deepseek_v4: e2m1 routed experts with ue8m0 scales per 32 inputs")
    parser.add_argument("--mtp-layers", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dspark", action="store_true", help="deepseek_v41: also the DSpark drafter (mtp.{0,1,2})")
    parser.add_argument("--engram-layers", default="", help="DeepSeek archs: comma-separated layers with Engram")
    parser.add_argument("--vision", action="store_true",
                        help="deepseek_v41: a tiny vision tower + aligner (vision.*, aligner.*, image_*)")
    args = parser.parse_args(argv)
    engram_layers = [int(v) for v in args.engram_layers.split(",") if v.strip()]
    path = make_tiny(args.arch, args.out, fp8=args.fp8, mtp_layers=args.mtp_layers, seed=args.seed,
                     scale_fmt=args.scale_fmt, fp4_experts=args.fp4_experts, engram_layers=engram_layers,
                     dspark=args.dspark, vision=args.vision)
    print(f"wrote a tiny {args.arch} model to {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
