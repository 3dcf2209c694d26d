"""What the block drafters' verify schedule did, for /metrics (cumulative, host-side, no torch): how many drafts
each request-step was given (the chosen lengths, 0 while the schedule keeps drafting off), and DSpark's survival
calibration: per draft position, the confidence head's predicted survival next to the share verification
accepted, over the same drafts."""
from __future__ import annotations

from collections.abc import Iterable, Sequence

from backend_lib.core.outputs import SpecScheduleStats


class BlockDraftCounters:
    def __init__(self, max_len: int) -> None:
        self.lengths = [0] * (max_len + 1)  # index L: request-steps given L drafts
        self.predicted = [0.0] * max_len  # per position: summed predicted survival
        self.survived = [0] * max_len  # per position: drafts whose prefix through it was accepted
        self.verified = [0] * max_len  # per position: drafts verified there

    def given(self, lengths: Iterable[int]) -> None:
        for n in lengths:
            self.lengths[n] += 1

    def observe(self, predicted: Sequence[float], accepted: int) -> None:
        """One request-step's predicted survival per verified draft, and how many of them verification accepted."""
        for j, p in enumerate(predicted):
            self.predicted[j] += p
            self.survived[j] += accepted > j
            self.verified[j] += 1

    def snapshot(self) -> SpecScheduleStats:
        seen = [j for j, n in enumerate(self.verified) if n]
        return SpecScheduleStats(verify_lengths=list(self.lengths),
                                 predicted_survival=[self.predicted[j] / self.verified[j] for j in seen],
                                 observed_survival=[self.survived[j] / self.verified[j] for j in seen])
