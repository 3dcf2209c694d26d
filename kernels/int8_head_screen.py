"""Greedy tokens of a few rows from an int8 copy of the head (kernels/csrc/head_int8.cpp, head_screen.cpp).

At a few rows (up to 4 for a bf16 head, 6 for fp32) the head is a weight stream, and an int8 copy (one scale per
vocabulary row) is half of a bf16 head's bytes and a quarter of an fp32 one's. Its approximate logits and a
rigorous per-column bound on their distance from the exact ones leave a few candidate tiles (the argument of
kernels/head_screen.py); the head's own blocked kernel then runs on those tiles (gathered) with the same rows, so
each exact logit has the bits the full head gives it: the same instruction set, the same pass for this row count,
one FMA / dot chain per column whatever the tile count. The token is the first column holding the largest exact
logit, as ``row_argmax`` picks. Serves fp32 and bf16 heads alike (bf16 logits are rounded to bf16: ties are
common, and every tied column is a candidate).

The approximate pass (integers, exact): x rounded to L int16 levels per row (step = max|x| / L), W_j to int8 with
scale s_j = max|W_j| / 127; y_j = fl(fl(fl(S_j) * step) * s_j) with S_j = sum_i xq_i q_ji. For a row x of width n,
u = 2^-24, gamma_m = m u / (1 - m u), W~_j = s_j q_j:
- |x . W_j - x^ . W~_j| <= ||x|| ||W_j - W~_j|| + ||x - x^|| ||W~_j||, and ||x - x^|| <= eps ||x|| with
  eps = sqrt(n) (1/2 + (L + 1) u)(1 + u) / L (each level within half a step, plus the division's rounding);
- the three roundings of y_j: gamma_3 |x^ . W~_j| <= gamma_3 (1 + eps) ||x|| ||W~_j||;
- the exact kernel: products exact in fp32 (fp32 x fp32 by FMA, bf16 x bf16 by vdpbf16ps / AMX), sums within
  gamma_2n sum |x_i W_ji| <= gamma_2n ||x|| ||W_j|| in any order (2n: room for a dot instruction's two roundings a
  pair), then the bf16 output rounding u_b = 2^-8 when the logits are bf16.
So |exact_j - y_j| <= ||x|| e_j with e_j = 1.01 (||W_j - W~_j|| + (eps + gamma_3 (1 + eps)) ||W~_j|| +
((1 + u_b)(1 + gamma_2n) - 1) ||W_j||), rounded up; the C++ screen adds its own comparison slack. On SmolLM2's
workload it left 6 candidate tiles of 3,072 a row at the median, 34 at the 90th percentile, 200 at most for the
bf16 head, and 3, 16 and 74 for the fp32 one (benchmarks/head_screen.py, 1,440 rows of batch-32 steps).
Subnormals flushed by the dot instructions move a logit by far less than the screen's 1e-30.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kernels.gemv import TILE, blocked_linear_float

GROUP = 64  # columns per k-pair step of the int8 layout (head_int8.cpp)
UNIT_ROUNDOFF = 2.0 ** -24
BF16_UNIT_ROUNDOFF = 2.0 ** -8


def x_levels(width: int) -> int:
    """Levels per sign for the rows' int16 form: as fine as int32 sums over ``width`` features allow."""
    return min(16383, (2 ** 31 - 1) // (127 * 2 * ((width + 1) // 2)))


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # [R, H] -> (int8 [R, H], [R] fp32)
    """Per-row scale max|W_j| / 127 (fp32, as the kernel multiplies by it) and the rounded int8 rows."""
    w = weight.detach().double()
    scales = (w.abs().amax(dim=1) / 127).float()
    safe = torch.where(scales > 0, scales.double(), torch.ones_like(w[:, 0]))
    return torch.round(w / safe[:, None]).clamp_(-127, 127).to(torch.int8), scales


def block_int8(q: torch.Tensor) -> torch.Tensor:  # [V, H] int8 -> [ceil(V/64), ceil(H/2), 128]
    """Group g, pair p holds (q[64g + c, 2p], q[64g + c, 2p + 1]) for c in 0..63; padding is zeros."""
    vocab, width = q.shape
    groups, pairs = -(-vocab // GROUP), -(-width // 2)
    padded = torch.nn.functional.pad(q, (0, 2 * pairs - width, 0, groups * GROUP - vocab))
    return padded.view(groups, GROUP, pairs, 2).permute(0, 2, 1, 3).reshape(groups, pairs, 2 * GROUP).contiguous()


@dataclass(frozen=True)
class Int8HeadScreen:
    """What the screen keeps beside the int8 head, which the model holds as a buffer (moved to huge pages with
    the other blocked weights): ``build``'s second value."""

    scales: torch.Tensor  # [ceil(V/64) * 64] float32, s_j (zero past V)
    column_bounds: torch.Tensor  # [V] float32, e_j rounded up
    vocab_size: int
    levels: int
    max_rows: int  # the most rows a step screens here (more: the bf16 copy of an fp32 head, or the full head)
    # Past this fraction of the tiles, gathering the candidates costs more than the full head: None instead.
    gather_limit: float = 0.25

    @staticmethod
    def supported() -> bool:
        """The int8 pass runs at its speed with AVX-512 VNNI only (elsewhere its plain loop is slower than the
        head it screens)."""
        return torch.ops.deepinfer.int8_head_isa() == "avx512_vnni"

    @classmethod
    def build(cls, weight: torch.Tensor,  # [V, H] float32 or bfloat16, the head
              chunk_rows: int = 4096) -> tuple["Int8HeadScreen", torch.Tensor]:  # -> (screen, blocked int8 head)
        if weight.dim() != 2 or weight.dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"Int8HeadScreen: the head must be [V, H] float32 or bfloat16, got "
                             f"{tuple(weight.shape)} {weight.dtype}")
        vocab, width = weight.shape
        levels = x_levels(width)
        eps = math.sqrt(width) * (0.5 + (levels + 1) * UNIT_ROUNDOFF) * (1 + UNIT_ROUNDOFF) / levels
        gamma3 = 3 * UNIT_ROUNDOFF / (1 - 3 * UNIT_ROUNDOFF)
        gamma2n = 2 * width * UNIT_ROUNDOFF / (1 - 2 * width * UNIT_ROUNDOFF)
        output = BF16_UNIT_ROUNDOFF if weight.dtype == torch.bfloat16 else 0.0
        q = torch.empty(vocab, width, dtype=torch.int8)
        scales = torch.zeros(-(-vocab // GROUP) * GROUP)
        bounds = torch.empty(vocab, dtype=torch.float64)
        for start in range(0, vocab, chunk_rows):  # fp64 copies of a chunk at a time, not of the whole head
            rows = weight[start:start + chunk_rows].detach().double()
            q_rows, s_rows = quantize_rows(rows)
            approx = q_rows.double() * s_rows.double()[:, None]
            q[start:start + len(rows)], scales[start:start + len(rows)] = q_rows, s_rows
            bounds[start:start + len(rows)] = 1.01 * (
                (rows - approx).norm(dim=1) + (eps + gamma3 * (1 + eps)) * approx.norm(dim=1)
                + ((1 + output) * (1 + gamma2n) - 1) * rows.norm(dim=1))
        bounds32 = bounds.float()
        # Zen 4, SmolLM2's head on the workload's rows (benchmarks/head_screen.py): against the full bf16 head the
        # int8 pass stops paying past 4 rows (1.83 / 1.90 ms at 4, 2.03 / 1.94 at 5); against an fp32 head's bf16
        # copy past 6 (1.85 / 2.26 ms at 6, 2.28 / 2.23 at 8).
        max_rows = 6 if weight.dtype == torch.float32 else 4
        screen = cls(scales=scales, column_bounds=torch.nextafter(bounds32, torch.full_like(bounds32, math.inf)),
                     vocab_size=vocab, levels=levels, max_rows=max_rows)
        return screen, block_int8(q)

    def argmax(self, x: torch.Tensor,  # [B, H] float32 or bfloat16, the head's input rows
               int8_head: torch.Tensor,  # build(W)[1]
               exact_head: torch.Tensor) -> torch.Tensor | None:  # block_weight(W) -> [B] int64, or None
        """``row_argmax(blocked_linear_float(x, exact_head, V))`` to the index; None when a value is not finite or
        the rows' candidates cover more than ``gather_limit`` of the tiles."""
        approx = torch.ops.deepinfer.int8_head_logits(x, int8_head, self.scales, self.vocab_size, self.levels)
        reach, tiles = torch.ops.deepinfer.screen_tiles(approx, x.float(), self.column_bounds, 1.0)  # [B, T], [n]
        if reach.numel() == 0 or tiles.numel() > self.gather_limit * reach.shape[1]:
            return None
        exact = blocked_linear_float(x, exact_head.index_select(0, tiles), tiles.numel() * TILE)  # [B, n * 16]
        tokens = torch.ops.deepinfer.pick_screened(exact, tiles, reach, self.vocab_size)
        return tokens if tokens.numel() else None
