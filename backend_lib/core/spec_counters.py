"""Cumulative speculative-decoding counters the scheduler keeps (the EngineStats spec_* fields). No torch."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecCounters:
    """Cumulative speculative-decoding counters (the EngineStats spec_* fields)."""

    num_drafts: int = 0  # request-steps that verified at least one draft
    draft_tokens: int = 0
    accepted_tokens: int = 0
    drafts_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)
    # index L: request-steps whose proposer chose L drafts for the next step (0: the schedule kept drafting off)
    chosen_lengths: list[int] = field(default_factory=list)

    def record_choice(self, length: int) -> None:
        if length >= len(self.chosen_lengths):
            self.chosen_lengths += [0] * (length + 1 - len(self.chosen_lengths))
        self.chosen_lengths[length] += 1

    def record(self, num_drafts: int, num_accepted: int) -> None:
        if num_drafts == 0:
            return
        grow = num_drafts - len(self.drafts_per_position)
        if grow > 0:
            self.drafts_per_position += [0] * grow
            self.accepted_per_position += [0] * grow
        self.num_drafts += 1
        self.draft_tokens += num_drafts
        self.accepted_tokens += num_accepted
        for j in range(num_drafts):
            self.drafts_per_position[j] += 1
            self.accepted_per_position[j] += j < num_accepted
