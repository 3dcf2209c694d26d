"""BlockPool / KVCacheManager: allocation, ref counts, prefix hits, LRU reuse of cached blocks, integrity."""
from __future__ import annotations

import pytest

from backend_lib.core.kv_cache import BlockPool, KVCacheManager, hash_block
from backend_lib.core.request import Request
from backend_lib.core.sampling_params import SamplingParams

BS = 4


def _request(rid: str, tokens: list[int]) -> Request:
    return Request(request_id=rid, prompt_token_ids=list(tokens), sampling_params=SamplingParams(max_tokens=4),
                   seed=0)


def _admit(manager: KVCacheManager, request: Request) -> int:
    """Admit with prefix hits, as the scheduler does; returns the number of cached tokens."""
    blocks, cached = manager.get_computed_blocks(request)
    new = request.num_tokens - cached
    assert manager.can_allocate(request, new, blocks)
    manager.allocate(request, new, blocks)
    request.num_computed_tokens = cached
    return cached


def _compute_all(manager: KVCacheManager, request: Request) -> None:
    request.num_computed_tokens = request.num_tokens
    manager.cache_blocks(request, request.num_computed_tokens)


def test_allocate_append_free_counts_and_slots():
    manager = KVCacheManager(num_blocks=8, block_size=BS, enable_prefix_caching=False)
    request = _request("a", list(range(10)))
    assert manager.can_allocate(request, 10)
    blocks = manager.allocate(request, 10)
    assert len(blocks) == 3 and manager.num_used_blocks == 3 and manager.num_free_blocks == 5
    request.num_computed_tokens = 10
    assert manager.num_slots_missing(request, 2) == 0  # positions 10, 11 fit in the third block
    assert manager.num_slots_missing(request, 3) == 1
    manager.append_slots(request, 3)
    assert len(request.block_ids) == 4
    assert manager.slot(request.block_ids, 5) == request.block_ids[1] * BS + 1
    assert manager.slot_mapping(request.block_ids, 6, 3) == [manager.slot(request.block_ids, p) for p in (6, 7, 8)]
    assert not manager.can_append(request, 6 * BS)
    with pytest.raises(ValueError, match="call can_append first"):
        manager.append_slots(request, 6 * BS)
    manager.free(request)
    assert request.block_ids == [] and manager.num_used_blocks == 0
    manager.check_integrity(holders=[])


def test_prefix_hit_shares_blocks_and_never_covers_the_whole_sequence():
    manager = KVCacheManager(num_blocks=16, block_size=BS)
    first = _request("a", list(range(10)))
    assert _admit(manager, first) == 0
    _compute_all(manager, first)  # two full blocks hashed; the third (2 tokens) is not full
    second = _request("b", list(range(10)) + [99, 98])
    assert _admit(manager, second) == 2 * BS
    assert second.block_ids[:2] == first.block_ids[:2]
    assert manager.pool.ref_cnt[first.block_ids[0]] == 2
    assert manager.prefix_cache_queries == 10 + 12 and manager.prefix_cache_hits == 8
    manager.check_integrity(holders=[first.block_ids, second.block_ids])

    # An exactly block-aligned repeat: all 8 tokens cached, but one must still be computed -> only 1 block hit.
    aligned = _request("c", list(range(8)))
    blocks, cached = manager.get_computed_blocks(aligned)
    assert cached == BS and blocks == first.block_ids[:1]


def test_only_computed_tokens_are_hashed():
    manager = KVCacheManager(num_blocks=8, block_size=BS)
    request = _request("a", list(range(12)))
    _admit(manager, request)
    manager.cache_blocks(request, 6)  # one full block of computed tokens, the rest not yet computed
    assert manager.pool.num_cached_blocks == 1
    other = _request("b", list(range(12)))
    assert manager.get_computed_blocks(other)[1] == BS
    manager.cache_blocks(request, 12)
    assert manager.pool.num_cached_blocks == 3
    assert manager.get_computed_blocks(other)[1] == 2 * BS  # capped below the whole sequence


def test_freed_cached_blocks_stay_hit_and_are_reused_last_in_lru_order():
    manager = KVCacheManager(num_blocks=6, block_size=BS)
    old = _request("old", [1] * 8)
    _admit(manager, old)
    _compute_all(manager, old)
    old_blocks = list(old.block_ids)
    manager.free(old)
    newer = _request("newer", [2] * 8)
    _admit(manager, newer)
    _compute_all(manager, newer)
    newer_blocks = list(newer.block_ids)
    manager.free(newer)
    assert manager.num_used_blocks == 0 and manager.pool.num_cached_blocks == 4
    # A freed cached prefix is still a hit, and touching it takes it out of the free queue.
    again = _request("again", [1] * 8 + [5])
    assert _admit(manager, again) == 2 * BS
    assert again.block_ids[:2] == old_blocks
    manager.free(again)
    # Plain free blocks go first; then cached ones oldest first ("newer" was freed before "again").
    probe = _request("probe", [7] * 12)
    manager.allocate(probe, 12)
    plain = set(range(6)) - set(old_blocks) - set(newer_blocks)
    assert set(probe.block_ids[:2]) == plain
    # Free order within a request is tail first, so a prefix's last block is evicted before its first.
    assert probe.block_ids[2] == newer_blocks[1]
    assert manager.get_computed_blocks(_request("n2", [2] * 9))[1] == BS  # its first block is still cached
    assert manager.get_computed_blocks(_request("o2", [1] * 9))[1] == 2 * BS  # touched more recently: kept
    manager.check_integrity(holders=[probe.block_ids])


