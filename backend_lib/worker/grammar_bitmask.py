"""The step's grammar bitmask: one persistent host tensor ``[rows, ceil(V/32)] int32`` the driver fills for the
constrained sampling rows of a step (V = the model's padded logits width, the width the grammars were compiled for).

Between steps every row is all ones (``fill`` first resets the rows the previous step wrote), so a compiled sampler
region, which masks every row of its batch bucket, leaves free rows unchanged. Only the driver samples, so only the
driver has one: the mask never crosses ranks.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from backend_lib.structured_output.matcher import GrammarMatcher, allocate_bitmask
from kernels.grammar_mask import FULL_WORD


class StepBitmask:
    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._mask: torch.Tensor | None = None  # [capacity, W] int32, grown on demand
        self._written: list[int] = []  # rows the last fill wrote (reset by the next)

    def fill(self, groups: Sequence[tuple[GrammarMatcher | None, Sequence[int]]],
             ) -> tuple[torch.Tensor | None, tuple[int, ...]]:
        """``groups``: per sampling request, its matcher (None: free) and the drafts it verifies; it takes
        ``len(drafts) + 1`` consecutive rows. Returns the bitmask of those rows ([N, W] int32 host view, all ones
        on free rows) and the constrained rows, or (None, ()) when no request is constrained."""
        if self._written:
            self._mask[self._written] = FULL_WORD
            self._written = []
        if all(matcher is None for matcher, _ in groups):
            return None, ()
        total = sum(len(drafts) + 1 for _, drafts in groups)
        if self._mask is None or self._mask.shape[0] < total:
            self._mask = allocate_bitmask(max(total, 2 * (0 if self._mask is None else self._mask.shape[0])),
                                          self.vocab_size)
        row = 0
        for matcher, drafts in groups:
            rows = len(drafts) + 1
            if matcher is not None:
                if drafts:  # each verified position's mask: the state after the drafts before it
                    matcher.fill_draft_bitmasks(self._mask, row, list(drafts))
                else:
                    matcher.fill_bitmask(self._mask, row)
                self._written += range(row, row + rows)
            row += rows
        return self._mask[:total], tuple(self._written)
