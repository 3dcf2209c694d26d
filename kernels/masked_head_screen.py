"""Greedy tokens of grammar-constrained rows from a screened head: each row's argmax over the tokens its grammar
bitmask allows, ``row_argmax(where(allowed, blocked_linear_float(x, W), -inf))`` to the index, without the full
head's logits.

Why: a structured-output step of greedy rows used to compute every logit of every row (the screens of
kernels/head_screen.py and kernels/int8_head_screen.py knew no mask), then mask them: on SmolLM2's fp32 head at
32 rows that is the full head (113 MB of weights, ~20 ms on a loaded 2-core Xeon) where the screen takes ~4 ms,
the larger part of the 1.15x a constrained batch-32 step cost against a free one (issue 35).

The argument is the screens' own, on the allowed columns. A screen gives approximate logits a_j with
|exact_j - a_j| <= k norms_j (k = coefficient ||x||: ``screen_tiles``' bound) and keeps the tiles holding a column
whose upper end a_j + k norms_j reaches the best lower end max_i (a_i - k norms_i). Here every disallowed column's
a_j is replaced by ``min_j a_j - 4 k max_j norms_j`` (finite, so the C++ screen runs; its lower end lies below every
allowed column's, so the best lower end is the allowed columns' own, which is at most the allowed maximum M). Every
allowed column holding M then reaches it (a_j + k norms_j >= M), so its tile is gathered; the head's own blocked
kernel gives the gathered columns their exact bits (the same rows, one chain per column whatever the tile count,
as the int8 screen relies on), disallowed columns among them become -FLT_MAX (finite: ``pick_screened`` refuses
non-finite values), and ``pick_screened`` takes the first column holding the largest value: M's first column, as
``row_argmax`` of the masked logits picks. A disallowed column can only add a tile to gather, never win.

None (the caller computes every logit and masks them) where the screens would give up: a value not finite
(NaN masked away is no longer a NaN: the full path's -inf fill hides it too, but a NaN in an allowed column or in
x gives None), too many candidate tiles, or a row with no allowed token at all (its full-path argmax is column 0
of all -inf).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.gemv import TILE, blocked_linear_float
from kernels.grammar_mask import BITS_PER_WORD, allowed_columns
from kernels.head_screen import HeadScreen
from kernels.int8_head_screen import Int8HeadScreen

FINITE_FLOOR = torch.finfo(torch.float32).min  # a disallowed exact logit: below every finite one, still finite
# The bf16 copy's screen gathers the union of the rows' tiles (its fused op has no mask); past this fraction of the
# tiles the full head costs less.
GATHER_LIMIT = 0.25


@dataclass(frozen=True)
class ScreenedHead:
    """A model's head and its screens, as ``LlamaForCausalLM.pack_for_cpu`` builds them."""

    exact_head: torch.Tensor  # kernels.gemv.block_weight(W): the head's blocked layout (fp32 or bf16)
    vocab_size: int
    head_screen: HeadScreen | None = None  # the bf16 copy of an fp32 head
    approx_head: torch.Tensor | None = None  # HeadScreen.approx_head(W)
    int8_screen: Int8HeadScreen | None = None
    int8_head: torch.Tensor | None = None  # Int8HeadScreen.build(W)[1]
    gather_limit: float = GATHER_LIMIT  # the bf16 copy's (the int8 screen has its own)


def _approximate(x: torch.Tensor,  # [B, H]
                 head: ScreenedHead) -> tuple[torch.Tensor, torch.Tensor, float, float] | None:
    """(approximate logits [B, V] float32, per-column bound norms [V], coefficient, gather limit) of the screen
    that serves ``B`` rows, as ``LlamaForCausalLM.greedy_token_ids`` picks it; None when none does."""
    rows = x.shape[0]
    int8 = head.int8_screen
    if int8 is not None and head.int8_head is not None and rows <= int8.max_rows:
        approx = torch.ops.deepinfer.int8_head_logits(x, head.int8_head, int8.scales, int8.vocab_size, int8.levels)
        return approx, int8.column_bounds, 1.0, int8.gather_limit
    screen = head.head_screen
    if screen is not None and head.approx_head is not None and x.dtype == torch.float32:
        approx = blocked_linear_float(x.to(torch.bfloat16), head.approx_head, screen.vocab_size)
        return approx, screen.row_norms, screen.coefficient, head.gather_limit
    return None


def masked_greedy_tokens(x: torch.Tensor,  # [B, H] the head's input rows (its dtype)
                         bitmask: torch.Tensor,  # [B, ceil(V/32)] int32 host: 1 bits allowed (all ones: free row)
                         head: ScreenedHead) -> torch.Tensor | None:  # [B] int64
    """Each row's first column holding the largest exact logit among the tokens ``bitmask`` allows; None: compute
    the logits (see the module docstring)."""
    if x.device.type != "cpu" or bitmask.device.type != "cpu" or bitmask.shape[0] != x.shape[0]:
        return None
    found = _approximate(x, head)
    if found is None:
        return None
    approx, norms, coefficient, gather_limit = found
    vocab = head.vocab_size
    whole = vocab // BITS_PER_WORD  # words whose 32 tokens are all in the vocabulary
    allowed = allowed_columns(bitmask, vocab)  # [B, V] bool
    some = (bitmask[:, :whole] != 0).any(dim=1) | allowed[:, whole * BITS_PER_WORD:].any(dim=1)  # cheaper on words
    if not bool(some.all()):
        return None
    x32 = x.float()
    k = coefficient * torch.linalg.vector_norm(x32.double(), dim=1)  # [B] float64, the bound's scale per row
    floor = approx.amin(dim=1).double() - 4.0 * k * float(norms.max()) - 1.0  # [B] below every lower end
    if not bool(torch.isfinite(floor).all()):
        return None
    masked = torch.where(allowed, approx, floor.float()[:, None], out=approx)  # approx is ours: in place
    reach, tiles = torch.ops.deepinfer.screen_tiles(masked, x32, norms, coefficient)  # [B, T] bool, [n] int64
    if reach.numel() == 0 or tiles.numel() == 0 or tiles.numel() > gather_limit * reach.shape[1]:
        return None
    exact = blocked_linear_float(x, head.exact_head.index_select(0, tiles), tiles.numel() * TILE)  # [B, n * 16]
    columns = (tiles[:, None] * TILE + torch.arange(TILE)).flatten()  # [n * 16]; past V: the zero pads
    in_vocab = columns < vocab
    keep = torch.zeros(exact.shape, dtype=torch.bool)
    keep[:, in_vocab] = allowed[:, columns[in_vocab]]
    exact = torch.where(keep, exact, torch.full((), FINITE_FLOOR))
    tokens = torch.ops.deepinfer.pick_screened(exact, tiles, reach, vocab)
    return tokens if tokens.numel() else None
