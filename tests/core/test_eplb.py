"""The EPLB placement (backend_lib/core/eplb.py) on small cases worked out by hand, and its invariants on random
loads."""
from __future__ import annotations

import random

import pytest

from backend_lib.core.eplb import (balanced_packing, contiguous_placement, imbalance, place_experts, replicate)


def test_balanced_packing_heaviest_first_into_the_lightest_pack_with_room():
    # 5 -> p0, 4 -> p1, 2 -> p1 (lighter), 1 -> p0 (p1 is full): 6 and 6
    assert balanced_packing([5, 1, 4, 2], 2) == [0, 0, 1, 1]
    with pytest.raises(ValueError, match="equal packs"):
        balanced_packing([1, 2, 3], 2)


def test_replicas_go_to_the_heaviest_expert_per_copy():
    assert replicate([6, 1, 1, 1], 6) == [3, 1, 1, 1]  # 6 -> 3 per copy, still the heaviest
    assert replicate([4, 3, 1, 1], 6) == [2, 2, 1, 1]  # 4, then 3 (> 4 / 2)
    assert replicate([1, 1], 3) == [2, 1]  # a tie goes to the lower id


def test_one_hot_expert_gets_the_spare_slots_and_the_ranks_even_out():
    loads = [6, 1, 1, 1]
    placement = place_experts(loads, num_ranks=2, num_redundant=2)
    # copies (expert, load per copy): 0 x3 at 2, then 1, 2, 3 at 1; packed 2 -> r0, 2 -> r1, 2 -> r0, 1 -> r1, ...
    assert placement.slot_expert == (0, 0, 3, 0, 1, 2)
    assert placement.copies(0) == (0, 1, 3)
    assert [placement.copy_for(0, t) for t in range(4)] == [0, 1, 3, 0]
    assert placement.rank_loads(loads) == [5.0, 4.0]
    assert imbalance(placement.rank_loads(loads)) == pytest.approx(5 / 4.5)
    assert imbalance(contiguous_placement(4, 2).rank_loads(loads)) == pytest.approx(7 / 4.5)


def test_hierarchical_policy_keeps_groups_on_one_node():
    loads = [8, 8, 1, 1, 1, 1, 1, 1]  # groups of 2: 16, 2, 2, 2 -> node 0 {g0, g3}, node 1 {g1, g2}
    placement = place_experts(loads, num_ranks=4, num_groups=4, num_nodes=2)
    assert placement.slot_expert == (0, 6, 1, 7, 2, 4, 3, 5)
    assert placement.rank_loads(loads) == [9.0, 9.0, 2.0, 2.0]  # nodes are balanced as far as whole groups allow


def test_groups_that_do_not_divide_over_the_nodes_take_the_global_policy():
    loads = [8, 8, 1, 1, 1, 1]
    assert place_experts(loads, 2, num_groups=3, num_nodes=2) == place_experts(loads, 2)


@pytest.mark.parametrize("seed", range(5))
def test_every_expert_has_a_copy_and_replicas_balance_heavy_tailed_loads(seed):
    rng = random.Random(seed)
    loads = [rng.paretovariate(1.2) for _ in range(16)]  # one expert takes 13-76% of the tokens over these seeds
    unbalanced = imbalance(contiguous_placement(16, 4).rank_loads(loads))
    for redundant in (0, 4, 8):
        placement = place_experts(loads, num_ranks=4, num_redundant=redundant)
        assert len(placement.slot_expert) == 16 + redundant and placement.slots_per_rank == (16 + redundant) // 4
        assert sorted(set(placement.slot_expert)) == list(range(16))
        assert sum(placement.rank_loads(loads)) == pytest.approx(sum(loads))
        assert imbalance(placement.rank_loads(loads)) <= unbalanced
    # half as many spare slots as experts bring even the 76% expert's ranks within 1.12 of the mean
    assert imbalance(placement.rank_loads(loads)) <= 1.12


def test_bad_shapes_are_refused_naming_the_setting():
    with pytest.raises(ValueError, match="num_redundant_experts"):
        place_experts([1.0] * 8, num_ranks=3)
    with pytest.raises(ValueError, match="num_redundant_experts must be >= 0"):
        place_experts([1.0] * 8, num_ranks=2, num_redundant=-2)
