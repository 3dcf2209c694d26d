"""Expert-parallel load balancing: where each logical expert's copies live, from measured loads. No torch here.

DeepSeek's algorithm (deepseek-ai/EPLB, ``eplb.py``), written anew for one layer at a time:

1. **Groups onto nodes** (hierarchical policy, when the router's expert groups divide evenly over the nodes): the
   groups' summed loads are packed onto the nodes, every node taking the same number of groups, heaviest group first
   into the lightest node that still has room (keeps a token's group-limited experts on one node).
2. **Replicas**: each node's ``slots / nodes`` physical slots start with one copy of each of its logical experts; each
   spare slot goes to the expert whose load per copy is the highest now (ties: the lower expert id).
3. **Copies onto ranks**: a node's copies, each weighing its expert's load / copies, are packed onto the node's ranks
   the same way as step 1 (the same number of slots on every rank).

Without groups (or when they do not divide over the nodes) the global policy is step 2 and 3 over one node.
The router's choice of a logical expert goes to one of its copies by token index (``copy_for``): a fixed rule, the
same on every rank, that spreads an expert's tokens evenly over its copies. Copies hold the same weights, so the
model's output does not depend on the placement.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class ExpertPlacement:
    """One MoE layer's physical slots: ``slot_expert[s]`` is the logical expert in slot ``s``; rank ``r`` holds slots
    ``r * slots_per_rank`` to ``(r + 1) * slots_per_rank - 1``."""
    slot_expert: tuple[int, ...]
    num_ranks: int

    @property
    def slots_per_rank(self) -> int:
        return len(self.slot_expert) // self.num_ranks

    def copies(self, expert: int) -> tuple[int, ...]:
        """The slots holding ``expert``, in slot order."""
        return tuple(s for s, e in enumerate(self.slot_expert) if e == expert)

    def copy_for(self, expert: int, token_index: int) -> int:
        """The slot that serves ``expert`` for the token at ``token_index`` of the step."""
        slots = self.copies(expert)
        return slots[token_index % len(slots)]

    def rank_of_slot(self, slot: int) -> int:
        return slot // self.slots_per_rank

    def rank_loads(self, expert_loads: Sequence[float]) -> list[float]:
        """Each rank's expected load: an expert's load split evenly over its copies (``copy_for``'s rule)."""
        counts = [0] * len(expert_loads)
        for e in self.slot_expert:
            counts[e] += 1
        loads = [0.0] * self.num_ranks
        for s, e in enumerate(self.slot_expert):
            loads[self.rank_of_slot(s)] += expert_loads[e] / counts[e]
        return loads


def imbalance(rank_loads: Sequence[float]) -> float:
    """The busiest rank's load over the mean (1.0 = balanced; an EP step lasts as long as its busiest rank)."""
    mean = sum(rank_loads) / len(rank_loads)
    return max(rank_loads) / mean if mean > 0 else 1.0


def balanced_packing(weights: Sequence[float], num_packs: int) -> list[int]:
    """Item -> pack, every pack taking ``len(weights) / num_packs`` items: heaviest item first into the lightest pack
    that has room (ties: the lower pack index; equal weights keep their order)."""
    if len(weights) % num_packs:
        raise ValueError(f"{len(weights)} items do not divide into {num_packs} equal packs")
    per_pack = len(weights) // num_packs
    loads, sizes = [0.0] * num_packs, [0] * num_packs
    pack_of = [0] * len(weights)
    for item in sorted(range(len(weights)), key=lambda i: -weights[i]):
        pack = min((p for p in range(num_packs) if sizes[p] < per_pack), key=lambda p: loads[p])
        pack_of[item] = pack
        loads[pack] += weights[item]
        sizes[pack] += 1
    return pack_of


def replicate(loads: Sequence[float], num_slots: int) -> list[int]:
    """Copies per expert over ``num_slots`` slots: one each, then each spare slot to the expert with the highest load
    per copy (ties: the lower expert id)."""
    if num_slots < len(loads):
        raise ValueError(f"{num_slots} slots cannot hold {len(loads)} experts")
    counts = [1] * len(loads)
    for _ in range(num_slots - len(loads)):
        best = max(range(len(loads)), key=lambda e: (loads[e] / counts[e], -e))
        counts[best] += 1
    return counts


def _place_on_node(experts: Sequence[int], loads: Sequence[float], num_slots: int, num_ranks: int) -> list[int]:
    """One node's slots (rank-major) for its ``experts``: replicas, then copies packed onto its ranks."""
    counts = replicate([loads[e] for e in experts], num_slots)
    copies = [(e, loads[e] / c) for e, c in zip(experts, counts) for _ in range(c)]
    rank_of = balanced_packing([w for _, w in copies], num_ranks)
    slots: list[int] = []
    for rank in range(num_ranks):
        slots.extend(e for (e, _), r in zip(copies, rank_of) if r == rank)
    return slots


def place_experts(loads: Sequence[float], num_ranks: int, num_redundant: int = 0, num_groups: int = 1,
                  num_nodes: int = 1) -> ExpertPlacement:
    """A layer's placement of ``len(loads)`` logical experts on ``num_ranks`` ranks (``num_nodes`` nodes of equal
    size) with ``num_redundant`` extra slots; ``num_groups`` is the router's expert groups (1: none)."""
    num_experts = len(loads)
    num_slots = num_experts + num_redundant
    if num_redundant < 0:
        raise ValueError(f"num_redundant_experts must be >= 0, got {num_redundant}")
    if num_slots % num_ranks:
        raise ValueError(f"experts + num_redundant_experts ({num_slots}) must divide over the {num_ranks} "
                         "expert-parallel ranks")
    if num_ranks % num_nodes or num_experts % num_groups:
        raise ValueError(f"{num_ranks} ranks over {num_nodes} nodes, {num_experts} experts in {num_groups} groups: "
                         "each must divide evenly")
    if num_groups % num_nodes:
        num_groups, num_nodes = 1, 1  # the global policy
    group_size = num_experts // num_groups
    group_loads = [sum(loads[g * group_size:(g + 1) * group_size]) for g in range(num_groups)]
    node_of_group = balanced_packing(group_loads, num_nodes)
    slot_expert: list[int] = []
    for node in range(num_nodes):
        experts = [e for e in range(num_experts) if node_of_group[e // group_size] == node]
        slot_expert += _place_on_node(experts, loads, num_slots // num_nodes, num_ranks // num_nodes)
    return ExpertPlacement(tuple(slot_expert), num_ranks)


def contiguous_placement(num_experts: int, num_ranks: int) -> ExpertPlacement:
    """Expert parallelism without balancing: rank r holds experts r * E / N to (r + 1) * E / N - 1."""
    return ExpertPlacement(tuple(range(num_experts)), num_ranks)
