"""Building blocks of the DeepSeek-V3 family: rope (YaRN, interleaved), block-fp8 linear, MLA over the latent
paged cache, the dense MLP and the decoder layer (the grouped-router MoE: deepseek_moe.py).

Weights are buffers that start as ``None`` and are set by ``load_weights``: a projection becomes plain
(float weight) or block-fp8 (float8_e4m3fn weight + ``weight_scale_inv``) depending on what the checkpoint
holds and on ``dequantize_fp8_at_load``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from backend_lib.models.context_parallel import mla_context_attention
from backend_lib.models.parallel import ParallelContext, Shard, read_shard
from kernels.attention_metadata import AttentionMetadata
from kernels.gemv import TILE, GemvPolicy, block_weight, blocked_linear, gemv_available
from kernels.mla import mla_decode_absorbed, mla_prefill, split_kv_b, write_latent_cache
from kernels.mla_fp8 import MLARecord
from kernels.packed_gemm import packed_kernels_available, packed_linear_buffers
from kernels.packed_weights import PackedFp8, pack_fp8
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
        self.cpp = False  # host engines with the C++ ops (DeepSeek-V4's use_cpu_attention): one call eagerly

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., dim]
        if (self.cpp and self.weight.dtype == torch.float32 and x.dtype in (torch.float32, torch.bfloat16)
                and not torch.compiler.is_compiling()):
            return torch.ops.deepinfer.rms_norm(x, self.weight, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.weight.dtype == torch.float32:  # DeepSeek-V4 keeps its norm weights in fp32 and rounds once after
            return (self.weight * xf).to(x.dtype)  # the product (transformers' DeepseekV4RMSNorm)
        return self.weight * xf.to(x.dtype)  # V3 (transformers' DeepseekV3RMSNorm): the weight in the model dtype


class WeightSlot(nn.Module):
    """A tensor that a checkpoint may or may not provide (MTP's own embedding / head)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("weight", None)


def take_block_fp8(weight: Any,  # [out, in] float8_e4m3fn, possibly lazy
                   scale_inv: Any,  # [ceil(out/b0), ceil(in/b1)]
                   shard: Shard, block_size: tuple[int, int],
                   dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    """This rank's part of a block-fp8 weight and its scale grid. A shard that starts on a block edge, or lies
    inside one block, keeps its own grid (fp8 stays fp8); one that cuts a block elsewhere has no grid of its own,
    so it is dequantized (the same values, in ``dtype``) and its scale is None."""
    b = block_size[shard.dim]
    first, last = shard.start // b, (shard.start + shard.size - 1) // b
    scales = scale_inv.narrow(shard.dim, first, last - first + 1)
    if shard.start % b == 0 or first == last:
        return shard.take(weight), read_shard(scales, None)
    covered = min((last + 1) * b, weight.shape[shard.dim]) - first * b
    region = dequantize_block_fp8(weight.narrow(shard.dim, first * b, covered), read_shard(scales, None),
                                  block_size, dtype=dtype)
    return region.narrow(shard.dim, shard.start - first * b, shard.size), None


class BlockLinear(nn.Module):
    """Linear layer whose weight is either float or float8_e4m3fn with a per-block ``weight_scale_inv``.

    ``shard`` says which part of the checkpoint weight this rank keeps (rows: column-parallel; columns:
    row-parallel); the layer's own shape is the shard's."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 block_size: tuple[int, int] = DEFAULT_BLOCK, shard: Shard | None = None) -> None:
        super().__init__()
        self.shard = shard
        if shard is not None:
            in_features, out_features = (in_features, shard.size) if shard.dim == 0 else (shard.size, out_features)
        self.in_features, self.out_features, self.block_size = in_features, out_features, block_size
        self.register_buffer("weight", None)
        self.register_buffer("weight_scale_inv", None)
        self.register_buffer("bias", None)
        self.has_bias = bias
        # host engines: the weight again in kernels/gemv.py's blocked layout (``block_for_cpu``), for few-row calls
        self.register_buffer("blocked", None, persistent=False)
        self.gemv_policy = GemvPolicy()
        # weight_format=packed: fp8 codes in kernels/packed_weights.py's tiles, the only copy (``weight`` then an
        # empty [0, in] placeholder); buffers, so compiled regions take them as graph inputs
        self.quantized: PackedFp8 | None = None
        self.register_buffer("quantized_data", None, persistent=False)
        self.register_buffer("quantized_scales", None, persistent=False)

    def set_weight(self, weight: Any,  # [out, in] of the checkpoint, possibly lazy
                   scale_inv: Any, dtype: torch.dtype, dequantize: bool, packed: bool = False) -> None:
        if self.shard is not None and packed and scale_inv is not None:
            b, full = self.block_size[self.shard.dim], weight.shape[self.shard.dim]
            end = self.shard.start + self.shard.size
            if self.shard.start % b or (end % b and end != full):
                raise ValueError(f"weight_format=packed: the tensor-parallel split [{self.shard.start}, {end}) of "
                                 f"dim {self.shard.dim} of a {tuple(weight.shape)} fp8 weight is not on its {b}-wide "
                                 "blocks; use weight_format=dequantize or another tensor_parallel_size")
        if self.shard is not None:
            if scale_inv is None:
                weight = self.shard.take(weight)
            else:
                weight, scale_inv = take_block_fp8(weight, scale_inv, self.shard, self.block_size, dtype)
        weight, scale_inv = read_shard(weight, None), None if scale_inv is None else read_shard(scale_inv, None)
        if tuple(weight.shape) != (self.out_features, self.in_features):
            raise ValueError(f"weight shape {tuple(weight.shape)} != expected "
                             f"{(self.out_features, self.in_features)}")
        if scale_inv is None:
            self.weight, self.weight_scale_inv = weight.to(dtype), None
        elif dequantize:
            self.weight = dequantize_block_fp8(weight, scale_inv, self.block_size, dtype=dtype)
            self.weight_scale_inv = None
        elif packed:
            self.quantized = pack_fp8(weight, scale_inv.to(torch.float32), self.block_size)
            self.quantized_data, self.quantized_scales = self.quantized.data, self.quantized.scales
            self.quantized_kernel = packed_kernels_available()  # built and logged at load
            self.weight, self.weight_scale_inv = weight.new_empty(0, self.in_features), None
        else:
            # dequantize_block_fp8 validates the grid here, at load, not on the first forward
            dequantize_block_fp8(weight[:1, :1], scale_inv[:1, :1], self.block_size)
            self.weight, self.weight_scale_inv = weight, scale_inv.to(torch.float32)

    def rebind_quantized(self) -> None:  # as layers.Linear.rebind_quantized
        self.quantized = PackedFp8(self.quantized_data, self.quantized_scales, self.quantized.out_features,
                                   self.quantized.in_features, self.quantized.block_size)

    def dense_weight(self, dtype: torch.dtype) -> torch.Tensor:
        if self.quantized is not None:
            return self.quantized.dequantize().to(dtype)
        if self.weight_scale_inv is None:
            return self.weight.to(dtype)
        return dequantize_block_fp8(self.weight, self.weight_scale_inv, self.block_size, dtype=dtype)

    def block_for_cpu(self, policy: GemvPolicy) -> bool:
        """Few-row calls (``policy``) on the blocked kernel: fp32 / bf16 weights on the host CPU with the C++ ops
        built (fp8 weights keep their block-scaled path). One more copy of the weight, as ``weight`` stays for
        ``dense_weight`` and state dicts. False when it does not apply."""
        if (self.weight is None or self.weight_scale_inv is not None or self.quantized is not None
                or not gemv_available(self.weight.device, self.weight.dtype)):
            return False
        self.register_buffer("blocked", block_weight(self.weight), persistent=False)
        self.gemv_policy = policy
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in]
        if self.quantized is not None:  # fp8 widened in registers: block_fp8_linear's function up to summation order
            y = packed_linear_buffers(x.reshape(-1, x.shape[-1]), self.quantized_data, self.quantized_scales, None,
                                      self.quantized, self.quantized_kernel, "fp32")
            y = y.view(*x.shape[:-1], self.out_features)
        elif (self.blocked is not None and x.dtype == self.weight.dtype
                and self.gemv_policy.use_blocked(x.numel() // x.shape[-1])):
            y = blocked_linear(x.reshape(-1, x.shape[-1]), self.blocked, None, self.out_features)
            y = y.view(*x.shape[:-1], self.out_features)
        elif self.weight_scale_inv is None:
            y = F.linear(x, self.weight)
        else:
            y = block_fp8_linear(x, self.weight, self.weight_scale_inv, self.block_size)
        return y if self.bias is None else y + self.bias


def fuse_blocked(*linears: BlockLinear) -> torch.Tensor | None:
    """One blocked weight for projections of the same input, their outputs side by side (``fused_linear``); every
    one but the last must fill whole 16-row tiles. None when that does not hold or one is not blocked."""
    if any(linear.blocked is None for linear in linears) or any(linear.out_features % TILE for linear in linears[:-1]):
        return None
    return torch.cat([linear.blocked for linear in linears])


def fused_linear(x: torch.Tensor,  # [T, in]
                 fused: torch.Tensor | None,  # fuse_blocked(*linears)
                 linears: tuple[BlockLinear, ...]) -> torch.Tensor:  # [T, sum of out_features]
    """The projections' outputs concatenated: one few-row GEMM over ``fused`` where the first's policy takes the
    rows (each output the bits of its own call: tiles are independent), else one call each."""
    first = linears[0]
    if fused is not None and x.dtype == first.weight.dtype and first.gemv_policy.use_blocked(x.shape[0]):
        return blocked_linear(x, fused, None, sum(linear.out_features for linear in linears))
    return torch.cat([linear(x) for linear in linears], dim=-1)


class DenseMLP(nn.Module):
    """gate/up column-parallel, down row-parallel. With ``reduce`` the ranks' partial sums are all-reduced here;
    without, the owner does it (a MoE adds its shared expert's partial sum to the routed one and reduces once)."""

    def __init__(self, hidden: int, intermediate: int, block_size: tuple[int, int], par: ParallelContext,
                 reduce: bool = True) -> None:
        super().__init__()
        self.par, self.reduce = par, reduce
        start, size = par.even(intermediate, "the MLP intermediate size")
        rows, columns = Shard(0, start, size), Shard(1, start, size)
        self.gate_proj = BlockLinear(hidden, intermediate, block_size=block_size, shard=rows)
        self.up_proj = BlockLinear(hidden, intermediate, block_size=block_size, shard=rows)
        self.down_proj = BlockLinear(intermediate, hidden, block_size=block_size, shard=columns)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden]
        y = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return self.par.all_reduce(y) if self.reduce else y


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
    """MLA with its heads split across tensor-parallel ranks. The latent (``kv_a_proj_with_mqa``) is shared by
    all heads, so every rank computes and caches the whole latent of its requests; the per-head up-projections
    (``q_b_proj``, ``kv_b_proj``) are column-parallel and ``o_proj`` row-parallel, joined by one all-reduce."""

    def __init__(self, d: MLADims, rope: RopeSpec, block_size: tuple[int, int], par: ParallelContext) -> None:
        super().__init__()
        self.par = par
        head_start, local_heads = par.even(d.num_heads, "num_attention_heads")
        total_heads, self.rope = d.num_heads, rope
        self.d = d = MLADims(**{**d.__dict__, "num_heads": local_heads})
        # same operation order as transformers (scale * m * m) for bit-identical scores
        self.scale = d.qk_head_dim ** -0.5 * rope.softmax_mscale * rope.softmax_mscale

        def head_rows(per_head: int) -> Shard:
            return Shard(0, head_start * per_head, local_heads * per_head)

        if d.q_lora_rank is None:
            self.q_proj = BlockLinear(d.hidden, total_heads * d.qk_head_dim, block_size=block_size,
                                      shard=head_rows(d.qk_head_dim))
        else:
            self.q_a_proj = BlockLinear(d.hidden, d.q_lora_rank, d.attention_bias, block_size)
            self.q_a_layernorm = RMSNorm(d.q_lora_rank, 1e-6)  # transformers builds it with its default eps
            self.q_b_proj = BlockLinear(d.q_lora_rank, total_heads * d.qk_head_dim, block_size=block_size,
                                        shard=head_rows(d.qk_head_dim))
        self.kv_a_proj_with_mqa = BlockLinear(d.hidden, d.kv_lora_rank + d.qk_rope_head_dim, d.attention_bias,
                                              block_size)
        self.kv_a_layernorm = RMSNorm(d.kv_lora_rank, 1e-6)
        self.kv_b_proj = BlockLinear(d.kv_lora_rank, total_heads * (d.qk_nope_head_dim + d.v_head_dim),
                                     block_size=block_size, shard=head_rows(d.qk_nope_head_dim + d.v_head_dim))
        # Its bias is added once, on the driver, before the all-reduce.
        self.o_proj = BlockLinear(total_heads * d.v_head_dim, d.hidden, d.attention_bias and par.is_driver,
                                  block_size, shard=Shard(1, head_start * d.v_head_dim, local_heads * d.v_head_dim))
        self.record: MLARecord | None = None  # fp8 KV cache (kv_cache_dtype=fp8_e4m3): the latent record layout

    def forward(self, x: torch.Tensor,  # [T, hidden]
                cos: torch.Tensor, sin: torch.Tensor,  # [T, P/2]
                cache: torch.Tensor,  # [num_slots, R + P] this layer
                meta: AttentionMetadata) -> torch.Tensor:
        d = self.d
        if d.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        kv = self.kv_a_proj_with_mqa(x)
        if meta.context is not None:  # context parallelism: every row's q and latent, then the held keys
            q, kv = self.par.context.gather_rows(torch.cat([q, kv], dim=-1), meta.context.row_counts).split(
                [q.shape[-1], kv.shape[-1]], dim=-1)
        num_tokens = q.shape[0]
        q = q.view(num_tokens, d.num_heads, d.qk_head_dim)
        q_nope = q[..., :d.qk_nope_head_dim]
        q_rope = apply_rope(q[..., d.qk_nope_head_dim:], cos, sin, self.rope.interleave)
        latent = self.kv_a_layernorm(kv[:, :d.kv_lora_rank])
        k_rope = apply_rope(kv[:, None, d.kv_lora_rank:], cos, sin, self.rope.interleave)[:, 0]
        write_latent_cache(cache, meta.slot_mapping, latent, k_rope, self.record)
        blocks = cache.view(-1, meta.block_size, cache.shape[-1])
        kv_b = self.kv_b_proj.dense_weight(x.dtype)
        if kv_b.shape[0] != d.num_heads * (d.qk_nope_head_dim + d.v_head_dim):
            raise ValueError("kv_b_proj weight does not match num_heads * (qk_nope_head_dim + v_head_dim)")
        if meta.context is not None:
            w_uk, w_uv = split_kv_b(kv_b, d.num_heads, d.qk_nope_head_dim)
            out = mla_context_attention(q_nope, q_rope, blocks, w_uk, w_uv, meta, self.scale, self.par.context,
                                        self.record)
            return self.par.all_reduce(self.o_proj(out.to(x.dtype).flatten(1)))
        out = x.new_zeros(num_tokens, d.num_heads, d.v_head_dim)
        nd = meta.num_decode_tokens
        if meta.num_decodes > 0:
            w_uk, w_uv = split_kv_b(kv_b, d.num_heads, d.qk_nope_head_dim)
            shape = (meta.num_decodes, meta.decode_query_len, d.num_heads)
            out[:nd] = mla_decode_absorbed(
                q_nope[:nd].reshape(*shape, -1), q_rope[:nd].reshape(*shape, -1), blocks,
                meta.decode_block_tables, meta.decode_seq_lens, w_uk, w_uv, self.scale, self.record).flatten(0, 1)
        start = nd
        for i in range(meta.num_prefills):
            end = start + meta.prefill_query_lens[i]
            out[start:end] = mla_prefill(q_nope[start:end], q_rope[start:end], blocks,
                                         meta.prefill_block_tables[i], meta.prefill_seq_lens[i], kv_b, self.scale,
                                         self.record)
            start = end
        return self.par.all_reduce(self.o_proj(out.flatten(1)))


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
