"""Manifold-constrained hyper-connections (mHC, DeepSeek-V4): ``hc`` residual streams per token instead of one.

Around every attention and MLP block, a one-layer perceptron over the (unweighted RMS-normed) flattened streams
gives three mixes: ``pre`` [hc] collapses the streams into the block input, ``post`` [hc] spreads the block output
back over the streams, and ``comb`` [hc, hc] mixes the incoming streams into the outgoing ones. ``comb`` is pushed
towards a doubly-stochastic matrix with Sinkhorn-Knopp (column, then row/column ``iters - 1`` times) so that
stacking many layers cannot blow up the residual norm. Everything here runs in fp32, like transformers. Host
engines run ``hc_mixes`` as one C++ op (``HyperConnectionSpec.cpp_mixes``): eagerly it is ~140 tiny ops per site,
most of them the Sinkhorn loop. Eagerly they also run a site as two C++ calls, ``hc_pre`` (mixes plus the collapse)
and ``hc_post`` (the expansion); compiled regions keep the torch collapse / expansion, which inductor fuses.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class HyperConnectionSpec:
    hc_mult: int
    sinkhorn_iters: int
    hc_eps: float
    norm_eps: float
    # the mixes as one C++ op (kernels/csrc/hyper_connections.cpp): host engines with the C++ ops built
    cpp_mixes: bool = False


def unweighted_rms_norm(x: torch.Tensor,  # [..., D]
                        eps: float, cpp: bool = False) -> torch.Tensor:
    """``cpp``: one C++ call eagerly (kernels/csrc/rms_norm.cpp; host engines with the C++ ops built)."""
    if cpp and x.dtype in (torch.float32, torch.bfloat16) and not torch.compiler.is_compiling():
        return torch.ops.deepinfer.rms_norm(x, None, eps)
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


def hc_mixes(streams: torch.Tensor,  # [T, hc, D]
             fn: torch.Tensor,  # [(2 + hc) * hc, hc * D] float32
             base: torch.Tensor,  # [(2 + hc) * hc] float32
             scale: torch.Tensor,  # [3] float32
             spec: HyperConnectionSpec) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(pre [T, hc], post [T, hc], comb [T, hc, hc]), all float32."""
    if spec.cpp_mixes:
        return torch.ops.deepinfer.hc_mixes(streams, fn.float(), base, scale, spec.sinkhorn_iters, spec.hc_eps,
                                            spec.norm_eps)
    hc = spec.hc_mult
    flat = unweighted_rms_norm(streams.flatten(1).float(), spec.norm_eps)
    mixed = F.linear(flat, fn.float())
    pre_w, post_w, comb_w = mixed.split([hc, hc, hc * hc], dim=-1)
    pre_b, post_b, comb_b = base.split([hc, hc, hc * hc])
    pre_scale, post_scale, comb_scale = scale.unbind(0)
    pre = torch.sigmoid(pre_w * pre_scale + pre_b) + spec.hc_eps
    post = 2 * torch.sigmoid(post_w * post_scale + post_b)
    comb = torch.softmax(comb_w.view(-1, hc, hc) * comb_scale + comb_b.view(hc, hc), dim=-1) + spec.hc_eps
    # in place on the softmax's own buffer: eagerly 3 small ops per normalization and no allocations (20
    # iterations are ~120 ops per site); a compiled region fuses the whole loop into one kernel either way
    comb = comb.div_(comb.sum(dim=-2, keepdim=True).add_(spec.hc_eps))
    for _ in range(spec.sinkhorn_iters - 1):
        comb.div_(comb.sum(dim=-1, keepdim=True).add_(spec.hc_eps))
        comb.div_(comb.sum(dim=-2, keepdim=True).add_(spec.hc_eps))
    return pre, post, comb


def hc_collapse(streams: torch.Tensor,  # [T, hc, D]
                pre: torch.Tensor,  # [T, hc] float32
                ) -> torch.Tensor:  # [T, D] in streams.dtype
    return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)


def hc_expand(block_out: torch.Tensor,  # [T, D]
              streams: torch.Tensor,  # [T, hc, D] the block's input streams
              post: torch.Tensor,  # [T, hc]
              comb: torch.Tensor,  # [T, hc, hc]
              ) -> torch.Tensor:  # [T, hc, D]
    """New streams: ``post`` spreads the block output; ``comb`` (consumed transposed: out stream k sums
    ``comb[j, k] * in stream j``) carries the residual."""
    dtype = streams.dtype
    return post.to(dtype).unsqueeze(-1) * block_out.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2),
                                                                                  streams)


def hc_pre(streams: torch.Tensor,  # [T, hc, D]
           fn: torch.Tensor,  # [(2 + hc) * hc, hc * D] float32
           base: torch.Tensor,  # [(2 + hc) * hc] float32
           scale: torch.Tensor,  # [3] float32
           spec: HyperConnectionSpec) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A site's entry: (the block input [T, D] in streams.dtype, post [T, hc], comb [T, hc, hc] float32)."""
    if spec.cpp_mixes and not torch.compiler.is_compiling():
        return torch.ops.deepinfer.hc_pre(streams, fn.float(), base, scale, spec.sinkhorn_iters, spec.hc_eps,
                                          spec.norm_eps)
    pre, post, comb = hc_mixes(streams, fn, base, scale, spec)
    return hc_collapse(streams, pre), post, comb


def hc_post(block_out: torch.Tensor,  # [T, D]
            streams: torch.Tensor,  # [T, hc, D] the block's input streams
            post: torch.Tensor,  # [T, hc]
            comb: torch.Tensor,  # [T, hc, hc]
            spec: HyperConnectionSpec) -> torch.Tensor:  # [T, hc, D]
    """A site's exit: ``hc_expand``, one C++ pass eagerly on host engines."""
    if spec.cpp_mixes and not torch.compiler.is_compiling():
        return torch.ops.deepinfer.hc_post(block_out, streams, post, comb)
    return hc_expand(block_out, streams, post, comb)


def hc_head_collapse(streams: torch.Tensor,  # [T, hc, D]
                     fn: torch.Tensor,  # [hc, hc * D]
                     base: torch.Tensor,  # [hc]
                     scale: torch.Tensor,  # [1]
                     spec: HyperConnectionSpec) -> torch.Tensor:  # [T, D]
    """The final collapse before the model's norm: only a ``pre`` mix, no Sinkhorn."""
    flat = unweighted_rms_norm(streams.flatten(1).float(), spec.norm_eps)
    pre = torch.sigmoid(F.linear(flat, fn.float()) * scale.float() + base.float()) + spec.hc_eps
    return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
