"""Mixture of experts: the DeepSeek-V3 grouped router and two expert formulations with the same result.

* ``moe_dynamic``: eager grouped dispatch, each expert runs only over the tokens routed to it (data-dependent
  shapes; for eager runs). Experts are visited in ascending id and accumulated with ``index_add_``, which is
  the order transformers uses, so fp32 results match it bit for bit in practice.
* ``moe_static`` (``backend_lib/neuron/static_moe.py``): the fixed-shape form compiled regions take.

Expert weights are stacked per projection (``[E, out, in]``); when a projection carries a block scale grid
(``[E, ceil(out/128), ceil(in/128)]``) its weights are float8_e4m3fn and are dequantized block-wise.
``weight_format=packed`` keeps them as ``PackedExperts`` instead (kernels/packed_weights.py's fp8 tiles, one tile set
per expert): ``moe_dynamic_packed`` runs each selected expert's tokens through the packed GEMM (fp32 widening in
registers: ``moe_dynamic``'s function up to summation order); compiled regions' static MoE takes
``PackedExperts.dense`` (the same values, dequantized from the tiles).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.packed_gemm import packed_linear_buffers
from kernels.packed_weights import PackedFp8
from kernels.quant import DEFAULT_BLOCK, block_fp8_linear, dequantize_block_fp8


@dataclass(frozen=True)
class RouterConfig:
    top_k: int
    num_experts: int
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0

    def __post_init__(self) -> None:
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k must be in [1, num_experts={self.num_experts}], got {self.top_k}")
        if self.n_group < 1 or self.num_experts % self.n_group:
            raise ValueError(f"n_group must be >= 1 and divide num_experts={self.num_experts}, got {self.n_group}")
        if not 1 <= self.topk_group <= self.n_group:
            raise ValueError(f"topk_group must be in [1, n_group={self.n_group}], got {self.topk_group}")
        if self.n_group > 1 and self.num_experts // self.n_group < 2:
            raise ValueError("group scores sum the top-2 experts of a group: experts per group must be >= 2, "
                             f"got {self.num_experts // self.n_group}")


def grouped_topk(router_logits: torch.Tensor,  # [T, E] float32
                 correction_bias: torch.Tensor,  # [E] float32, used for the choice only
                 cfg: RouterConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 routing -> (weights [T, k] float32, expert ids [T, k] int64).

    Sigmoid scores; the correction bias shifts which experts are chosen but the weights come from the raw
    scores; only the ``topk_group`` groups with the largest sum of their top-2 biased scores compete.
    """
    scores = router_logits.float().sigmoid()
    choice = scores + correction_bias.float()
    if cfg.n_group > 1:
        per_group = cfg.num_experts // cfg.n_group
        group_scores = choice.view(-1, cfg.n_group, per_group).topk(2, dim=-1)[0].sum(dim=-1)
        group_idx = torch.topk(group_scores, k=cfg.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1.0)
        expert_mask = group_mask.unsqueeze(-1).expand(-1, cfg.n_group, per_group).reshape(-1, cfg.num_experts)
        choice = choice.masked_fill(expert_mask == 0, float("-inf"))
    topk_ids = torch.topk(choice, k=cfg.top_k, dim=-1, sorted=False)[1]
    topk_weights = scores.gather(1, topk_ids)
    if cfg.norm_topk_prob:
        topk_weights = topk_weights / (topk_weights.sum(dim=-1, keepdim=True) + 1e-20)
    return topk_weights * cfg.routed_scaling_factor, topk_ids


@dataclass
class ExpertWeights:
    """Stacked routed-expert weights; a ``*_scale`` grid marks that projection as block fp8."""

    gate: torch.Tensor  # [E, I, H]
    up: torch.Tensor  # [E, I, H]
    down: torch.Tensor  # [E, H, I]
    gate_scale: torch.Tensor | None = None  # [E, ceil(I/b0), ceil(H/b1)]
    up_scale: torch.Tensor | None = None
    down_scale: torch.Tensor | None = None
    block_size: tuple[int, int] = DEFAULT_BLOCK

    @property
    def num_experts(self) -> int:
        return self.gate.shape[0]


def _linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None,
            block_size: tuple[int, int]) -> torch.Tensor:
    if scale is None:
        return F.linear(x, weight)
    return block_fp8_linear(x, weight, scale, block_size)


def dense_expert_weights(weight: torch.Tensor, scale: torch.Tensor | None, block_size: tuple[int, int],
           dtype: torch.dtype) -> torch.Tensor:
    if scale is None:
        return weight.to(dtype)
    return dequantize_block_fp8(weight, scale, block_size, dtype=dtype)