def test_eviction_drops_the_hash_and_counts_stay_consistent():
    manager = KVCacheManager(num_blocks=2, block_size=BS)
    first = _request("a", [3] * 8)
    _admit(manager, first)
    _compute_all(manager, first)
    manager.free(first)
    assert manager.pool.num_cached_blocks == 2
    other = _request("b", [4] * 8)
    manager.allocate(other, 8)  # must evict both cached blocks
    assert manager.pool.num_cached_blocks == 0
    assert manager.get_computed_blocks(_request("c", [3] * 9)) == ([], 0)
    manager.check_integrity(holders=[other.block_ids])


def test_can_allocate_counts_revived_cached_blocks():
    manager = KVCacheManager(num_blocks=3, block_size=BS)
    first = _request("a", [1] * 8)
    _admit(manager, first)
    _compute_all(manager, first)
    first_blocks = list(first.block_ids)
    manager.free(first)
    second = _request("b", [1] * 8 + [2] * 4)
    blocks, cached = manager.get_computed_blocks(second)
    assert cached == 8
    assert manager.can_allocate(second, 4, blocks)  # 2 revived + 1 fresh = 3 free
    assert not manager.can_allocate(second, 5, blocks)  # would need 2 fresh
    manager.allocate(second, 4, blocks)
    assert second.block_ids[:2] == first_blocks and manager.num_free_blocks == 0
    manager.check_integrity(holders=[second.block_ids])


def test_growing_tables_stay_adjacent_even_when_they_grow_in_turns():
    """Requests that grow one block at a time in turns (decode) each keep a run of adjacent blocks, as long as
    the pool has room; a free block that still caches a prefix is not taken for adjacency."""
    pool = BlockPool(num_blocks=128, block_size=BS)  # the middle of the longest free run: >= 16 blocks each
    tables = [pool.get_new_blocks(3) for _ in range(4)]
    for _ in range(6):
        for table in tables:
            table += pool.get_new_blocks(1, after=table[-1])
    for table in tables:
        assert table == list(range(table[0], table[0] + len(table)))
    pool.check_integrity()

    pool = BlockPool(num_blocks=8, block_size=BS)
    first = pool.get_new_blocks(2)
    pool.cache_block(first[1], hash_block(None, [1] * BS))
    pool.free_blocks([first[1]])
    grown = pool.get_new_blocks(1, after=first[0])
    assert grown != [first[1]] and pool.get_cached_block(hash_block(None, [1] * BS)) == first[1]
    pool.check_integrity()


def test_hash_chain_depends_on_the_parent():
    a = hash_block(None, [1, 2])
    assert hash_block(a, [3, 4]) != hash_block(hash_block(None, [9, 9]), [3, 4])
    assert hash_block(a, [3, 4]) == hash_block(hash_block(None, [1, 2]), [3, 4])


@pytest.mark.parametrize("corrupt, message", [
    (lambda p: p.ref_cnt.__setitem__(0, 1), "is free .* but has ref count 1"),
    (lambda p: p._free_plain.pop(1), "has ref count 0 but is in no free queue"),
    (lambda p: p.ref_cnt.__setitem__(2, -1), "is free .* but has ref count -1"),
    (lambda p: p._free_cached.__setitem__(0, None), "free queues twice"),
    (lambda p: p.block_hash.__setitem__(5, hash_block(None, [9])), "carry a hash but the hash map has"),
    (lambda p: p.hash_to_block.__setitem__(hash_block(None, [8]), 5), "which carries hash"),
    (lambda p: p._plain_mask.__setitem__(4, True), "placement mask disagrees"),
])
def test_integrity_check_catches_injected_corruption(corrupt, message):
    pool = BlockPool(num_blocks=8, block_size=BS)
    pool.get_new_blocks(8)
    pool.free_blocks([0, 1, 2, 6, 7])  # blocks 3..5 in use
    pool.check_integrity()
    corrupt(pool)
    with pytest.raises(AssertionError, match=message):
        pool.check_integrity()


def test_manager_integrity_compares_ref_counts_with_holders():
    manager = KVCacheManager(num_blocks=4, block_size=BS)
    request = _request("a", [1] * 8)
    manager.allocate(request, 8)
    manager.check_integrity(holders=[request.block_ids])
    with pytest.raises(AssertionError, match="ref count 1 but 0 block tables hold it"):
        manager.check_integrity(holders=[request.block_ids[:1]])


def test_bad_frees_and_overdraws_are_refused():
    pool = BlockPool(num_blocks=2, block_size=BS)
    with pytest.raises(ValueError, match="only 2 free"):
        pool.get_new_blocks(3)
    with pytest.raises(ValueError, match="ref count 0"):
        pool.free_blocks([1])
    with pytest.raises(ValueError, match="num_blocks must be >= 1"):
        BlockPool(num_blocks=0)
