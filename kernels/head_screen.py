"""Greedy tokens of an fp32 head without computing every fp32 logit (kernels/csrc/head_screen.cpp).

A greedy step needs the argmax of x W^T only. A bf16 copy of the head W gives approximate logits r_j at half the
bytes (one stream) and twice the FLOP rate (a batch); every column j whose interval [r_j - b_j, r_j + b_j] reaches
max_k (r_k - b_k) is a candidate, and the exact fp32 kernel (the same blocked kernel as the full head, so the same
bits per column) runs on the candidates' tiles only. The argmax over those tiles is the full head's argmax,
first index on ties: every column holding the exact maximum M is a candidate (its r_j + b_j >= M >= every
r_k - b_k), and a column outside the candidates has an exact logit below M.

The bound b_j, for row x of width n: with S_j = sum_i |x_i W_ji| <= ||x|| ||W_j|| (Cauchy-Schwarz), u = 2^-24 (fp32)
and u_b = 2^-8 (bf16, round to nearest), gamma = n u / (1 - n u) bounds a length-n fp32 accumulation in any order:
- rounding x and W to bf16 moves each product by at most (2 u_b + u_b^2) |x_i W_ji| (the bf16 products are exact
  in fp32);
- the approximate head's fp32 accumulation adds gamma (1 + u_b)^2 S_j; its output is rounded to bf16 once more
  (u_b times its magnitude, at most (1 + the above) S_j);
- the exact fp32 kernel is itself within gamma S_j of the real sum.
b_j is their sum times ||x|| ||W_j||, with 1% to spare (the fp32 norms' own roundings are far below it); the C++
screen adds a few ulps for its own comparisons. Flushed subnormals move a logit by < 1e-30: in that slack.
On SmolLM2's workload the bound was about 10x the largest error seen and left 4 candidate tiles of 3,072 a row at
the median, 16 at the 90th percentile, 78 at most (benchmarks/head_screen.py, 1,440 rows of batch-32 steps).

Eager host steps only, fp32 heads, one rank. Anything not finite (a NaN logit, an overflowing bound) returns None
and the caller computes the full logits.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.gemv import block_weight, blocked_linear_float, kernel_isa

BF16_UNIT_ROUNDOFF = 2.0 ** -8
FP32_UNIT_ROUNDOFF = 2.0 ** -24


def screen_coefficient(width: int) -> float:
    """c with |exact_j - approximate_j| <= c ||x|| ||W_j|| for rows of ``width`` features (the derivation above)."""
    gamma = width * FP32_UNIT_ROUNDOFF / (1 - width * FP32_UNIT_ROUNDOFF)
    ub = BF16_UNIT_ROUNDOFF
    before_output = 2 * ub + ub * ub + gamma * (1 + ub) ** 2
    return 1.01 * (before_output + ub * (1 + before_output) + gamma)


@dataclass(frozen=True)
class HeadScreen:
    """What the screen keeps beside the two blocked heads, which the model holds as buffers (so the host's
    huge-page move relocates them with the other blocked weights): ``approx_head(weight)`` and the full head's own
    ``block_weight(weight)``."""

    row_norms: torch.Tensor  # [V] float32: ||W_j|| rounded up
    vocab_size: int
    coefficient: float

    @staticmethod
    def supported() -> bool:
        """The exact tiles reproduce the blocked kernel's FMA chains; its plain C++ pass (no AVX2) may round
        products and sums apart, so a CPU without AVX2 computes every logit."""
        return kernel_isa() != "scalar"

    @classmethod
    def of(cls, weight: torch.Tensor) -> "HeadScreen":  # weight [V, H] float32, the head
        if weight.dtype != torch.float32 or weight.dim() != 2:
            raise ValueError(f"HeadScreen: the head must be [V, H] float32, got {tuple(weight.shape)} {weight.dtype}")
        norms = weight.detach().double().norm(dim=1).float()
        return cls(row_norms=torch.nextafter(norms, torch.full_like(norms, float("inf"))),
                   vocab_size=weight.shape[0], coefficient=screen_coefficient(weight.shape[1]))

    @staticmethod
    def approx_head(weight: torch.Tensor) -> torch.Tensor:  # [V, H] float32 -> the bf16 copy, blocked
        return block_weight(weight.detach().to(torch.bfloat16))

    def argmax(self, x: torch.Tensor,  # [B, H] float32
               approx_head: torch.Tensor,  # approx_head(W)
               exact_head: torch.Tensor) -> torch.Tensor | None:  # block_weight(W) -> [B] int64, or None
        """The full head's greedy tokens (``row_argmax(x @ W^T)``, the blocked fp32 kernel's bits); None when a
        value is not finite."""
        approx = blocked_linear_float(x.to(torch.bfloat16), approx_head, self.vocab_size)
        tokens = torch.ops.deepinfer.screened_argmax(approx, x, self.row_norms, exact_head, self.coefficient)
        return tokens if tokens.numel() else None
