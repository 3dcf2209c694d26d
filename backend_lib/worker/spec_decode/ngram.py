"""N-gram prompt lookup (any model): match the last n tokens of prompt + output earlier in the sequence and propose
the tokens that followed that earlier occurrence.

The longest n in ``[min_n, max_n]`` with a match wins; among matches of that length the most recent one is used
(copy-heavy outputs usually continue the passage they are copying right now). Host-only, numpy, no torch.

How many drafts (lossless either way: drafts only decide how many tokens one verification may emit):
- a match of a single token (``n < confident_n``) is weak evidence (a newline, a comma, "the" recur everywhere):
  it drafts at most ``short_match_drafts`` tokens. On the copy benchmark (benchmarks/spec_decode.py) one-token
  matches were accepted at the first position about half as often as longer ones, and almost never past it;
- a longer match drafts up to ``k``;
- the whole step's verification rows stay within ``max_rows`` (``batch_limit``): the host's few-row GEMM
  (kernels/csrc/gemv.cpp) reads the weights once for up to 8 rows, so up to 8 rows a verification costs about
  one plain step, and past them it starts paying (a second pass over each weight tile, then oneDNN's GEMM past
  16 rows). At batch 1 that is 7 drafts, at batch 4 one each, at batch 8 none (plain steps, no slowdown).
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    def __init__(self, min_n: int, max_n: int, num_speculative_tokens: int, confident_n: int = 2,
                 short_match_drafts: int = 1, max_rows: int = 8) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"ngram range must satisfy 1 <= min_n <= max_n, got [{min_n}, {max_n}]")
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
        if short_match_drafts < 0 or max_rows < 1:
            raise ValueError(f"short_match_drafts must be >= 0 and max_rows >= 1, got {short_match_drafts}, "
                             f"{max_rows}")
        self.min_n, self.max_n, self.k = min_n, max_n, num_speculative_tokens
        self.confident_n, self.short_match_drafts, self.max_rows = confident_n, short_match_drafts, max_rows

    def batch_limit(self, num_requests: int) -> int:
        """Drafts per request when ``num_requests`` verify in one step: each takes 1 + drafts rows."""
        return max(0, min(self.k, self.max_rows // max(1, num_requests) - 1))

    def propose(self, token_ids: Sequence[int], max_tokens: int | None = None) -> list[int]:
        """Up to ``min(k, max_tokens)`` draft tokens that follow an earlier occurrence of the sequence's suffix
        (fewer after a one-token match)."""
        limit = self.k if max_tokens is None else min(self.k, max_tokens)
        length = len(token_ids)
        if limit <= 0 or length < self.min_n + 1:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            # Windows that start before the suffix itself: window i covers tokens[i : i + n], followed by i + n.
            windows = sliding_window_view(tokens[:length - 1], n)
            hits = np.flatnonzero((windows == tokens[length - n:]).all(axis=1))
            if hits.size:
                follow = int(hits[-1]) + n
                count = limit if n >= self.confident_n else min(limit, self.short_match_drafts)
                return tokens[follow:follow + count].tolist()
        return []
