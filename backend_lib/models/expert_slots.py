"""EPLB inside a MoE layer: this rank's physical expert slots and the routing of each (token, expert) pair to one.

With EPLB on (``ParallelContext.eplb_redundant_experts``) a top-k MoE layer's routed experts are stacked by slot, not
by expert: rank r holds the placement's slots ``r * slots_per_rank`` onwards (core/eplb.py), a checkpoint expert is
written into every local slot that holds it, and a token's choice of a logical expert goes to the copy
``copy_for(expert, token_index)`` picks. Every rank sees every token and the same router output, so every rank makes
the same choice: the pair is computed on exactly one rank (the copy's), the others route it to the sink index
``slots_per_rank`` the MoE kernels skip, and the MoE's all-reduce adds the one result.

The driver also counts the router's choices per logical expert here (``load_counts``): every rank computes the same
top-k, so the counts need no collective; worker/eplb.py keeps them over a window and re-places the experts.
"""
from __future__ import annotations

import torch
from torch import nn

from backend_lib.core.eplb import ExpertPlacement, contiguous_placement, place_experts
from backend_lib.models.parallel import ParallelContext


def initial_placement(num_experts: int, num_ranks: int, num_redundant: int) -> ExpertPlacement:
    """Before any load is measured: contiguous ranges without redundant slots, else the placement of uniform loads
    (each spare slot a second copy of the next expert id)."""
    if num_redundant == 0:
        return contiguous_placement(num_experts, num_ranks)
    return place_experts([1.0] * num_experts, num_ranks, num_redundant)


class ExpertSlots(nn.Module):
    """One MoE layer's placement as routing tables: ``copy_slots [E, 1 + R]`` (an expert's slots in slot order,
    padded) and ``copy_counts [E]``; buffers, so they follow the model's device."""

    def __init__(self, num_experts: int, par: ParallelContext, num_groups: int = 1) -> None:
        super().__init__()
        redundant = par.eplb_redundant_experts
        if redundant is None:
            raise ValueError("ExpertSlots needs EPLB on (ParallelContext.eplb_redundant_experts)")
        total = num_experts + redundant
        if total % par.world_size:
            raise ValueError(f"enable_eplb: n_routed_experts ({num_experts}) + num_redundant_experts ({redundant}) = "
                             f"{total} slots do not divide over the {par.world_size} expert-parallel ranks")
        self.num_experts, self.num_groups, self.par = num_experts, num_groups, par
        self.slots_per_rank = total // par.world_size
        self.first_slot = par.rank * self.slots_per_rank
        self.record_loads = par.is_driver  # only the driver's counts are read (worker/eplb.py)
        self.register_buffer("copy_slots", torch.zeros(num_experts, 1 + redundant, dtype=torch.int64),
                             persistent=False)
        self.register_buffer("copy_counts", torch.ones(num_experts, dtype=torch.int64), persistent=False)
        self.register_buffer("load_counts", torch.zeros(num_experts, dtype=torch.int64), persistent=False)
        self.placement = initial_placement(num_experts, par.world_size, redundant)
        self.set_placement(self.placement)

    def set_placement(self, placement: ExpertPlacement) -> None:
        """The routing tables of ``placement`` (its weights must already be in the slots: expert_moves.py)."""
        if len(placement.slot_expert) != self.slots_per_rank * self.par.world_size:
            raise ValueError(f"a placement of {len(placement.slot_expert)} slots for a layer of "
                             f"{self.slots_per_rank * self.par.world_size}")
        copies = [placement.copies(e) for e in range(self.num_experts)]
        if min(len(c) for c in copies) == 0:
            raise ValueError("a placement must hold every expert at least once")
        table = torch.zeros_like(self.copy_slots)
        for expert, slots in enumerate(copies):
            table[expert, :len(slots)] = torch.tensor(slots, dtype=torch.int64)
        self.copy_slots.copy_(table)
        self.copy_counts.copy_(torch.tensor([len(c) for c in copies], dtype=torch.int64))
        self.placement = placement

    def local_slots(self, expert: int) -> list[int]:
        """This rank's slots (local indices) holding ``expert``; empty when only other ranks hold it."""
        return [s - self.first_slot for s in self.placement.copies(expert)
                if self.first_slot <= s < self.first_slot + self.slots_per_rank]

    def held_experts(self) -> set[int]:
        start = self.first_slot
        return set(self.placement.slot_expert[start:start + self.slots_per_rank])

    def route(self, topk_ids: torch.Tensor,  # [T, k] int64 logical expert ids
              ) -> torch.Tensor:  # [T, k] int64 local slot, or slots_per_rank (the sink) for another rank's copy
        """Each pair's copy (``ExpertPlacement.copy_for``: token index modulo the expert's copies, in slot order) as
        this rank's local slot; counts the choices on the driver."""
        if self.record_loads:
            self.load_counts += torch.bincount(topk_ids.flatten(), minlength=self.num_experts)
        token = torch.arange(topk_ids.shape[0], device=topk_ids.device)[:, None]
        which = token % self.copy_counts[topk_ids]
        local = self.copy_slots[topk_ids, which] - self.first_slot
        inside = (local >= 0) & (local < self.slots_per_rank)
        return torch.where(inside, local, torch.full_like(local, self.slots_per_rank))

    def take_loads(self) -> torch.Tensor:  # [E] int64 the choices counted since the last call
        loads = self.load_counts.clone()
        self.load_counts.zero_()
        return loads
