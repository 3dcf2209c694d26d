"""DeepSeek-V3's mixture of experts: the router, the routed experts (stacked per projection, filled one checkpoint
expert at a time) and the MoE layer around them with its shared expert.

Routed fp8 experts are kept one of three ways: dequantized at load into stacks of the model dtype
(``weight_format=dequantize``: DeepseekV3ForCausalLM passes ``dequantize``; widening every hit expert at every call
instead took a decode step of benchmarks/quantized_deepseek.py's V3 from 80 / 74 / 95 ms to 122 / 225 / 253 ms at
batch 1 / 8 / 32); fp8 stacks with their scale
grids, dequantized block-wise inside each expert's linear (``set_expert(..., dequantize=False)`` on a layer built
without ``packed``: kept for the kernels' comparisons, which the model no longer loads); or, with
``weight_format=packed``, each expert's projections repacked as they load into the packed GEMM's fp8 tiles
(kernels/packed_weights.py: the same bytes, one tile set per expert, gate and up as one GEMM where the intermediate
size falls on the scale blocks), the only copy; eager steps then run each selected expert's tokens through the
packed GEMM (kernels/moe.py: ``moe_dynamic_packed``) and compiled regions' static MoE dequantizes from the tiles.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from backend_lib.models.deepseek_v3.layers import DenseMLP, take_block_fp8
from backend_lib.models.expert_slots import ExpertSlots
from backend_lib.models.layers import PackedExpertsSummary
from backend_lib.models.parallel import ParallelContext, Shard, read_shard
from backend_lib.neuron.static_moe import moe_static
from kernels.moe import ExpertWeights, PackedExperts, RouterConfig, grouped_topk, moe_dynamic, moe_dynamic_packed
from kernels.packed_gemm import packed_kernels_available
from kernels.packed_weights import TILE, PackedFp8, pack_fp8
from kernels.quant import dequantize_block_fp8


class Router(nn.Module):
    def __init__(self, num_experts: int, hidden: int) -> None:
        super().__init__()
        # fp32 whatever the model dtype: the routing decision is precision sensitive
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden), requires_grad=False)
        self.register_buffer("e_score_correction_bias", torch.zeros(num_experts))


class RoutedExperts(nn.Module):
    """Stacked expert projections, filled one checkpoint expert at a time.

    Tensor parallel: every rank holds every expert, each cut to 1/N of its intermediate units. Expert parallel:
    every rank holds 1/N of the experts whole (``expert_start`` onwards); the others' weights are never read. With
    EPLB (``slots``, models/expert_slots.py) the stacks are this rank's placement slots instead, a checkpoint expert
    written into each slot that holds it; ``slot_tensors`` are what a re-placement moves between ranks.
    ``packed`` (weight_format=packed): fp8 experts go into tile stacks (``*_tiles`` [E, tiles, in, 16] uint8 and
    ``*_tile_scales`` [E, grid rows, grid columns] fp32) instead of the ``gate_proj`` ... stacks, which stay None."""

    PROJS = ("gate_proj", "up_proj", "down_proj")
    TILED = ("gate_up", "gate_proj", "up_proj", "down_proj")  # the tile stacks' names (gate_up: gate rows, up rows)

    def __init__(self, num_experts: int, hidden: int, intermediate: int, block_size: tuple[int, int],
                 par: ParallelContext, packed: bool = False, num_groups: int = 1) -> None:
        super().__init__()
        self.total_experts, self.block_size = num_experts, block_size
        self.slots: ExpertSlots | None = None
        if par.eplb_redundant_experts is not None:
            self.slots = ExpertSlots(num_experts, par, num_groups)
            self.expert_start, self.num_experts = 0, self.slots.slots_per_rank
            self.shards = dict.fromkeys(self.PROJS)
        elif par.expert_parallel:
            self.expert_start, self.num_experts = par.even(num_experts, "n_routed_experts")
            self.shards: dict[str, Shard | None] = dict.fromkeys(self.PROJS)
        else:
            self.expert_start, self.num_experts = 0, num_experts
            start, size = par.even(intermediate, "moe_intermediate_size")
            self.shards = {"gate_proj": Shard(0, start, size), "up_proj": Shard(0, start, size),
                           "down_proj": Shard(1, start, size)}
            intermediate = size
        self.shapes = {"gate_proj": (intermediate, hidden), "up_proj": (intermediate, hidden),
                       "down_proj": (hidden, intermediate)}
        for proj in self.PROJS:
            self.register_buffer(proj, None)
            self.register_buffer(proj + "_scale_inv", None)
        self.packed, self.packed_kernel = packed, False
        # gate and up as one GEMM: their scale grids stack only when the intermediate size is on the row blocks
        self.fuse_gate_up = intermediate % block_size[0] == 0
        self.packed_projs: set[str] = set()  # projections that arrived fp8 and went into tiles
        for name in self.TILED:  # buffers, so compiled regions take them as graph inputs
            self.register_buffer(name + "_tiles", None, persistent=False)
            self.register_buffer(name + "_tile_scales", None, persistent=False)

    def local_slots(self, expert: int) -> list[int]:
        """The stack indices that hold checkpoint expert ``expert`` on this rank (none: another rank's)."""
        if self.slots is not None:
            return self.slots.local_slots(expert)
        inside = self.expert_start <= expert < self.expert_start + self.num_experts
        return [expert - self.expert_start] if inside else []

    def local_ids(self, topk_ids: torch.Tensor,  # [T, k] int64 logical expert ids
                  ) -> torch.Tensor:  # [T, k] stack indices, num_experts = another rank's
        if self.slots is not None:
            return self.slots.route(topk_ids)
        return local_routing(topk_ids, self.expert_start, self.num_experts)

    def slot_tensors(self) -> dict[str, torch.Tensor]:
        """Every per-slot stack as stored (model dtype, fp8 with scale grids, or packed tiles), dim 0 the slot."""
        names = [p + suffix for p in self.PROJS for suffix in ("", "_scale_inv")]
        names += [t + suffix for t in self.TILED for suffix in ("_tiles", "_tile_scales")]
        return {n: getattr(self, n) for n in names if getattr(self, n) is not None}

    def set_expert(self, expert: int, proj: str, weight: Any, scale_inv: Any,
                   dtype: torch.dtype, dequantize: bool) -> None:
        if not 0 <= expert < self.total_experts:
            raise ValueError(f"expert index must be in [0, {self.total_experts}), got {expert}")
        slots = self.local_slots(expert)
        if not slots:
            return  # another rank's expert
        name = f"experts.{expert}.{proj}"
        pack = self.packed and scale_inv is not None and not dequantize
        shard = self.shards[proj]
        if pack and shard is not None:
            self._check_split(name, shard, tuple(weight.shape))
        if shard is not None and scale_inv is not None:
            weight, scale_inv = take_block_fp8(weight, scale_inv, shard, self.block_size, dtype)
        elif shard is not None:
            weight = shard.take(weight)
        weight, scale_inv = read_shard(weight, None), None if scale_inv is None else read_shard(scale_inv, None)
        if tuple(weight.shape) != self.shapes[proj]:
            raise ValueError(f"experts.{expert}.{proj} shape {tuple(weight.shape)} != {self.shapes[proj]}")
        if (getattr(self, proj) is not None) if pack else (proj in self.packed_projs):
            raise ValueError(f"{name}: experts of one layer must all be fp8 or all be plain")
        if pack:
            tiles = pack_fp8(weight, scale_inv.to(torch.float32), self.block_size)
            for slot in slots:
                self._store_tiles(slot, proj, tiles)
            return
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
        for slot in slots:
            stacked[slot] = weight if keep_fp8 else weight.to(dtype)
            if keep_fp8:
                scales[slot] = scale_inv.to(torch.float32)

    def _check_split(self, name: str, shard: Shard, shape: tuple[int, ...]) -> None:
        """Packed tiles keep the checkpoint's scale grid: a rank's slice must start and end on its blocks."""
        b, end = self.block_size[shard.dim], shard.start + shard.size
        if shard.start % b or (end % b and end != shape[shard.dim]):
            raise ValueError(f"weight_format=packed: the tensor-parallel split [{shard.start}, {end}) of dim "
                             f"{shard.dim} of {name} {shape} (fp8) is not on its {b}-wide blocks; use "
                             "weight_format=dequantize, expert parallelism or another tensor_parallel_size")

    def _store_tiles(self, expert: int,  # local index
                     proj: str, tiles: PackedFp8) -> None:
        """One expert's projection into its tile stack: gate's rows first in ``gate_up``, up's after them."""
        fused = self.fuse_gate_up and proj != "down_proj"
        target, rows = ("gate_up", 2 * tiles.out_features) if fused else (proj, tiles.out_features)
        if getattr(self, target + "_tiles") is None:
            grid_rows = -(-rows // self.block_size[0])
            self.register_buffer(target + "_tiles", torch.zeros(self.num_experts, -(-rows // TILE),
                                                                *tiles.data.shape[1:], dtype=torch.uint8),
                                 persistent=False)
            self.register_buffer(target + "_tile_scales", torch.zeros(self.num_experts, grid_rows,
                                                                      tiles.scales.shape[1]), persistent=False)
            self.packed_kernel = packed_kernels_available()  # built and logged at load
        first_tile = first_block = 0
        if fused and proj == "up_proj":  # gate's rows fill whole tiles and blocks (fuse_gate_up)
            first_tile, first_block = tiles.data.shape[0], tiles.scales.shape[0]
        data, scales = getattr(self, target + "_tiles"), getattr(self, target + "_tile_scales")
        data[expert, first_tile:first_tile + tiles.data.shape[0]] = tiles.data
        scales[expert, first_block:first_block + tiles.scales.shape[0]] = tiles.scales
        self.packed_projs.add(proj)

    def missing(self) -> list[str]:
        """Projections no checkpoint expert has filled (neither stacked nor tiled)."""
        return [p for p in self.PROJS if getattr(self, p) is None and p not in self.packed_projs]

    def weights(self) -> ExpertWeights:
        return ExpertWeights(self.gate_proj, self.up_proj, self.down_proj, self.gate_proj_scale_inv,
                             self.up_proj_scale_inv, self.down_proj_scale_inv, self.block_size)

    def packed_experts(self) -> PackedExperts | None:
        """The tile stacks as ``PackedExperts`` (views of the buffers), None unless every projection is packed."""
        if len(self.packed_projs) < len(self.PROJS):
            return None

        def stack(name: str, out: int, inp: int) -> PackedFp8:
            return PackedFp8(getattr(self, name + "_tiles"), getattr(self, name + "_tile_scales"), out, inp,
                             self.block_size)

        inter, hidden = self.shapes["gate_proj"]
        down = stack("down_proj", hidden, inter)
        if self.fuse_gate_up:
            return PackedExperts(down, gate_up=stack("gate_up", 2 * inter, hidden), kernel=self.packed_kernel)
        return PackedExperts(down, gate=stack("gate_proj", inter, hidden), up=stack("up_proj", inter, hidden),
                             kernel=self.packed_kernel)

    def packed_experts_bytes(self) -> tuple[int, int]:
        """(weights, resident bytes) of the tiled experts (the load log's count: layers.resident_weight_bytes)."""
        weights = sum(self.num_experts * self.shapes[p][0] * self.shapes[p][1] for p in self.packed_projs)
        tensors = [getattr(self, f"{n}_{k}") for n in self.TILED for k in ("tiles", "tile_scales")]
        return weights, sum(t.numel() * t.element_size() for t in tensors if t is not None)

    def packed_experts_summary(self) -> PackedExpertsSummary | None:
        """The load log's entry (layers.describe_weight_formats); None unless the experts arrived fp8 and packed."""
        if not self.packed_projs:
            return None
        return PackedExpertsSummary(PackedFp8.fmt, self.num_experts, *self.packed_experts_bytes())


class MoE(nn.Module):
    """Router (replicated, fp32), routed experts (sharded or partitioned) and the shared expert (sharded).

    Every rank holds every token (attention is tensor parallel), so dispatch under expert parallelism is local:
    each rank runs its own experts over the tokens routed to them (``local_routing``), and the combine is the one
    all-reduce that also joins the shared expert's partial sums."""

    def __init__(self, hidden: int, moe_intermediate: int, n_shared: int, router: RouterConfig,
                 block_size: tuple[int, int], par: ParallelContext, impl: str = "dynamic",
                 packed: bool = False) -> None:
        super().__init__()
        self.router_cfg, self.impl, self.par = router, impl, par
        self.gate = Router(router.num_experts, hidden)
        self.experts = RoutedExperts(router.num_experts, hidden, moe_intermediate, block_size, par, packed,
                                     num_groups=router.n_group)
        self.shared_experts = (DenseMLP(hidden, moe_intermediate * n_shared, block_size, par, reduce=False)
                               if n_shared else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden]
        logits = F.linear(x.float(), self.gate.weight.float())
        weights, ids = grouped_topk(logits, self.gate.e_score_correction_bias, self.router_cfg)
        ids = self.experts.local_ids(ids)
        packed = self.experts.packed_experts()
        if packed is None:
            run = moe_dynamic if self.impl == "dynamic" else moe_static
            y = run(x, weights, ids, self.experts.weights())
        elif self.impl == "dynamic":
            y = moe_dynamic_packed(x, weights, ids, packed)
        else:  # compiled regions: fixed shapes, every expert dequantized from its tiles
            y = moe_static(x, weights, ids, packed.dense(x.dtype))
        if self.shared_experts is not None:
            y = y + self.shared_experts(x)
        return self.par.all_reduce(y)


def local_routing(topk_ids: torch.Tensor,  # [T, k] int64 global expert ids
                  expert_start: int, num_local: int) -> torch.Tensor:  # [T, k] local ids; num_local = elsewhere
    """Expert-parallel dispatch: ids of this rank's experts become local indices, every other id the sink index
    ``num_local`` that the MoE kernels skip."""
    local = topk_ids - expert_start
    inside = (local >= 0) & (local < num_local)
    return torch.where(inside, local, torch.full_like(local, num_local))
