"""EPLB on the driver: the router's per-layer, per-expert counts over a sliding window of steps, the imbalance they
give under the current placement, and every ``eplb_interval_steps`` a new placement (core/eplb.py) that every rank
applies between two steps (models/expert_moves.py), the workers told through the step channel.

The counts need no collective: every rank computes the same router output over the same (replicated) hidden
states, so the driver's own count is every rank's. ``apply_placements`` is what every rank runs.
"""
from __future__ import annotations

import logging
import time

import torch
from torch import nn

from backend_lib.core.config import EplbConfig
from backend_lib.core.eplb import ExpertPlacement, imbalance, place_experts
from backend_lib.core.outputs import EplbStats
from backend_lib.models.expert_moves import MoveReport, move_experts, slotted_layers
from backend_lib.worker.step_messages import StepLink

log = logging.getLogger("deepinfer.eplb")


def apply_placements(model: nn.Module, table: torch.Tensor,  # [layers, slots] int64 the new slot -> expert
                     ) -> MoveReport:
    """Move this rank's slots to the placements of ``table`` (every rank calls it with the same table)."""
    layers = slotted_layers(model)
    if table.shape[0] != len(layers):
        raise ValueError(f"a placement table of {table.shape[0]} layers for a model of {len(layers)} EPLB layers")
    num_ranks = layers[0].slots.par.world_size
    placements = [ExpertPlacement(tuple(row), num_ranks) for row in table.tolist()]
    return move_experts([(m.slots, m.slot_tensors()) for m in layers], placements, layers[0].slots.par.group)


class ExpertLoadBalancer:
    def __init__(self, model: nn.Module, config: EplbConfig, num_nodes: int, link: StepLink | None) -> None:
        self.model, self.config, self.num_nodes, self.link = model, config, num_nodes, link
        self.layers = slotted_layers(model)
        if not self.layers:
            raise ValueError("enable_eplb needs a model with top-k routed MoE layers (DeepSeek-V3, DeepSeek-V4)")
        num_experts = self.layers[0].slots.num_experts
        # [window, layers, experts]: row step % window holds that step's counts (int32: 61 MB at V3's 61 x 256 over
        # vLLM's default window of 1,000 steps)
        self.window = torch.zeros(config.eplb_window_steps, len(self.layers), num_experts, dtype=torch.int32)
        self.steps = self.rebalances = self.moved_slots = 0
        self.last_pause_s = 0.0

    def after_step(self) -> None:
        """Count the step's router choices; re-place the experts when the interval is up."""
        self.window[self.steps % self.config.eplb_window_steps] = torch.stack(
            [m.slots.take_loads() for m in self.layers])
        self.steps += 1
        if self.steps % self.config.eplb_interval_steps == 0:
            self.rebalance()

    def window_loads(self) -> torch.Tensor:  # [layers, experts] int64
        return self.window.sum(dim=0, dtype=torch.int64)

    def rebalance(self) -> None:
        """A placement per layer from the window's loads, applied on every rank before the next step."""
        loads = self.window_loads()
        if int(loads.sum()) == 0:
            return  # nothing measured yet: keep the placement
        start = time.perf_counter()
        redundant = self.layers[0].slots.par.eplb_redundant_experts
        num_ranks = self.layers[0].slots.par.world_size
        table = torch.tensor([place_experts(row, num_ranks, redundant, m.slots.num_groups, self.num_nodes).slot_expert
                              for m, row in zip(self.layers, loads.tolist())], dtype=torch.int64)
        placed_ms = 1e3 * (time.perf_counter() - start)
        before = self.worst_imbalance(loads)
        report = self.apply(table)
        log.info("eplb: re-placed %d layers at step %d (placement %.1f ms): %d slots moved (%.1f MB sent by the "
                 "driver), worst-layer imbalance %.2f -> %.2f over the window, paused %.1f ms", len(self.layers),
                 self.steps, placed_ms, report.moved_slots, report.sent_bytes / 1e6, before,
                 self.worst_imbalance(loads), 1e3 * self.last_pause_s)

    def apply(self, table: torch.Tensor,  # [layers, slots] int64 slot -> expert
              ) -> MoveReport:
        """Every rank moves its experts to ``table`` (the workers told first, through the step channel); the
        pause between the two steps is ``last_pause_s``. Also a static placement's way in (benchmarks/eplb.py)."""
        start = time.perf_counter()
        if self.link is not None:
            self.link.send_placements(table)
        report = apply_placements(self.model, table)
        self.last_pause_s = time.perf_counter() - start
        self.rebalances += 1
        self.moved_slots += report.moved_slots
        return report

    def layer_imbalance(self, loads: torch.Tensor | None = None) -> list[float]:
        """Per layer: the busiest rank's share of ``loads`` (default: the window's) under the current placement."""
        rows = (self.window_loads() if loads is None else loads).tolist()
        return [imbalance(m.slots.placement.rank_loads(row)) for m, row in zip(self.layers, rows)]

    def worst_imbalance(self, loads: torch.Tensor | None = None) -> float:
        return max(self.layer_imbalance(loads))

    def stats(self) -> EplbStats:
        return EplbStats(self.layer_imbalance(), self.rebalances, self.last_pause_s, self.moved_slots)
