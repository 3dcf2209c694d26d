"""N-gram prompt lookup: longest match wins, the most recent occurrence is used, limits are honoured; a one-token
match drafts little; a step's verification rows stay within the few-row GEMM's one pass."""
from __future__ import annotations

import pytest

from backend_lib.worker.spec_decode.ngram import NgramProposer


def test_longest_then_most_recent_match():
    p = NgramProposer(1, 3, 4)
    assert p.propose([1, 2, 3, 4, 5, 1, 2, 3]) == [4, 5, 1, 2]
    # the 2-gram [7, 8] occurs twice: the later occurrence is followed by 9
    assert p.propose([7, 8, 1, 7, 8, 9, 0, 7, 8]) == [9, 0, 7, 8]
    # a 3-gram match beats a more recent 1-gram match
    assert p.propose([4, 5, 6, 11, 6, 12, 4, 5, 6]) == [11, 6, 12, 4]


def test_one_token_match_drafts_one_token():
    p = NgramProposer(1, 4, 7)
    assert p.propose([5, 1, 2, 3, 4, 6, 7, 5]) == [1]  # only the last token matches
    assert p.propose([6, 5, 1, 2, 3, 4, 6, 7, 6, 5]) == [1, 2, 3, 4, 6, 7, 6]  # [6, 5] matches: up to k
    assert NgramProposer(1, 4, 7, short_match_drafts=3).propose([5, 1, 2, 3, 4, 6, 7, 5]) == [1, 2, 3]


def test_batch_limit_keeps_verification_rows_within_one_pass():
    p = NgramProposer(1, 4, 7)
    assert [p.batch_limit(b) for b in (1, 2, 3, 4, 5, 8, 16)] == [7, 3, 1, 1, 0, 0, 0]
    assert NgramProposer(1, 4, 3).batch_limit(1) == 3  # never more than k
    assert NgramProposer(1, 4, 7, max_rows=16).batch_limit(2) == 7


def test_no_match_limits_and_bad_config():
    p = NgramProposer(2, 4, 3)
    assert p.propose([1, 2, 3, 4]) == []
    assert p.propose([1]) == []
    assert p.propose([1, 2, 9, 1, 2], max_tokens=1) == [9]
    assert p.propose([1, 2, 9, 1, 2], max_tokens=0) == []
    assert p.propose([1, 2, 1, 2]) == [1, 2]  # proposals stop at the end of the sequence
    with pytest.raises(ValueError, match="ngram range"):
        NgramProposer(3, 2, 1)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        NgramProposer(1, 2, 0)


def test_spec_config_needs_drafts_for_a_method():
    from backend_lib.core.config import SpecConfig
    with pytest.raises(ValueError, match="num_speculative_tokens in \\[1, 16\\]"):
        SpecConfig(method="ngram", num_speculative_tokens=0)
    assert SpecConfig(method="none", num_speculative_tokens=0).method == "none"