def _dispatch(x: torch.Tensor,  # [T, H]
              topk_weights: torch.Tensor,  # [T, k]
              topk_ids: torch.Tensor,  # [T, k] int64
              num_experts: int,
              expert: Callable[[torch.Tensor, int], torch.Tensor]) -> torch.Tensor:  # ([N, H], e) -> [N, H]
    """Each hit expert over its own tokens, ascending id, accumulated with ``index_add_`` (transformers' order).
    An id equal to ``num_experts`` is the sink: an expert another rank holds (expert parallelism)."""
    out = torch.zeros_like(x)
    # [E + 1, k, T]: which (slot, token) pairs picked each expert; row E is the sink
    expert_mask = F.one_hot(topk_ids, num_classes=num_experts + 1).permute(2, 1, 0)
    hit = (expert_mask[:num_experts].sum(dim=(1, 2)) > 0).nonzero().flatten().tolist()
    for e in hit:
        slot, token = torch.where(expert_mask[e])
        y = expert(x[token], e)
        out.index_add_(0, token, (y * topk_weights[token, slot, None]).to(out.dtype))
    return out


def moe_dynamic(x: torch.Tensor,  # [T, H]
                topk_weights: torch.Tensor,  # [T, k]
                topk_ids: torch.Tensor,  # [T, k] int64
                experts: ExpertWeights) -> torch.Tensor:
    """Grouped dispatch: each expert runs over its own tokens only. Returns [T, H] in x.dtype."""
    bs = experts.block_size

    def expert(h: torch.Tensor, e: int) -> torch.Tensor:
        gate = _linear(h, experts.gate[e], None if experts.gate_scale is None else experts.gate_scale[e], bs)
        up = _linear(h, experts.up[e], None if experts.up_scale is None else experts.up_scale[e], bs)
        return _linear(F.silu(gate) * up, experts.down[e],
                       None if experts.down_scale is None else experts.down_scale[e], bs)

    return _dispatch(x, topk_weights, topk_ids, experts.num_experts, expert)


@dataclass(frozen=True)
class PackedExperts:
    """Routed fp8 experts in the packed GEMM's tiles, each projection a ``PackedFp8`` whose ``data`` / ``scales``
    carry a leading expert dim (one expert's tiles contiguous). ``gate_up`` holds gate's rows then up's (one GEMM
    for both, as the intermediate size falls on the scale blocks); else ``gate`` and ``up`` are apart."""

    down: PackedFp8  # data [E, tiles(H), I, 16] uint8, scales [E, ceil(H/bn), ceil(I/bk)] fp32
    gate_up: PackedFp8 | None = None  # data [E, tiles(2I), H, 16], scales [E, 2I/bn, ceil(H/bk)]
    gate: PackedFp8 | None = None  # data [E, tiles(I), H, 16]
    up: PackedFp8 | None = None
    kernel: bool = True  # packed_kernels_available() as found at load; False runs the torch reference

    def __post_init__(self) -> None:
        if (self.gate_up is None) == (self.gate is None or self.up is None):
            raise ValueError("PackedExperts: give either gate_up or both gate and up")

    @property
    def num_experts(self) -> int:
        return self.down.data.shape[0]

    def dense(self, dtype: torch.dtype) -> ExpertWeights:
        """Every expert dequantized from its tiles (the values ``dequantize`` holds): the static MoE's weights."""
        down = dequantize_stack(self.down, dtype)
        if self.gate_up is not None:
            gate, up = dequantize_stack(self.gate_up, dtype).chunk(2, dim=1)
        else:
            gate, up = dequantize_stack(self.gate, dtype), dequantize_stack(self.up, dtype)
        return ExpertWeights(gate, up, down, block_size=self.down.block_size)


def expert_tiles(stack: PackedFp8, expert: int) -> PackedFp8:
    """One expert's ``PackedFp8`` out of a stacked one (views, no copy)."""
    return PackedFp8(stack.data[expert], stack.scales[expert], stack.out_features, stack.in_features,
                     stack.block_size)


def dequantize_stack(stack: PackedFp8, dtype: torch.dtype) -> torch.Tensor:  # -> [E, out, in]
    num = stack.data.shape[0]
    codes = stack.data.transpose(-1, -2).reshape(num, -1, stack.in_features)[:, :stack.out_features]
    return dequantize_block_fp8(codes.view(torch.float8_e4m3fn), stack.scales, stack.block_size, dtype=dtype)


def moe_dynamic_packed(x: torch.Tensor,  # [T, H] float32 or bfloat16
                       topk_weights: torch.Tensor,  # [T, k]
                       topk_ids: torch.Tensor,  # [T, k] int64
                       experts: PackedExperts) -> torch.Tensor:  # [T, H]
    """``moe_dynamic`` on packed experts: each hit expert's tokens through the packed GEMM on its tiles."""

    def linear(h: torch.Tensor, stack: PackedFp8, e: int) -> torch.Tensor:
        w = expert_tiles(stack, e)
        return packed_linear_buffers(h, w.data, w.scales, None, w, experts.kernel, "fp32")

    def expert(h: torch.Tensor, e: int) -> torch.Tensor:
        if experts.gate_up is not None:
            gate, up = linear(h, experts.gate_up, e).chunk(2, dim=-1)
        else:
            gate, up = linear(h, experts.gate, e), linear(h, experts.up, e)
        return linear(F.silu(gate) * up, experts.down, e)

    return _dispatch(x, topk_weights, topk_ids, experts.num_experts, expert)
