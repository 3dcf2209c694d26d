"""Building blocks of the DeepSeek-V3 family: rope (YaRN, interleaved), block-fp8 linear, MLA over the latent
paged cache, the grouped-router MoE with shared experts, and the decoder layer.

Weights are buffers that start as ``None`` and are set by ``load_weights``: a projection becomes plain
(float weight) or block-fp8 (float8_e4m3fn weight + ``weight_scale_inv``) depending on what the checkpoint
holds and on ``dequantize_fp8_at_load``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kernels.attention_metadata import AttentionMetadata
from kernels.mla import mla_decode_absorbed, mla_prefill, split_kv_b, write_latent_cache
from kernels.moe import ExpertWeights, RouterConfig, grouped_topk, moe_dynamic, moe_static
from kernels.quant import DEFAULT_BLOCK, block_fp8_linear, dequantize_block_fp8

MOE_IMPLS = ("dynamic", "static")


@dataclass(frozen=True)
class RopeSpec:
    """Rotary embedding over qk_rope_head_dim: default or YaRN, and the softmax-scale multiplier it implies."""

    inv_freq: torch.Tensor  # [P / 2] float32
    attention_factor: float  # multiplies cos and sin
    softmax_mscale: float  # the softmax scale is multiplied by it twice (mscale_all_dim); 1.0 without scaling
    interleave: bool


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def build_rope(dim: int, theta: float, params: dict | None, max_position_embeddings: int,
               interleave: bool) -> RopeSpec:
    """Same math as transformers' default / YaRN rope init and DeepSeek's ``yarn_apply_mscale``."""
    rope_type = (params or {}).get("rope_type", (params or {}).get("type", "default"))
    exponent = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float) / dim
    if rope_type == "default":
        return RopeSpec(1.0 / (theta ** exponent), 1.0, 1.0, interleave)
    if rope_type != "yarn":
        raise ValueError(f"rope type must be 'default' or 'yarn' for DeepSeek-V3, got {rope_type!r}")
    original = params["original_max_position_embeddings"]
    factor = params.get("factor") or max_position_embeddings / original
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = (_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
                            if mscale and mscale_all_dim else _yarn_mscale(factor))
    beta_fast, beta_slow = params.get("beta_fast") or 32, params.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # the ramp would divide by zero
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = theta ** exponent
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    softmax_mscale = 1.0
    if params.get("mscale_all_dim"):
        softmax_mscale = _yarn_mscale(params["factor"], params["mscale_all_dim"])
    return RopeSpec(inv_freq, float(attention_factor), softmax_mscale, interleave)


def rope_cos_sin(spec: RopeSpec, positions: torch.Tensor,  # [T] int64
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = positions[:, None].float() * spec.inv_freq.to(positions.device)[None, :]  # [T, P/2]
    return (freqs.cos() * spec.attention_factor).to(dtype), (freqs.sin() * spec.attention_factor).to(dtype)


def apply_rope(x: torch.Tensor,  # [T, heads, P]
               cos: torch.Tensor, sin: torch.Tensor,  # [T, P/2]
               interleave: bool) -> torch.Tensor:
    """Interleaved pairs (x0, x1), (x2, x3)... come out de-interleaved, as in transformers; q and k agree."""
    cos, sin = cos[:, None, :], sin[:, None, :]
    if interleave:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., dim]
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class WeightSlot(nn.Module):
    """A tensor that a checkpoint may or may not provide (MTP's own embedding / head)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("weight", None)


class BlockLinear(nn.Module):
    """Linear layer whose weight is either float or float8_e4m3fn with a per-block ``weight_scale_inv``."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 block_size: tuple[int, int] = DEFAULT_BLOCK) -> None:
        super().__init__()
        self.in_features, self.out_features, self.block_size = in_features, out_features, block_size
        self.register_buffer("weight", None)
        self.register_buffer("weight_scale_inv", None)
        self.register_buffer("bias", None)
        self.has_bias = bias

    def set_weight(self, weight: torch.Tensor,  # [out, in]
                   scale_inv: torch.Tensor | None, dtype: torch.dtype, dequantize: bool) -> None:
        if tuple(weight.shape) != (self.out_features, self.in_features):
            raise ValueError(f"weight shape {tuple(weight.shape)} != expected "
                             f"{(self.out_features, self.in_features)}")
        if scale_inv is None:
            self.weight, self.weight_scale_inv = weight.to(dtype), None
        elif dequantize:
            self.weight = dequantize_block_fp8(weight, scale_inv, self.block_size, dtype=dtype)
            self.weight_scale_inv = None
        else:
            # dequantize_block_fp8 validates the grid here, at load, not on the first forward
            dequantize_block_fp8(weight[:1, :1], scale_inv[:1, :1], self.block_size)
            self.weight, self.weight_scale_inv = weight, scale_inv.to(torch.float32)

    def dense_weight(self, dtype: torch.dtype) -> torch.Tensor:
        if self.weight_scale_inv is None:
            return self.weight.to(dtype)
        return dequantize_block_fp8(self.weight, self.weight_scale_inv, self.block_size, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in]
        if self.weight_scale_inv is None:
            y = F.linear(x, self.weight)
        else:
            y = block_fp8_linear(x, self.weight, self.weight_scale_inv, self.block_size)
        return y if self.bias is None else y + self.bias


class DenseMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, block_size: tuple[int, int]) -> None:
        super().__init__()
        self.gate_proj = BlockLinear(hidden, intermediate, block_size=block_size)
        self.up_proj = BlockLinear(hidden, intermediate, block_size=block_size)
        self.down_proj = BlockLinear(intermediate, hidden, block_size=block_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden]
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Router(nn.Module):
    def __init__(self, num_experts: int, hidden: int) -> None:
        super().__init__()
        # fp32 whatever the model dtype: the routing decision is precision sensitive
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden), requires_grad=False)
        self.register_buffer("e_score_correction_bias", torch.zeros(num_experts))


class RoutedExperts(nn.Module):
    """Stacked expert projections, filled one checkpoint expert at a time."""

    PROJS = ("gate_proj", "up_proj", "down_proj")

    def __init__(self, num_experts: int, hidden: int, intermediate: int, block_size: tuple[int, int]) -> None:
        super().__init__()
        self.num_experts, self.block_size = num_experts, block_size
        self.shapes = {"gate_proj": (intermediate, hidden), "up_proj": (intermediate, hidden),
                       "down_proj": (hidden, intermediate)}
        for proj in self.PROJS:
            self.register_buffer(proj, None)
            self.register_buffer(proj + "_scale_inv", None)

    def set_expert(self, expert: int, proj: str, weight: torch.Tensor, scale_inv: torch.Tensor | None,
                   dtype: torch.dtype, dequantize: bool) -> None:
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"expert index must be in [0, {self.num_experts}), got {expert}")
        if tuple(weight.shape) != self.shapes[proj]:
            raise ValueError(f"experts.{expert}.{proj} shape {tuple(weight.shape)} != {self.shapes[proj]}")
        if scale_inv is not None and dequantize:
            weight, scale_inv = dequantize_block_fp8(weight, scale_inv, self.block_size, dtype=dtype), None
        keep_fp8 = scale_inv is not None
        if getattr(self, proj) is None:
            self.register_buffer(proj, torch.zeros(self.num_experts, *weight.shape,
                                                   dtype=weight.dtype if keep_fp8 else dtype))
            if keep_fp8:
                self.register_buffer(proj + "_scale_inv", torch.zeros(self.num_experts, *scale_inv.shape))
        stacked, scales = getattr(self, proj), getattr(self, proj + "_scale_inv")
        if keep_fp8 != (scales is not None):
            raise ValueError(f"experts.{expert}.{proj}: experts of one layer must all be fp8 or all be plain")
        stacked[expert] = weight if keep_fp8 else weight.to(dtype)
        if keep_fp8:
            scales[expert] = scale_inv.to(torch.float32)

    def weights(self) -> ExpertWeights:
        return ExpertWeights(self.gate_proj, self.up_proj, self.down_proj, self.gate_proj_scale_inv,
                             self.up_proj_scale_inv, self.down_proj_scale_inv, self.block_size)


class MoE(nn.Module):
    def __init__(self, hidden: int, moe_intermediate: int, n_shared: int, router: RouterConfig,
                 block_size: tuple[int, int], impl: str = "dynamic") -> None:
        super().__init__()
        self.router_cfg, self.impl = router, impl
        self.gate = Router(router.num_experts, hidden)
        self.experts = RoutedExperts(router.num_experts, hidden, moe_intermediate, block_size)
        self.shared_experts = DenseMLP(hidden, moe_intermediate * n_shared, block_size) if n_shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden]
        logits = F.linear(x.float(), self.gate.weight.float())
        weights, ids = grouped_topk(logits, self.gate.e_score_correction_bias, self.router_cfg)
        run = moe_dynamic if self.impl == "dynamic" else moe_static
        y = run(x, weights, ids, self.experts.weights())
        return y if self.shared_experts is None else y + self.shared_experts(x)


@dataclass(frozen=True)
class MLADims:
    hidden: int
    num_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    attention_bias: bool
    rms_norm_eps: float

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


class MLAttention(nn.Module):
    def __init__(self, d: MLADims, rope: RopeSpec, block_size: tuple[int, int]) -> None:
        super().__init__()
        self.d, self.rope = d, rope
        # same operation order as transformers (scale * m * m) for bit-identical scores
        self.scale = d.qk_head_dim ** -0.5 * rope.softmax_mscale * rope.softmax_mscale
        if d.q_lora_rank is None:
            self.q_proj = BlockLinear(d.hidden, d.num_heads * d.qk_head_dim, block_size=block_size)
        else:
            self.q_a_proj = BlockLinear(d.hidden, d.q_lora_rank, d.attention_bias, block_size)
            self.q_a_layernorm = RMSNorm(d.q_lora_rank, 1e-6)  # transformers builds it with its default eps
            self.q_b_proj = BlockLinear(d.q_lora_rank, d.num_heads * d.qk_head_dim, block_size=block_size)
        self.kv_a_proj_with_mqa = BlockLinear(d.hidden, d.kv_lora_rank + d.qk_rope_head_dim, d.attention_bias,
                                              block_size)
        self.kv_a_layernorm = RMSNorm(d.kv_lora_rank, 1e-6)
        self.kv_b_proj = BlockLinear(d.kv_lora_rank, d.num_heads * (d.qk_nope_head_dim + d.v_head_dim),
                                     block_size=block_size)
        self.o_proj = BlockLinear(d.num_heads * d.v_head_dim, d.hidden, d.attention_bias, block_size)

    def forward(self, x: torch.Tensor,  # [T, hidden]
                cos: torch.Tensor, sin: torch.Tensor,  # [T, P/2]
                cache: torch.Tensor,  # [num_slots, R + P] this layer
                meta: AttentionMetadata) -> torch.Tensor:
        d = self.d
        num_tokens = x.shape[0]
        if d.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(num_tokens, d.num_heads, d.qk_head_dim)
        q_nope = q[..., :d.qk_nope_head_dim]
        q_rope = apply_rope(q[..., d.qk_nope_head_dim:], cos, sin, self.rope.interleave)
        kv = self.kv_a_proj_with_mqa(x)
        latent = self.kv_a_layernorm(kv[:, :d.kv_lora_rank])
        k_rope = apply_rope(kv[:, None, d.kv_lora_rank:], cos, sin, self.rope.interleave)[:, 0]
        write_latent_cache(cache, meta.slot_mapping, latent, k_rope)
        blocks = cache.view(-1, meta.block_size, cache.shape[-1])
        kv_b = self.kv_b_proj.dense_weight(x.dtype)
        if kv_b.shape[0] != d.num_heads * (d.qk_nope_head_dim + d.v_head_dim):
            raise ValueError("kv_b_proj weight does not match num_heads * (qk_nope_head_dim + v_head_dim)")
        out = x.new_zeros(num_tokens, d.num_heads, d.v_head_dim)
        nd = meta.num_decode_tokens
        if meta.num_decodes > 0:
            w_uk, w_uv = split_kv_b(kv_b, d.num_heads, d.qk_nope_head_dim)
            shape = (meta.num_decodes, meta.decode_query_len, d.num_heads)
            out[:nd] = mla_decode_absorbed(
                q_nope[:nd].reshape(*shape, -1), q_rope[:nd].reshape(*shape, -1), blocks,
                meta.decode_block_tables, meta.decode_seq_lens, w_uk, w_uv, self.scale).flatten(0, 1)
        start = nd
        for i in range(meta.num_prefills):
            end = start + meta.prefill_query_lens[i]
            out[start:end] = mla_prefill(q_nope[start:end], q_rope[start:end], blocks,
                                         meta.prefill_block_tables[i], meta.prefill_seq_lens[i], kv_b, self.scale)
            start = end
        return self.o_proj(out.flatten(1))


class DecoderLayer(nn.Module):
    def __init__(self, attn: MLAttention, mlp: nn.Module, hidden: int, eps: float) -> None:
        super().__init__()
        self.self_attn, self.mlp = attn, mlp
        self.input_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)

    def forward(self, x: torch.Tensor,  # [T, hidden]
                cos: torch.Tensor, sin: torch.Tensor, cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class SharedHead(nn.Module):
    def __init__(self, hidden: int, eps: float) -> None:
        super().__init__()
        self.norm = RMSNorm(hidden, eps)
        self.head = WeightSlot()


class MTPLayer(DecoderLayer):
    """DeepSeek-V3 multi-token-prediction module (checkpoint layer index num_hidden_layers + j).

    Only holds weights here; the speculative-decoding proposer runs it: ``eh_proj(cat(enorm(embed(t)),
    hnorm(h)))`` -> this decoder layer -> ``shared_head``. ``embed_tokens`` / ``shared_head.head`` stay
    ``None`` when the checkpoint omits them (then the main model's are used).
    """

    def __init__(self, attn: MLAttention, mlp: nn.Module, hidden: int, eps: float,
                 block_size: tuple[int, int]) -> None:
        super().__init__(attn, mlp, hidden, eps)
        self.enorm = RMSNorm(hidden, eps)
        self.hnorm = RMSNorm(hidden, eps)
        self.eh_proj = BlockLinear(2 * hidden, hidden, block_size=block_size)
        self.embed_tokens = WeightSlot()
        self.shared_head = SharedHead(hidden, eps)
