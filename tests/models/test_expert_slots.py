"""EPLB's routing map on a small case: over the ranks, every (token, chosen expert) pair goes to exactly one slot,
the placement's ``copy_for`` copy, which holds that expert; and a model with slots computes what one without does."""
from __future__ import annotations

import pytest
import torch

from backend_lib.core.eplb import place_experts
from backend_lib.models.expert_slots import ExpertSlots
from backend_lib.models.parallel import ParallelContext


def _rank_slots(num_experts: int, ranks: int, redundant: int) -> list[ExpertSlots]:
    return [ExpertSlots(num_experts, ParallelContext(rank=r, world_size=ranks, expert_parallel=True, group=object(),
                                                     eplb_redundant_experts=redundant)) for r in range(ranks)]


@pytest.mark.parametrize("ranks, redundant", [(2, 0), (2, 2), (4, 4)])
def test_every_pair_is_computed_once_on_its_copy(ranks, redundant):
    num_experts, tokens, top_k = 8, 37, 3
    loads = [50.0, 1, 1, 30, 2, 2, 9, 5]  # skewed: the placement gives experts 0 and 3 copies
    placement = place_experts(loads, ranks, redundant)
    per_rank = _rank_slots(num_experts, ranks, redundant)
    for slots in per_rank:
        slots.set_placement(placement)
    ids = torch.stack([torch.randperm(num_experts, generator=torch.Generator().manual_seed(t))[:top_k]
                       for t in range(tokens)])
    routed = [slots.route(ids) for slots in per_rank]
    spr = per_rank[0].slots_per_rank
    for t in range(tokens):
        for j in range(top_k):
            expert = int(ids[t, j])
            holders = [r for r in range(ranks) if int(routed[r][t, j]) != spr]
            assert len(holders) == 1
            slot = holders[0] * spr + int(routed[holders[0]][t, j])
            assert slot == placement.copy_for(expert, t) and placement.slot_expert[slot] == expert


def test_the_driver_counts_the_router_choices():
    driver, worker = _rank_slots(4, 2, 0)
    ids = torch.tensor([[0, 1], [0, 3], [0, 1]])
    driver.route(ids)
    worker.route(ids)
    assert driver.take_loads().tolist() == [3, 2, 0, 1] and driver.take_loads().tolist() == [0, 0, 0, 0]
    assert worker.take_loads().tolist() == [0, 0, 0, 0]  # only the driver's counts are read


def test_slots_that_do_not_divide_over_the_ranks_name_the_settings():
    with pytest.raises(ValueError, match=r"n_routed_experts \(8\) \+ num_redundant_experts \(1\)"):
        _rank_slots(8, 2, 1)


def test_a_moe_layer_with_slots_equals_one_without():
    """One rank holding 8 experts in 10 slots (two copies): the routed sum is the contiguous layer's."""
    from backend_lib.models.deepseek_v3.moe import MoE
    from kernels.moe import RouterConfig

    torch.manual_seed(0)
    router = RouterConfig(top_k=2, num_experts=8)
    plain = MoE(16, 8, 0, router, (128, 128), ParallelContext())
    slotted = MoE(16, 8, 0, router, (128, 128), ParallelContext(expert_parallel=True, eplb_redundant_experts=2))
    for e in range(8):
        for proj, shape in plain.experts.shapes.items():
            weight = torch.randn(shape)
            plain.experts.set_expert(e, proj, weight, None, torch.float32, False)
            slotted.experts.set_expert(e, proj, weight, None, torch.float32, False)
    plain.gate.weight.normal_()
    slotted.gate.weight.copy_(plain.gate.weight)
    x = torch.randn(9, 16)
    assert slotted.experts.num_experts == 10
    torch.testing.assert_close(slotted(x), plain(x), rtol=1e-5, atol=1e-6)
