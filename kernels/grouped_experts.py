"""Routed MoE experts as grouped GEMMs over each expert's own tokens, and the same computation as one opaque op for
compiled regions on the host.

``grouped_experts`` sorts the (token, choice) pairs by expert and runs two grouped GEMMs over the experts' row
ranges (as transformers does): each expert multiplies only the tokens routed to it. Its shapes are static ([T * k]
pairs, [E] offsets), but ``torch._grouped_mm``'s fake kernel only takes bf16 (the CUDA rule), so dynamo cannot trace
it in fp32. ``deepinfer::grouped_experts`` wraps it as a custom op with a fake kernel: a graph keeps it as one call
and runs exactly what eager steps run, instead of the static MoE's every-expert-over-every-token einsums (the top-k
/ E share of the work: 4 of 16 experts per token in the V4 benchmark). Neuron graphs keep the static MoE.

Host engines run ``blocked_grouped_experts`` instead (``deepinfer::blocked_grouped_experts``, kernels/csrc/
grouped_experts.cpp): the same computation in one C++ call on weights blocked once at load (``block_experts``,
kernels/gemv.py's layout per expert), near the read bandwidth where ``_grouped_mm``'s per-expert sgemm reached
about half of it. It is a dispatcher op with a fake kernel: compiled regions keep it as one opaque call.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.gemv import block_weight


def clipped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:  # [N, I] each
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


def has_grouped_mm() -> bool:
    return hasattr(torch, "_grouped_mm")


def grouped_experts(x: torch.Tensor,  # [T, hidden]
                    weights: torch.Tensor,  # [T, k] float32 routing weights
                    local_ids: torch.Tensor,  # [T, k] int64, outside [0, E) for other ranks' experts
                    gate_up: torch.Tensor,  # [E, 2I, hidden] dense experts
                    down: torch.Tensor,  # [E, hidden, I]
                    limit: float) -> torch.Tensor:  # [T, hidden]
    """(token, choice) pairs sorted by expert, two grouped GEMMs over the experts' row ranges, one scatter-add.
    Pairs routed to other ranks' experts sort last, past every range, and are zeroed before the add."""
    num, top_k = gate_up.shape[0], local_ids.shape[1]
    ids = local_ids.flatten()
    ids = torch.where((ids >= 0) & (ids < num), ids, torch.full_like(ids, num))
    sorted_ids, order = torch.sort(ids, stable=True)
    tokens = order // top_k
    counts = torch.bincount(sorted_ids, minlength=num + 1)[:num]
    offsets = torch.cumsum(counts, dim=0).to(torch.int32)
    gate_up_out = torch._grouped_mm(x[tokens], gate_up.to(x.dtype).transpose(-2, -1), offs=offsets)
    h = clipped_swiglu(*gate_up_out.chunk(2, dim=-1), limit)
    y = torch._grouped_mm(h, down.to(x.dtype).transpose(-2, -1), offs=offsets)  # [T * k, hidden]
    scale = weights.flatten()[order].to(x.dtype)[:, None]
    y = torch.where((sorted_ids < num)[:, None], y * scale, torch.zeros_like(y))
    return torch.zeros_like(x).index_add_(0, tokens, y)


@torch.library.custom_op("deepinfer::grouped_experts", mutates_args=())
def grouped_experts_op(x: torch.Tensor, weights: torch.Tensor, local_ids: torch.Tensor, gate_up: torch.Tensor,
                       down: torch.Tensor, limit: float) -> torch.Tensor:
    return grouped_experts(x, weights, local_ids, gate_up, down, limit)


@grouped_experts_op.register_fake
def _(x, weights, local_ids, gate_up, down, limit):
    return torch.empty_like(x)


def block_experts(stacked: torch.Tensor) -> torch.Tensor:  # [E, out, in] fp32 or bf16 -> blocked
    """Each expert's [out, in] in ``kernels.gemv.block_weight``'s layout, stacked: [E, tiles, steps, lanes]."""
    if stacked.dim() != 3:
        raise ValueError(f"block_experts: expected stacked expert weights [E, out, in], got {tuple(stacked.shape)}")
    return torch.stack([block_weight(w) for w in stacked.unbind(0)])


def blocked_grouped_experts(x: torch.Tensor,  # [T, hidden]
                            weights: torch.Tensor,  # [T, k] float32 routing weights
                            local_ids: torch.Tensor,  # [T, k] int64, outside [0, E) for other ranks' experts
                            gate_up: torch.Tensor,  # block_experts([E, 2I, hidden])
                            down: torch.Tensor,  # block_experts([E, hidden, I])
                            inter: int, limit: float) -> torch.Tensor:  # [T, hidden]
    """``grouped_experts`` on blocked weights, in C++ (needs ``kernels.cpu_kernels.load_cpu_kernels()``)."""
    return torch.ops.deepinfer.blocked_grouped_experts(x, weights, local_ids, gate_up, down, inter, limit)
