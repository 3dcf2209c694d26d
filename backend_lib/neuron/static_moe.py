"""The static MoE: fixed shapes for compiled regions (neuronx-cc wants no data-dependent shapes or host syncs).

Every expert runs over every token and the outputs are combined through a dense ``[T, E]`` routing-weight matrix
that is zero off each token's top-k: ``kernels/moe.py: moe_dynamic``'s function (the eager grouped dispatch) up to
summation order.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.moe import ExpertWeights, dense_expert_weights


def routing_matrix(topk_weights: torch.Tensor,  # [T, k]
                   topk_ids: torch.Tensor,  # [T, k] int64
                   num_experts: int) -> torch.Tensor:
    """Dense [T, E] routing weights, zero off each token's top-k (ids equal to E, the sink, are dropped)."""
    dense = torch.zeros(topk_ids.shape[0], num_experts + 1, dtype=topk_weights.dtype, device=topk_weights.device)
    return dense.scatter_add_(1, topk_ids, topk_weights)[:, :num_experts]


def moe_static(x: torch.Tensor,  # [T, H]
               topk_weights: torch.Tensor,  # [T, k]
               topk_ids: torch.Tensor,  # [T, k] int64
               experts: ExpertWeights) -> torch.Tensor:
    """Fixed-shape MoE: all experts over all tokens, masked combine. No data-dependent shapes or host syncs."""
    bs = experts.block_size
    gate_w = dense_expert_weights(experts.gate, experts.gate_scale, bs, x.dtype)  # [E, I, H]
    up_w = dense_expert_weights(experts.up, experts.up_scale, bs, x.dtype)
    down_w = dense_expert_weights(experts.down, experts.down_scale, bs, x.dtype)  # [E, H, I]
    gate = torch.einsum("th,eih->eti", x, gate_w)
    up = torch.einsum("th,eih->eti", x, up_w)
    y = torch.einsum("eti,ehi->eth", F.silu(gate) * up, down_w)  # [E, T, H]
    weights = routing_matrix(topk_weights, topk_ids, experts.num_experts).to(x.dtype)  # [T, E]
    return torch.einsum("eth,te->th", y, weights)
