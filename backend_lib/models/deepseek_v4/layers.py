"""DeepSeek-V4 feed-forward and decoder layer: hash-routed and top-k MoE with a clipped SwiGLU, and the mHC residual.

MoE: the router scores experts with ``sqrtsoftplus`` (or sigmoid / softmax); ``moe`` layers pick the top-k of the
scores plus the correction bias, ``hash_moe`` layers take a fixed ``tid2eid[token id]`` table; either way the chosen
experts' raw scores are renormalized and scaled by ``routed_scaling_factor``. Every SwiGLU (routed experts and the
one shared expert) clamps the gate from above and the up projection on both sides at ``swiglu_limit``.

Tensor parallelism: each expert's intermediate units (and the shared expert's) are split across ranks, or with
expert parallelism whole experts are; either way every rank's output is a partial sum, joined by one all-reduce.
With EPLB the top-k layers' experts are placement slots (models/expert_slots.py); the hash-routed layers keep their
contiguous ranges: ``tid2eid`` fixes their routing by token id, so a placement built from measured loads would only
follow the token mix, and their loads are not counted.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from backend_lib.models.deepseek_v3.layers import BlockLinear, RMSNorm
from backend_lib.models.deepseek_v4.attention import LayerCache, StepContext, V4Attention
from backend_lib.models.expert_slots import ExpertSlots
from backend_lib.models.layers import PackedExpertsSummary
from backend_lib.models.parallel import ParallelContext, Shard
from kernels.fp4 import FP4_GROUP, dequantize_fp4
from kernels.gemv import gemv_available
from kernels.grouped_experts import (
    block_experts, blocked_grouped_experts, clipped_swiglu, grouped_experts, grouped_experts_op, has_grouped_mm,
)
from kernels.hyper_connections import HyperConnectionSpec, hc_post, hc_pre
from kernels.packed_gemm import packed_kernels_available, packed_linear_buffers
from kernels.packed_weights import PackedFp4, pack_fp4
from kernels.quant import DEFAULT_BLOCK, dequantize_block_fp8

SCORING_FUNCS = ("sqrtsoftplus", "sigmoid", "softmax")
MOE_IMPLS = ("dynamic", "static")
HASH_MOE, TOPK_MOE = "hash_moe", "moe"


@dataclass(frozen=True)
class V4MoEDims:
    hidden: int
    intermediate: int  # moe_intermediate_size (routed experts and the shared expert)
    num_experts: int
    top_k: int
    vocab_size: int
    routed_scaling_factor: float
    scoring_func: str
    swiglu_limit: float
    hash_routed: bool


def expert_scores(logits: torch.Tensor, scoring_func: str) -> torch.Tensor:  # [T, E] float32
    if scoring_func == "sqrtsoftplus":
        return F.softplus(logits).sqrt()
    if scoring_func == "sigmoid":
        return logits.sigmoid()
    return logits.softmax(dim=-1)


class SharedExpert(nn.Module):
    def __init__(self, d: V4MoEDims, par: ParallelContext, block_size: tuple[int, int]) -> None:
        super().__init__()
        self.limit = d.swiglu_limit
        start, size = par.even(d.intermediate, "moe_intermediate_size")
        self.w1 = BlockLinear(d.hidden, size, block_size=block_size)
        self.w3 = BlockLinear(d.hidden, size, block_size=block_size)
        self.w2 = BlockLinear(size, d.hidden, block_size=block_size)
        self.shards = {"w1.weight": Shard(0, start, size), "w3.weight": Shard(0, start, size),
                       "w2.weight": Shard(1, start, size)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> partial [T, hidden]
        return self.w2(clipped_swiglu(self.w1(x), self.w3(x), self.limit))


class V4MoE(nn.Module):
    """Router + this rank's routed experts (stacked ``gate_up`` [E, 2I, H] and ``down`` [E, H, I]) + shared expert.

    ``packed_fp4``: the experts stay as the checkpoint stores them (int8 with two e2m1 codes per byte,
    ``gate_up`` [E, 2I, H/2] and ``down`` [E, H, I/2], ue8m0 scales per 32 inputs in ``*_scale``), a quarter of the
    fp16 bytes; each expert is dequantized in one vectorized op when it runs. Otherwise they are dense."""

    def __init__(self, d: V4MoEDims, par: ParallelContext, block_size: tuple[int, int] = DEFAULT_BLOCK,
                 impl: str = "dynamic", packed_fp4: bool = False) -> None:
        super().__init__()
        if d.scoring_func not in SCORING_FUNCS:
            raise ValueError(f"scoring_func must be one of {SCORING_FUNCS}, got {d.scoring_func!r}")
        self.d, self.par, self.impl = d, par, impl
        self.slots: ExpertSlots | None = None
        if par.eplb_redundant_experts is not None and not d.hash_routed:
            self.slots = ExpertSlots(d.num_experts, par)
            self.first_expert, self.num_local_experts = 0, self.slots.slots_per_rank
            self.inter_start, self.inter_size = 0, d.intermediate
        elif par.expert_parallel:
            self.first_expert, self.num_local_experts = par.balanced(d.num_experts, "n_routed_experts")
            self.inter_start, self.inter_size = 0, d.intermediate
        else:
            self.first_expert, self.num_local_experts = 0, d.num_experts
            self.inter_start, self.inter_size = par.even(d.intermediate, "moe_intermediate_size")
        self.gate = nn.Module()
        self.gate.weight = nn.Parameter(torch.zeros(d.num_experts, d.hidden), requires_grad=False)
        if d.hash_routed:
            self.gate.register_buffer("tid2eid", torch.zeros(d.vocab_size, d.top_k, dtype=torch.int64))
        else:
            self.gate.register_buffer("bias", torch.zeros(d.num_experts))
        self.packed_fp4, self.block_size = packed_fp4, block_size
        num, inter = self.num_local_experts, self.inter_size
        if packed_fp4:
            if d.hidden % FP4_GROUP or inter % FP4_GROUP:
                raise ValueError(f"fp4 experts need hidden_size ({d.hidden}) and this rank's moe_intermediate_size "
                                 f"({inter}) to be multiples of {FP4_GROUP}")
            self.register_buffer("gate_up", torch.zeros(num, 2 * inter, d.hidden // 2, dtype=torch.int8))
            self.register_buffer("gate_up_scale", torch.zeros(num, 2 * inter, d.hidden // FP4_GROUP))
            self.register_buffer("down", torch.zeros(num, d.hidden, inter // 2, dtype=torch.int8))
            self.register_buffer("down_scale", torch.zeros(num, d.hidden, inter // FP4_GROUP))
        else:
            self.register_buffer("gate_up", torch.zeros(num, 2 * inter, d.hidden))
            self.register_buffer("down", torch.zeros(num, d.hidden, inter))
        self.shared_experts = SharedExpert(d, par, block_size)
        # host engines: the static MoE of compiled regions runs the grouped experts as one opaque op (same work and
        # results as eager) instead of every expert over every token; Neuron graphs keep the einsums
        self.opaque_experts = False
        # host engines: the experts again in kernels/gemv.py's blocked layout for the C++ grouped op (block_experts)
        self.register_buffer("gate_up_blocked", None, persistent=False)
        self.register_buffer("down_blocked", None, persistent=False)
        # weight_format=packed (pack_experts): each fp4 expert in the packed GEMM's tiles, [E, tiles, in / 2, 16]
        # codes and [E, tiles, in / 32, 16] e8m0 scales, the only copy
        self.packed_shapes: dict[str, tuple[int, int]] = {}  # "gate_up" / "down" -> (out, in) of one expert
        self.packed_kernel = False
        for which in ("gate_up", "down"):
            self.register_buffer(f"{which}_tiles", None, persistent=False)
            self.register_buffer(f"{which}_tile_scales", None, persistent=False)

    def pack_experts(self) -> None:
        """weight_format=packed, after loading: the fp4 stacks repacked once into the packed GEMM's 16-row tiles
        (kernels/packed_weights.py: a permutation of the same bytes); the int8 stacks are dropped."""
        if not self.packed_fp4:
            return
        for which in ("gate_up", "down"):
            codes, scale = getattr(self, which), getattr(self, which + "_scale")
            packs = [pack_fp4(codes[e], scale[e]) for e in range(codes.shape[0])]
            self.packed_shapes[which] = (codes.shape[1], 2 * codes.shape[2])
            setattr(self, f"{which}_tiles", torch.stack([p.data for p in packs]))
            setattr(self, f"{which}_tile_scales", torch.stack([p.scales for p in packs]))
            setattr(self, which, codes.new_empty(0, *codes.shape[1:]))
            setattr(self, which + "_scale", scale.new_empty(0, *scale.shape[1:]))
        self.packed_kernel = packed_kernels_available()

    def packed_experts_bytes(self) -> tuple[int, int]:
        """(weights, resident bytes) of the packed experts (the load log's count; layers.resident_weight_bytes)."""
        weights = sum(self.num_local_experts * out * inp for out, inp in self.packed_shapes.values())
        tensors = [getattr(self, f"{w}_{k}") for w in self.packed_shapes for k in ("tiles", "tile_scales")]
        return weights, sum(t.numel() * t.element_size() for t in tensors)

    def packed_experts_summary(self) -> PackedExpertsSummary | None:
        """The load log's entry (layers.describe_weight_formats); None unless the experts are packed fp4 tiles."""
        if not self.packed_shapes:
            return None
        return PackedExpertsSummary(PackedFp4.fmt, self.num_local_experts, *self.packed_experts_bytes())

    def _expert_weight(self, which: str, expert: int) -> PackedFp4:
        out, inp = self.packed_shapes[which]
        return PackedFp4(getattr(self, f"{which}_tiles")[expert], getattr(self, f"{which}_tile_scales")[expert],
                         out, inp)

    def _expert_linear(self, x: torch.Tensor,  # [T, in]
                       which: str, expert: int) -> torch.Tensor:  # [T, out]
        """One expert's projection: the packed GEMM (fp32 widening: dequantize's function up to summation order) on
        its tiles, or plain F.linear on the dequantized expert."""
        if not self.packed_shapes:
            return F.linear(x, self._dense(which, x.dtype, expert))
        weight = self._expert_weight(which, expert)
        return packed_linear_buffers(x, weight.data, weight.scales, None, weight, self.packed_kernel, "fp32")

    def block_experts(self) -> bool:
        """Lay the dense experts out for ``deepinfer::blocked_grouped_experts`` (host CPU, fp32 / bf16, the C++ ops
        built); eager and compiled steps then run it. One more copy of the experts, as the blocked projections keep
        ``weight``: the dense stacks stay for state dicts and the other paths. False when it does not apply."""
        if self.packed_fp4 or not gemv_available(self.gate_up.device, self.gate_up.dtype):
            return False
        self.register_buffer("gate_up_blocked", block_experts(self.gate_up), persistent=False)
        self.register_buffer("down_blocked", block_experts(self.down), persistent=False)
        return True

    # ---- loading ---------------------------------------------------------------------------------------
    def local_slots(self, expert: int) -> list[int]:
        """This rank's stack indices holding a checkpoint expert (several with EPLB copies; none: another rank's)."""
        if not 0 <= expert < self.d.num_experts:
            raise ValueError(f"expert index must be in [0, n_routed_experts={self.d.num_experts}), got {expert}")
        if self.slots is not None:
            return self.slots.local_slots(expert)
        local = expert - self.first_expert
        return [local] if 0 <= local < self.num_local_experts else []

    def held_experts(self) -> set[int]:
        """The checkpoint experts this rank loads."""
        if self.slots is not None:
            return self.slots.held_experts()
        return set(range(self.first_expert, self.first_expert + self.num_local_experts))

    def slot_tensors(self) -> dict[str, torch.Tensor]:
        """Every per-expert stack as stored (dense, fp4 codes and scales, packed tiles, blocked copies), dim 0 the
        stack index: what an EPLB re-placement moves (the emptied fp4 stacks of pack_experts excluded)."""
        names = [w + suffix for w in ("gate_up", "down")
                 for suffix in ("", "_scale", "_blocked", "_tiles", "_tile_scales")]
        tensors = {n: getattr(self, n, None) for n in names}
        return {n: t for n, t in tensors.items() if t is not None and t.shape[0] == self.num_local_experts}

    def set_expert(self, local: int, proj: str, weight,  # checkpoint (maybe lazy) tensor: dense, fp8 or packed fp4
                   scale=None) -> None:  # its scales (fp8 block grid, or fp4 per 32 inputs), None when dense
        hidden, inter, start, size = self.d.hidden, self.d.intermediate, self.inter_start, self.inter_size
        name = f"experts.{local + self.first_expert}.{proj}"
        fp4 = scale is not None and weight.dtype in (torch.int8, torch.uint8)
        rows, cols = (hidden, inter) if proj == "w2" else (inter, hidden)
        expected = (rows, cols // 2) if fp4 else (rows, cols)
        if tuple(weight.shape) != expected:
            raise ValueError(f"{name}: shape {tuple(weight.shape)} != {expected}")
        if fp4 and self.packed_fp4:
            if proj == "w2" and (start % FP4_GROUP or size % FP4_GROUP):
                raise ValueError(f"{name}: this rank's intermediate slice [{start}, {start + size}) does not fall on "
                                 f"the {FP4_GROUP}-wide fp4 scale groups")
            codes, scales = ((Shard(1, start // 2, size // 2), Shard(1, start // FP4_GROUP, size // FP4_GROUP))
                             if proj == "w2" else (Shard(0, start, size),) * 2)
            self._store(local, proj, codes.take(weight), scales.take(scale).float())
            return
        if scale is not None:  # dequantized at load: fp8 experts, or fp4 when asked to
            whole_weight, whole_scale = weight.narrow(0, 0, rows), scale.narrow(0, 0, scale.shape[0])
            weight = (dequantize_fp4(whole_weight, whole_scale) if fp4
                      else dequantize_block_fp8(whole_weight, whole_scale, self.block_size))
        if self.packed_fp4:
            raise ValueError(f"{name}: the layer holds packed fp4 experts but the checkpoint gives this one as "
                             f"{weight.dtype}; experts of one checkpoint must share one format")
        self._store(local, proj, (Shard(1, start, size) if proj == "w2" else Shard(0, start, size)).take(weight))

    def _store(self, local: int, proj: str,
               weight: torch.Tensor,  # [rows, cols] dense, or [rows, cols / 2] packed fp4 (this rank's part)
               scale: torch.Tensor | None = None) -> None:  # [rows, cols / 32] for packed fp4
        size = self.inter_size
        rows = slice(None) if proj == "w2" else slice(0, size) if proj == "w1" else slice(size, 2 * size)
        target = "down" if proj == "w2" else "gate_up"
        with torch.no_grad():
            getattr(self, target)[local, rows].copy_(weight.to(getattr(self, target).dtype))
            if scale is not None:
                getattr(self, target + "_scale")[local, rows].copy_(scale)

    def _dense(self, which: str, dtype: torch.dtype, expert: int | None = None) -> torch.Tensor:
        """``gate_up`` or ``down`` of one local expert (or all of them), dequantized when packed."""
        if self.packed_shapes:  # weight_format=packed: from the tiles
            experts = range(self.num_local_experts) if expert is None else [expert]
            dense = torch.stack([self._expert_weight(which, e).dequantize().to(dtype) for e in experts])
            return dense if expert is None else dense[0]
        weight = getattr(self, which)
        if expert is not None:
            weight = weight[expert]
        if not self.packed_fp4:
            return weight.to(dtype)
        scale = getattr(self, which + "_scale")
        return dequantize_fp4(weight, scale if expert is None else scale[expert], dtype)

    # ---- forward ---------------------------------------------------------------------------------------
    def route(self, x: torch.Tensor,  # [T, hidden]
              input_ids: torch.Tensor,  # [T] int64
              ) -> tuple[torch.Tensor, torch.Tensor]:  # weights [T, k] float32, expert ids [T, k] int64
        scores = expert_scores(F.linear(x.float(), self.gate.weight.float()), self.d.scoring_func)
        if self.d.hash_routed:
            ids = self.gate.tid2eid[input_ids].long()
        else:
            ids = torch.topk(scores + self.gate.bias.float(), self.d.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, ids)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.d.routed_scaling_factor, ids

    def forward(self, x: torch.Tensor,  # [T, hidden]
                input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden]
        weights, ids = self.route(x, input_ids)
        # experts of other ranks fall outside [0, num_local_experts)
        local_ids = self.slots.route(ids) if self.slots is not None else ids - self.first_expert
        run = self._dynamic if self.impl == "dynamic" else self._static
        routed = run(x, weights, local_ids)
        return self.par.all_reduce(routed + self.shared_experts(x))

    def _dynamic(self, x: torch.Tensor,  # [T, hidden]
                 weights: torch.Tensor,  # [T, k] float32
                 local_ids: torch.Tensor,  # [T, k] int64, outside [0, num_local_experts) for other ranks' experts
                 ) -> torch.Tensor:  # [T, hidden]
        """Each local expert over its own tokens, ascending expert id, accumulated with ``index_add_``. Blocked experts
        (host engines) run as one C++ op; other dense experts as one grouped GEMM per projection where torch has it
        (as transformers does); packed fp4 experts one by one, each dequantized when it runs."""
        if self.gate_up_blocked is not None:
            return self._blocked(x, weights, local_ids)
        if not self.packed_fp4 and has_grouped_mm():
            return grouped_experts(x, weights, local_ids, self.gate_up, self.down, self.d.swiglu_limit)
        out = torch.zeros_like(x)
        mask = F.one_hot(local_ids.clamp(-1, self.num_local_experts) + 1,
                         num_classes=self.num_local_experts + 2)[..., 1:-1].permute(2, 1, 0)  # [E, k, T]
        for e in (mask.sum(dim=(1, 2)) > 0).nonzero().flatten().tolist():
            slot, token = torch.where(mask[e])
            gate_up = self._expert_linear(x[token], "gate_up", e)
            h = clipped_swiglu(*gate_up.chunk(2, dim=-1), self.d.swiglu_limit)
            y = self._expert_linear(h, "down", e) * weights[token, slot, None].to(x.dtype)
            out.index_add_(0, token, y)
        return out

    def _static(self, x: torch.Tensor,  # [T, hidden]
                weights: torch.Tensor,  # [T, k] float32
                local_ids: torch.Tensor,  # [T, k] int64
                ) -> torch.Tensor:  # [T, hidden]
        """Fixed shapes for compiled regions: every local expert over every token, combined by a dense
        [T, E] weight matrix that is zero off each token's choices. With ``opaque_experts`` (host engines) the
        grouped experts instead, as one op whose shapes are fixed from the outside."""
        if self.gate_up_blocked is not None:
            return self._blocked(x, weights, local_ids)
        if self.opaque_experts and not self.packed_fp4 and has_grouped_mm():
            return grouped_experts_op(x, weights, local_ids, self.gate_up, self.down, self.d.swiglu_limit)
        num = self.num_local_experts
        inside = (local_ids >= 0) & (local_ids < num)
        dense = torch.zeros(x.shape[0], num + 1, dtype=weights.dtype, device=x.device)
        dense = dense.scatter_add_(1, torch.where(inside, local_ids, num), weights)[:, :num]
        gate_up = torch.einsum("th,eih->eti", x, self._dense("gate_up", x.dtype))
        h = clipped_swiglu(*gate_up.chunk(2, dim=-1), self.d.swiglu_limit)
        y = torch.einsum("eti,ehi->eth", h, self._dense("down", x.dtype))
        return torch.einsum("eth,te->th", y, dense.to(x.dtype))


    def _blocked(self, x: torch.Tensor,  # [T, hidden]
                 weights: torch.Tensor,  # [T, k] float32
                 local_ids: torch.Tensor,  # [T, k] int64
                 ) -> torch.Tensor:  # [T, hidden]
        return blocked_grouped_experts(x, weights, local_ids, self.gate_up_blocked, self.down_blocked,
                                       self.inter_size, self.d.swiglu_limit)


class V4DecoderLayer(nn.Module):
    """mHC around attention and MoE: collapse the streams (pre), run the block, expand (post) + mix (comb)."""

    def __init__(self, attn: V4Attention, ffn: V4MoE, hidden: int, eps: float, hc: HyperConnectionSpec) -> None:
        super().__init__()
        self.attn, self.ffn, self.hc = attn, ffn, hc
        self.engram: nn.Module | None = None  # an EngramLayer on the layers of config.json's engram.layer_ids
        self.attn_norm = RMSNorm(hidden, eps)
        self.ffn_norm = RMSNorm(hidden, eps)
        mixes = (2 + hc.hc_mult) * hc.hc_mult
        for site in ("attn", "ffn"):
            setattr(self, f"hc_{site}_fn", nn.Parameter(torch.zeros(mixes, hc.hc_mult * hidden), requires_grad=False))
            setattr(self, f"hc_{site}_base", nn.Parameter(torch.zeros(mixes), requires_grad=False))
            setattr(self, f"hc_{site}_scale", nn.Parameter(torch.ones(3), requires_grad=False))

    def forward(self, streams: torch.Tensor,  # [T, hc, hidden]
                input_ids: torch.Tensor,  # [T] int64
                ctx: StepContext, cache: LayerCache) -> torch.Tensor:  # [T, hc, hidden]
        if self.engram is not None:
            streams = streams + self.engram(streams, cache.engram_rows, ctx.pages.positions, ctx.rows,
                                            cache.engram_ring, ctx.longest_chunk)
        x, post, comb = hc_pre(streams, self.hc_attn_fn, self.hc_attn_base, self.hc_attn_scale, self.hc)
        streams = hc_post(self.attn(self.attn_norm(x), ctx, cache), streams, post, comb, self.hc)
        x, post, comb = hc_pre(streams, self.hc_ffn_fn, self.hc_ffn_base, self.hc_ffn_scale, self.hc)
        return hc_post(self.ffn(self.ffn_norm(x), input_ids), streams, post, comb, self.hc)
