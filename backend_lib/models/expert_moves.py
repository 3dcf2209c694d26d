"""EPLB re-placement: the experts' weights move to their new slots, only the slots whose expert changes.

Every rank holds every layer's old and new placement and derives the same plan from them: a changed slot takes its
new expert from a slot of its own rank that held it (a local copy), else from the lowest slot of another rank that
held it. Each (source rank, destination rank) pair exchanges one message over the process group, every moved slot's
tensors as stored (model dtype, fp8 or fp4 bytes with their scales, packed tiles, blocked copies) end to end as
bytes. Everything lands in staging first and the slots are overwritten only once every message has arrived, then
the routing tables switch: the caller runs this between two steps, so no step sees half-moved weights.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from backend_lib.core.eplb import ExpertPlacement
from backend_lib.models.expert_slots import ExpertSlots


@dataclass(frozen=True)
class SlotMove:
    layer: int
    src_rank: int
    src_slot: int  # local index on src_rank, in the old placement
    dst_rank: int
    dst_slot: int  # local index on dst_rank


@dataclass(frozen=True)
class MoveReport:
    moved_slots: int  # over every rank
    sent_bytes: int  # this rank's, to other ranks


def slotted_layers(model: nn.Module) -> list[nn.Module]:
    """The MoE expert modules that hold EPLB slots (``slots``, ``slot_tensors()``), in module order: the same
    order on every rank."""
    return [m for m in model.modules() if isinstance(getattr(m, "slots", None), ExpertSlots)]


def plan_moves(layer: int, old: ExpertPlacement, new: ExpertPlacement) -> list[SlotMove]:
    """The slots of ``new`` whose expert changes, each with its source (see the module docstring)."""
    spr = old.slots_per_rank
    moves = []
    for slot, expert in enumerate(new.slot_expert):
        if old.slot_expert[slot] == expert:
            continue
        dst = old.rank_of_slot(slot)
        holders = old.copies(expert)
        here = [s for s in holders if old.rank_of_slot(s) == dst]
        source = here[0] if here else holders[0]
        moves.append(SlotMove(layer, old.rank_of_slot(source), source % spr, dst, slot % spr))
    return moves


def _slot_bytes(tensors: dict[str, torch.Tensor], slot: int) -> torch.Tensor:  # [n] uint8
    if not tensors:  # a layer the checkpoint left empty (MTP depths it does not carry): only the tables switch
        return torch.empty(0, dtype=torch.uint8)
    return torch.cat([t[slot].contiguous().reshape(-1).view(torch.uint8) for t in tensors.values()])


def _slot_from_bytes(tensors: dict[str, torch.Tensor],
                     blob: torch.Tensor) -> list[torch.Tensor]:  # [n] uint8 -> one slot of each tensor
    parts, at = [], 0
    for t in tensors.values():
        size = t[0].numel() * t.element_size()
        parts.append(blob[at:at + size].clone().view(t.dtype).view(t.shape[1:]))
        at += size
    return parts


def move_experts(layers: list[tuple[ExpertSlots, dict[str, torch.Tensor]]],  # each MoE's slots and slot tensors
                 placements: list[ExpertPlacement], group) -> MoveReport:
    """Every rank calls this with the same ``placements`` (one per layer, in ``layers``' order)."""
    rank = dist.get_rank(group) if group is not None else 0
    moves = [m for i, ((slots, _), new) in enumerate(zip(layers, placements))
             for m in plan_moves(i, slots.placement, new)]
    staged: dict[tuple[int, int], list[torch.Tensor]] = {}
    outgoing: dict[int, list[torch.Tensor]] = {}
    incoming: dict[int, list[SlotMove]] = {}
    for m in moves:
        tensors = layers[m.layer][1]
        if m.src_rank == rank and m.dst_rank == rank:
            staged[m.layer, m.dst_slot] = [t[m.src_slot].clone() for t in tensors.values()]
        elif m.src_rank == rank:
            outgoing.setdefault(m.dst_rank, []).append(_slot_bytes(tensors, m.src_slot))
        elif m.dst_rank == rank:
            incoming.setdefault(m.src_rank, []).append(m)
    requests, buffers = [], {}
    sent = 0
    for dst, blobs in outgoing.items():
        message = torch.cat(blobs)
        sent += message.numel()
        requests.append(dist.isend(message, dst, group=group))
    for src, expected in incoming.items():
        sizes = [sum(t[0].numel() * t.element_size() for t in layers[m.layer][1].values()) for m in expected]
        buffers[src] = (torch.empty(sum(sizes), dtype=torch.uint8), sizes)
        requests.append(dist.irecv(buffers[src][0], src, group=group))
    for request in requests:
        request.wait()
    for src, expected in incoming.items():
        message, sizes = buffers[src]
        for m, blob in zip(expected, message.split(sizes)):
            staged[m.layer, m.dst_slot] = _slot_from_bytes(layers[m.layer][1], blob)
    with torch.no_grad():
        for (layer, slot), parts in staged.items():
            for t, part in zip(layers[layer][1].values(), parts):
                t[slot].copy_(part)
    for (slots, _), new in zip(layers, placements):
        slots.set_placement(new)
    return MoveReport(len(moves), sent)
