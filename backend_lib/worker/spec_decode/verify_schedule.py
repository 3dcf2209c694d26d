"""Confidence-scheduled verification: how many of the drafted tokens the next step verifies (vLLM's
``DSparkScheduler``, DeepSpec's paper, written anew).

With ``R`` requests in a step, ``R_d`` of them drafting, each verifying ``L`` drafts whose prefix of ``j`` survives
with probability ``S_j``, a step emits ``R + R_d * sum_{j<=L} S_j`` tokens in time
``T(L) = step(R + R_d * L) + [L > 0] * draft_share * step(R_d * B)`` (verification rows, plus the drafter's block
of ``B`` rows a request). The schedule picks the batch-uniform ``L`` in ``[0, k]`` with the most tokens per unit of
time, keeping the previous ``L`` unless another is ``hysteresis`` better (noisy survivals would flip it every step);
``L = 0`` skips drafting: plain steps where verification does not pay (large batches on the host, where the
few-row GEMM's flat cost ends).

``S_j``: DSpark's confidence head predicts it (the batch mean of each request's running product), calibrated online
by the observed prefix acceptance over the predicted one per position; DFlash has no head, so the observed prefix
acceptance itself. Everything comes from steps already verified, so the length of step t + 1 is known when step t
ends (zero-overhead scheduling can later move it earlier). While ``L = 0`` the drafter does not run and nothing is
observed, so every ``probe_every``-th such step runs it and verifies at least one draft to keep the estimate alive
(only where drafting could pay at all).
"""
from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class VerifyCost:
    """A step's time by the rows it runs, relative to a one-row step, piecewise linear between the measured points
    and extrapolated along the last segment."""

    rows: tuple[int, ...]
    cost: tuple[float, ...]
    draft_share: float  # the drafter's pass over R_d * B rows, as a share of a target step over as many rows

    def __post_init__(self) -> None:
        if len(self.rows) < 2 or len(self.rows) != len(self.cost) or list(self.rows) != sorted(set(self.rows)):
            raise ValueError(f"verify cost table needs >= 2 strictly increasing rows with one cost each, got "
                             f"{self.rows} / {self.cost}")
        if self.draft_share < 0:
            raise ValueError(f"verify cost draft_share must be >= 0, got {self.draft_share}")

    def step(self, rows: int) -> float:
        i = min(max(bisect.bisect_left(self.rows, rows), 1), len(self.rows) - 1)
        (r0, r1), (c0, c1) = self.rows[i - 1:i + 1], self.cost[i - 1:i + 1]
        return max(c0 + (c1 - c0) * (rows - r0) / (r1 - r0), self.cost[0])


# The engine's own measurement: SmolLM2's layer GEMMs summed by rows on the 2-core host (benchmarks/gemv.py's
# crossover sweep, benchmarks/results/gemv_zen4.md: 257, 265, 274, 339, 418, 567, 711 us at 1..32 rows). The drafter
# (1-2 layers and the shared head over its block) is about a quarter of a target step over the same rows.
HOST_SMOLLM2_COST = VerifyCost(rows=(1, 4, 8, 12, 16, 24, 32), cost=(1.0, 1.03, 1.07, 1.32, 1.63, 2.21, 2.77),
                               draft_share=0.25)


@dataclass
class PositionCalibration:
    """Per draft position: EMAs of the predicted and the observed prefix survival."""

    decay: float
    predicted: list[float]
    observed: list[float]

    @classmethod
    def start(cls, positions: int, decay: float) -> "PositionCalibration":
        # optimistic prior: drafting starts on, and the first verifications pull the estimate to the truth
        return cls(decay, [1.0] * positions, [1.0] * positions)

    def observe(self, predicted: Sequence[float], accepted: int) -> None:
        for j, p in enumerate(predicted):
            d = self.decay
            self.predicted[j] = d * self.predicted[j] + (1 - d) * p
            self.observed[j] = d * self.observed[j] + (1 - d) * float(accepted > j)

    def factor(self, j: int) -> float:
        return self.observed[j] / max(self.predicted[j], 1e-6)


@dataclass
class VerifyLengthSchedule:
    max_len: int  # k = num_speculative_tokens
    block_size: int  # B: the drafter's rows a request
    cost: VerifyCost = HOST_SMOLLM2_COST
    hysteresis: float = 0.05
    decay: float = 0.9
    probe_every: int = 16
    calibration: PositionCalibration = field(init=False)
    previous: int = field(init=False)
    idle_steps: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        if not 1 <= self.max_len <= self.block_size:
            raise ValueError(f"num_speculative_tokens must be in [1, the drafter's block_size {self.block_size}], "
                             f"got {self.max_len}")
        self.calibration = PositionCalibration.start(self.max_len, self.decay)
        self.previous = self.max_len

    def rate(self, requests: int, drafting: int, length: int, survival: Sequence[float]) -> float:
        """Expected tokens per unit of time of a step verifying ``length`` drafts for each drafting request."""
        time = self.cost.step(requests + drafting * length)
        if length:
            time += self.cost.draft_share * self.cost.step(drafting * self.block_size)
        return (requests + drafting * sum(survival[:length])) / time

    def worth_drafting(self, requests: int, drafting: int) -> bool:
        """Whether any length could beat plain steps even if every draft survived (else skip the drafter)."""
        ones = [1.0] * self.max_len
        return drafting > 0 and max(self.rate(requests, drafting, L, ones) for L in range(1, self.max_len + 1)) > \
            self.rate(requests, drafting, 0, ones)

    def survival(self, predicted: Sequence[float] | None) -> list[float]:
        """Calibrated batch-mean survival per position (``predicted``: the head's batch mean; None: DFlash)."""
        cal = self.calibration
        if predicted is None:
            return list(cal.observed)
        return [min(1.0, p * cal.factor(j)) for j, p in enumerate(predicted[:self.max_len])]

    def wants_drafts(self, requests: int, drafting: int) -> bool:
        """Before the drafter's pass: run it? Not where no length could pay; while the last choice was ``L = 0``
        only every ``probe_every``-th step (a probe: fresh confidences, and one draft verified at least)."""
        if not self.worth_drafting(requests, drafting):
            self.previous = 0
            return False
        if self.previous:
            return True
        self.idle_steps += 1
        return self.idle_steps % self.probe_every == 0

    def choose(self, requests: int, drafting: int, predicted: Sequence[float] | None) -> int:
        """After the drafter's pass: the next step's length (at least 1 on a probe step)."""
        probing = self.previous == 0
        survival = self.survival(predicted)
        rates = [self.rate(requests, drafting, L, survival) for L in range(self.max_len + 1)]
        best = max(range(len(rates)), key=rates.__getitem__)
        if rates[best] <= rates[self.previous] * (1 + self.hysteresis):
            best = self.previous
        self.previous = best
        if best:
            self.idle_steps = 0
        return max(best, 1) if probing else best
