"""``deepinfer make-tiny --arch deepseek_v41 --dspark``: the tiny V4.1's DSpark drafter, ``mtp.{0,1,2}``, in the
release's names (design note ``DEEPSEEK_V41.md`` section 3; NeMo AutoModel's ``deepseek_v41/dspark.py``): each
``mtp.j`` a full window-only V4.1 block (``attn.*`` without compressor or indexer, ``hc_{attn,ffn}_*``,
``ffn.gate.{weight,bias,bias_vl}``, ``dspark_n_routed_experts`` experts and the shared one), ``mtp.0.main_proj``
[hidden, n * hidden] and ``main_norm``, on the last ``mtp`` the final ``norm``, ``markov_head.{embed,head}``
[vocab, rank] and ``confidence_head.proj`` [1, hidden + rank] (fp32, no bias). Config: the ``dspark_*`` fields and
three window-only (0) entries appended to ``compress_ratios``. The tiny target's last three layers feed the drafter,
as the release's [37, 38, 39] of 40 do."""
from __future__ import annotations

import re
from typing import Any

import torch

from backend_lib.tools.tiny_v41 import _linear

DSPARK_DEFAULTS: dict[str, Any] = dict(num_nextn_predict_layers=3, dspark_block_size=4, dspark_markov_rank=16,
                                       dspark_n_routed_experts=4, dspark_num_experts_per_tok=2)


def add_dspark_v41(config: dict[str, Any], tensors: dict[str, torch.Tensor], gen: torch.Generator,
                   std: float = 2.0) -> None:
    """In place: the drafter's config fields and ``mtp.*`` tensors (random, unit-scale like the target's)."""
    text = config["text_config"]
    text["num_nextn_predict_layers"] = text.get("num_nextn_predict_layers") or 3  # the tiny target's default is 0
    for name, value in DSPARK_DEFAULTS.items():  # an override (make_tiny's ``overrides``) wins
        text.setdefault(name, value)
    n, layers = text["num_hidden_layers"], text["num_nextn_predict_layers"]
    text.setdefault("dspark_noise_token_id", text["vocab_size"] - 2)  # vocab - 1 is the tiny image token
    text.setdefault("dspark_target_layer_ids", [n - 3, n - 2, n - 1])
    text["compress_ratios"] = list(text["compress_ratios"][:n]) + [0] * layers
    h, hd, hc, heads = text["hidden_size"], text["head_dim"], text["hc_mult"], text["num_attention_heads"]
    q_rank, o_rank, groups = text["q_lora_rank"], text["o_lora_rank"], text["o_groups"]
    experts, inter, rank = text["dspark_n_routed_experts"], text["moe_intermediate_size"], text["dspark_markov_rank"]
    vocab, mix = text["vocab_size"], (2 + hc) * hc

    def norm(dim: int) -> torch.Tensor:
        return 1 + 0.1 * torch.randn(dim, generator=gen)

    for j in range(layers):
        p = f"mtp.{j}."
        tensors[p + "attn_norm.weight"], tensors[p + "ffn_norm.weight"] = norm(h), norm(h)
        for site in ("attn", "ffn"):
            tensors[f"{p}hc_{site}_fn"] = 0.5 * _linear(mix, hc * h, 1.0, gen)
            tensors[f"{p}hc_{site}_base"] = 0.5 * torch.randn(mix, generator=gen)
            tensors[f"{p}hc_{site}_scale"] = 1 + 0.2 * torch.randn(3, generator=gen)
        tensors[p + "attn.wq_a.weight"] = _linear(q_rank, h, std, gen)
        tensors[p + "attn.q_norm.weight"] = norm(q_rank)
        tensors[p + "attn.wq_b.weight"] = _linear(heads * hd, q_rank, std, gen)
        tensors[p + "attn.wkv.weight"] = _linear(hd, h, std, gen)
        tensors[p + "attn.kv_norm.weight"] = norm(hd)
        tensors[p + "attn.wo_a.weight"] = _linear(groups * o_rank, heads * hd // groups, std, gen)
        tensors[p + "attn.wo_b.weight"] = _linear(h, groups * o_rank, std, gen)
        tensors[p + "attn.attn_sink"] = torch.randn(heads, generator=gen)
        tensors[p + "ffn.gate.weight"] = _linear(experts, h, std, gen)
        tensors[p + "ffn.gate.bias"] = 0.05 * torch.randn(experts, generator=gen)
        tensors[p + "ffn.gate.bias_vl"] = 0.05 * torch.randn(experts, generator=gen)
        for e in [f"ffn.experts.{k}." for k in range(experts)] + ["ffn.shared_experts."]:
            tensors[f"{p}{e}w1.weight"] = _linear(inter, h, std, gen)
            tensors[f"{p}{e}w3.weight"] = _linear(inter, h, std, gen)
            tensors[f"{p}{e}w2.weight"] = _linear(h, inter, std, gen)
    sources = len(text["dspark_target_layer_ids"])
    tensors["mtp.0.main_proj.weight"] = _linear(h, sources * h, std, gen)
    tensors["mtp.0.main_norm.weight"] = norm(h)
    last = f"mtp.{layers - 1}."
    tensors[last + "norm.weight"] = norm(h)
    tensors[last + "markov_head.embed.weight"] = torch.randn(vocab, rank, generator=gen)
    tensors[last + "markov_head.head.weight"] = _linear(vocab, rank, std, gen)
    tensors[last + "confidence_head.proj.weight"] = _linear(1, h + rank, 1.0, gen)


_FP8 = re.compile(r"^mtp\.\d+\.(attn\.(wq_a|wq_b|wkv|wo_a|wo_b)|ffn\.shared_experts\.w[123])\.weight$")


def quantize_dspark_v41(tensors: dict[str, torch.Tensor]) -> None:
    """In place, with ``--fp8``: the draft blocks' attention and shared-expert projections fp8 e4m3 over 32x32 ue8m0
    blocks as the target's (vLLM loads ``mtp.*`` through the checkpoint's quantization config); their routed
    experts follow the target's (tiny_v41.quantize_v41 matches every ``.ffn.experts.``)."""
    from kernels.quant import quantize_block_fp8

    for name in [n for n in tensors if _FP8.match(n)]:
        tensors[name], tensors[name[: -len(".weight")] + ".scale"] = quantize_block_fp8(tensors[name], (32, 32),
                                                                                         "ue8m0")
