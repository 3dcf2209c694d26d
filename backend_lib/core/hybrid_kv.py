"""The hybrid KV manager: paged blocks plus a pool of fixed per-request state slots. No torch here.

Models whose attention keeps bounded per-request state (DeepSeek-V4: the last ``sliding_window`` tokens' K = V and
the open compressor windows) declare it with ``hybrid_cache_shapes`` (see ``backend_lib/models/deepseek_v4/model.py``).
Their cache has two parts, both owned here:

- **paged blocks** (the ``BlockPool`` of ``kv_cache.py``): block ``b`` of a request's table holds what its
  positions ``[i * block_size, (i + 1) * block_size)`` leave behind for good (V4: the compressed entries of the
  windows that close there, for every compress rate), so a long context costs compressed memory only;
- **state slots**: ``num_state_slots`` fixed rows (the model's rings: the sliding window and the buffers of windows
  not yet closed). A request takes one at admission and gives it back with its blocks (finish, abort, preemption);
  a session turn that completes hands its slot to the session, which keeps it (with its blocks) until END, the idle
  timeout or eviction, so the next turn prefills only its new tokens.

A slot's rings are valid only at the position its request reached (they have no per-position history), so nothing
is shared between requests: prefix caching is off, and state is never rewound past what the rings hold (the runner
sizes them for the draft positions a verification may roll back). The scheduler's block accounting, preemption and
eviction are the plain manager's; ``can_allocate`` also needs a free slot for a request that holds none.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from backend_lib.core.kv_cache import KVCacheManager

if TYPE_CHECKING:
    from backend_lib.core.request import Request


class StateSlotPool:
    """``num_slots`` fixed state slots, each free or held by exactly one owner (a request or a session)."""

    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"num_state_slots must be >= 1, got {num_slots}")
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # a stack: the lowest id is handed out first
        self._held = [False] * num_slots

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_slots - len(self._free)

    def take(self) -> int:
        if not self._free:
            raise ValueError(f"no free state slot: all {self.num_slots} are held (call can_allocate first)")
        slot = self._free.pop()
        self._held[slot] = True
        return slot

    def give_back(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots or not self._held[slot]:
            raise ValueError(f"state slot {slot} given back but not held")
        self._held[slot] = False
        self._free.append(slot)

    def check_integrity(self, holders: Iterable[int] | None = None) -> None:
        """Free and held slots partition the pool; with ``holders`` (every slot a live owner holds), each held slot
        has exactly one of them."""
        free = set(self._free)
        assert len(free) == len(self._free), "a state slot is in the free list twice"
        for slot in range(self.num_slots):
            assert (slot in free) != self._held[slot], \
                f"state slot {slot} is {'both free and held' if slot in free else 'neither free nor held (leaked)'}"
        if holders is None:
            return
        owned = list(holders)
        assert len(owned) == len(set(owned)), f"a state slot has two holders: {sorted(owned)}"
        held = {s for s in range(self.num_slots) if self._held[s]}
        assert set(owned) == held, f"held slots {sorted(held)} but live owners hold {sorted(owned)}"


class HybridKVManager(KVCacheManager):
    """``KVCacheManager`` (prefix caching off) for the paged part plus a ``StateSlotPool``; the slot lives in
    ``request.state_slot`` (the scheduler moves it to and from a session's ``state_slot``)."""

    def __init__(self, num_blocks: int, block_size: int, num_state_slots: int) -> None:
        super().__init__(num_blocks, block_size, enable_prefix_caching=False)
        self.slots = StateSlotPool(num_state_slots)

    @property
    def num_state_slots(self) -> int:
        return self.slots.num_slots

    @property
    def num_free_state_slots(self) -> int:
        return self.slots.num_free

    def can_allocate(self, request: Request, num_new_tokens: int, computed_block_ids: Sequence[int] = ()) -> bool:
        has_slot = request.state_slot is not None or self.slots.num_free > 0
        return has_slot and super().can_allocate(request, num_new_tokens, computed_block_ids)

    def allocate(self, request: Request, num_new_tokens: int, computed_block_ids: Sequence[int] = ()) -> list[int]:
        if computed_block_ids:
            raise ValueError("the hybrid cache shares no blocks between requests (prefix caching is off)")
        if request.state_slot is None and not self.slots.num_free:
            raise ValueError(f"cannot allocate for request {request.request_id!r}: no free state slot "
                             f"(call can_allocate first)")
        blocks = super().allocate(request, num_new_tokens)
        if request.state_slot is None:
            request.state_slot = self.slots.take()
        return blocks

    def free(self, request: Request) -> None:
        super().free(request)
        self.release_state(request.state_slot)
        request.state_slot = None

    def release_state(self, slot: int | None) -> None:
        if slot is not None:
            self.slots.give_back(slot)

    def check_integrity(self, holders: Iterable[Sequence[int]] | None = None,
                        slot_holders: Iterable[int] | None = None) -> None:
        super().check_integrity(holders)
        self.slots.check_integrity(slot_holders)
