"""N-gram prompt lookup (any model): match the last n tokens of prompt + output earlier in the sequence and propose
the tokens that followed that earlier occurrence.

The longest n in ``[min_n, max_n]`` with a match wins; among matches of that length the most recent one is used
(copy-heavy outputs usually continue the passage they are copying right now). Host-only, numpy, no torch.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    def __init__(self, min_n: int, max_n: int, num_speculative_tokens: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"ngram range must satisfy 1 <= min_n <= max_n, got [{min_n}, {max_n}]")
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
        self.min_n, self.max_n, self.k = min_n, max_n, num_speculative_tokens

    def propose(self, token_ids: Sequence[int], max_tokens: int | None = None) -> list[int]:
        """Up to ``min(k, max_tokens)`` draft tokens that follow an earlier occurrence of the sequence's suffix."""
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
                return tokens[follow:follow + limit].tolist()
        return []
