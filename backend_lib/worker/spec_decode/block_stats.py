"""DSpark's survival calibration for /metrics (cumulative, host-side, no torch): per draft position, the confidence
head's predicted survival next to the share verification accepted, over the same drafts."""
from __future__ import annotations

from collections.abc import Sequence

from backend_lib.core.outputs import SpecSurvivalStats


class SurvivalCalibration:
    def __init__(self, max_len: int) -> None:
        self.predicted = [0.0] * max_len  # per position: summed predicted survival
        self.survived = [0] * max_len  # per position: drafts whose prefix through it was accepted
        self.verified = [0] * max_len  # per position: drafts verified there

    def observe(self, predicted: Sequence[float], accepted: int) -> None:
        """One request-step's predicted survival per verified draft, and how many of them verification accepted."""
        for j, p in enumerate(predicted):
            self.predicted[j] += p
            self.survived[j] += accepted > j
            self.verified[j] += 1

    def snapshot(self) -> SpecSurvivalStats:
        seen = [j for j, n in enumerate(self.verified) if n]
        return SpecSurvivalStats(predicted=[self.predicted[j] / self.verified[j] for j in seen],
                                 observed=[self.survived[j] / self.verified[j] for j in seen])
