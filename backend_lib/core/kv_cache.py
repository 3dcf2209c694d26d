"""Paged KV cache bookkeeping: ref-counted blocks, an LRU free queue and hash-chained prefix caching.

No torch here: this module only decides which block ids hold which token positions; the model runner
owns the tensors. Block ``b`` holds positions ``[i * block_size, (i + 1) * block_size)`` of a request
whose ``block_ids[i] == b``; ``slot()`` turns a position into a flat KV slot.

Prefix caching (vLLM v1): a block that is full of *computed* tokens gets a hash chained over its
parent's hash and its token ids, so equal prefixes map to equal chains. A freed hashed block stays
in the cache (ref count 0, in the free queue) until a new allocation evicts it; free blocks without a
hash are always handed out first, hashed ones oldest first.

Placement: a request's next block is the one right after its last block when that is free and unhashed, else the
middle of the longest run of free unhashed blocks (room to grow for this request and for the one before the
run). Decode attention streams each request's K/V block by block, and adjacent blocks read about twice as fast
as blocks interleaved with other requests' (the C++ host kernel: 0.22 against 0.42 ms a SmolLM2 layer at batch
32), because the hardware prefetcher follows them.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

if TYPE_CHECKING:  # runtime-free: the manager only reads request_id, num_tokens, all_token_ids, block_ids, images
    from backend_lib.core.request import Request


class BlockHash(NamedTuple):
    """A full block's identity: the chained hash plus its own token ids (so a 64-bit hash collision
    would also need identical tokens in the block to alias)."""

    value: int
    token_ids: tuple[int, ...]


def hash_block(parent: BlockHash | None, token_ids: Sequence[int], extra: tuple = ()) -> BlockHash:
    """``extra``: what the ids do not say about the block (the image spans in it: their digests and starts)."""
    tokens = tuple(token_ids) + extra
    return BlockHash(hash((parent.value if parent is not None else None, tokens)), tokens)


def _image_keys(request: Request, start: int, end: int) -> tuple:
    """The image spans overlapping positions [start, end): every span position carries the same id, so two
    different images must not share a block (nor the same image at another place)."""
    return tuple((image.digest, image.start) for image in request.images
                 if image.start < end and start < image.start + image.num_tokens)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockPool:
    """``num_blocks`` blocks with ref counts, optional content hashes and an LRU free queue."""

    def __init__(self, num_blocks: int, block_size: int = 16) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_cnt: list[int] = [0] * num_blocks
        self.block_hash: list[BlockHash | None] = [None] * num_blocks
        self.hash_to_block: dict[BlockHash, int] = {}
        # Two queues keep "unhashed first, then hashed oldest first" O(1); both are FIFO (LRU).
        self._free_plain: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self._free_cached: OrderedDict[int, None] = OrderedDict()
        # _free_plain as a mask, so finding free runs for placement is one vectorized pass, not a sort.
        self._plain_mask = np.ones(num_blocks, dtype=np.bool_)  # [num_blocks]

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation may take now, cached-but-unreferenced ones included."""
        return len(self._free_plain) + len(self._free_cached)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self.hash_to_block)

    def get_new_blocks(self, n: int, after: int | None = None) -> list[int]:
        """``n`` blocks for the end of a block table whose last block is ``after`` (None: a new table), adjacent
        to it and to each other where the free blocks allow (see the module docstring)."""
        if n > self.num_free_blocks:
            raise ValueError(f"cannot allocate {n} blocks: only {self.num_free_blocks} free")
        out = []
        for _ in range(n):
            if self._free_plain:
                block = after + 1 if after is not None and after + 1 in self._free_plain else self._roomiest()
                del self._free_plain[block]
                self._plain_mask[block] = False
            else:
                block, _ = self._free_cached.popitem(last=False)
                self._drop_hash(block)
            self.ref_cnt[block] = 1
            out.append(block)
            after = block
        return out

    def _roomiest(self) -> int:
        """The middle of the longest run of adjacent free unhashed blocks (there is at least one)."""
        edges = np.flatnonzero(np.diff(self._plain_mask, prepend=False, append=False))  # [2R] run starts, ends
        starts, ends = edges[0::2], edges[1::2]
        longest = int(np.argmax(ends - starts))
        return int(starts[longest] + (ends[longest] - starts[longest]) // 2)

    def touch(self, block_ids: Iterable[int]) -> None:
        """Add one reference to each block (a prefix-cache hit), pulling free ones out of the queue."""
        for block in block_ids:
            if self.ref_cnt[block] == 0:
                queue = self._free_cached if self.block_hash[block] is not None else self._free_plain
                del queue[block]
                self._plain_mask[block] = False
            self.ref_cnt[block] += 1

    def free_blocks(self, block_ids: Iterable[int]) -> None:
        """Drop one reference from each block; blocks reaching 0 join the free queue's tail in the given
        order (callers pass a sequence tail-first so its prefix blocks are evicted last)."""
        for block in block_ids:
            if self.ref_cnt[block] <= 0:
                raise ValueError(f"block {block} freed with ref count {self.ref_cnt[block]}")
            self.ref_cnt[block] -= 1
            if self.ref_cnt[block] == 0:
                if self.block_hash[block] is not None:
                    self._free_cached[block] = None
                else:
                    self._free_plain[block] = None
                    self._plain_mask[block] = True

    def get_cached_block(self, block_hash: BlockHash) -> int | None:
        return self.hash_to_block.get(block_hash)

    def cache_block(self, block: int, block_hash: BlockHash) -> bool:
        """Register a referenced, full block under ``block_hash``. Returns False (and leaves the block
        unhashed) when another block already holds that content, or the block already has this hash."""
        if self.ref_cnt[block] <= 0:
            raise ValueError(f"only referenced blocks can be cached; block {block} has ref count 0")
        current = self.block_hash[block]
        if current is not None:
            if current != block_hash:
                raise ValueError(f"block {block} already cached under another hash")
            return False
        if block_hash in self.hash_to_block:
            return False
        self.block_hash[block] = block_hash
        self.hash_to_block[block_hash] = block
        return True

    def _drop_hash(self, block: int) -> None:
        block_hash = self.block_hash[block]
        if block_hash is not None:
            del self.hash_to_block[block_hash]
            self.block_hash[block] = None

    def check_integrity(self) -> None:
        """Raise AssertionError naming the first disagreement between ref counts, queues and hashes."""
        n = self.num_blocks
        seen: set[int] = set()
        for name, queue, hashed in (("plain", self._free_plain, False), ("cached", self._free_cached, True)):
            for block in queue:
                assert 0 <= block < n, f"free queue {name} holds out-of-range block {block}"
                assert block not in seen, f"block {block} is in the free queues twice"
                seen.add(block)
                assert self.ref_cnt[block] == 0, \
                    f"block {block} is free ({name} queue) but has ref count {self.ref_cnt[block]}"
                has_hash = self.block_hash[block] is not None
                assert has_hash == hashed, \
                    f"block {block} in the {name} free queue {'has' if has_hash else 'lacks'} a hash"
        for block, ref in enumerate(self.ref_cnt):
            assert ref >= 0, f"block {block} has negative ref count {ref}"
            if ref == 0:
                assert block in seen, f"block {block} has ref count 0 but is in no free queue (leaked)"
        plain = np.zeros(n, dtype=np.bool_)
        plain[list(self._free_plain)] = True
        mismatch = np.flatnonzero(plain != self._plain_mask)
        assert not mismatch.size, f"block {mismatch[0]}: the placement mask disagrees with the plain free queue"
        used = sum(1 for ref in self.ref_cnt if ref > 0)
        assert used + len(seen) == n, f"free ({len(seen)}) + used ({used}) != total ({n})"
        for block_hash, block in self.hash_to_block.items():
            assert 0 <= block < n, f"hash map points at out-of-range block {block}"
            assert self.block_hash[block] == block_hash, \
                f"hash map points at block {block}, which carries hash {self.block_hash[block]!r}"
        hashed = sum(1 for h in self.block_hash if h is not None)
        assert hashed == len(self.hash_to_block), \
            f"{hashed} blocks carry a hash but the hash map has {len(self.hash_to_block)} entries"


class KVCacheManager:
    """Per-request block tables over a BlockPool (check-then-act: ``can_*`` first, then the act).

    The request's table lives in ``request.block_ids``; this manager is the only writer of it.
    Counters: ``prefix_cache_queries`` / ``prefix_cache_hits`` (tokens, counted when ``allocate``
    admits a request through the prefix cache), ``num_used_blocks``, ``num_free_blocks``.
    """

    def __init__(self, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = True) -> None:
        self.pool = BlockPool(num_blocks, block_size)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        # request_id -> hash chain of the request's full blocks (grows as tokens arrive)
        self._req_hashes: dict[str, list[BlockHash]] = {}
        # request_id -> how many leading blocks of the request have been offered to the cache
        self._num_hashed: dict[str, int] = {}

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.pool.num_used_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    # --- prefix cache -------------------------------------------------------------------------

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """The longest chain of cached full blocks that prefixes the request's tokens, and its length
        in tokens. Never the whole sequence: at least one token stays to compute so the runner gets
        logits (cap at num_tokens - 1, rounded down to a block). None for a request still owed prompt logprobs:
        they need every prompt position's hidden state."""
        owed = request.sampling_params.prompt_logprobs is not None and \
            request.num_prompt_logprobs < request.num_prompt_tokens - 1
        if not self.enable_prefix_caching or owed:
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        hashes = self._hashes(request, max_blocks)
        blocks = []
        for block_hash in hashes[:max_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            blocks.append(block)
        return blocks, len(blocks) * self.block_size

    def _hashes(self, request: Request, num_full_blocks: int) -> list[BlockHash]:
        chain = self._req_hashes.setdefault(request.request_id, [])
        bs = self.block_size
        if len(chain) < num_full_blocks:
            tokens = request.all_token_ids
            while len(chain) < num_full_blocks:
                i = len(chain)
                chain.append(hash_block(chain[-1] if chain else None, tokens[i * bs:(i + 1) * bs],
                                        _image_keys(request, i * bs, (i + 1) * bs)))
        return chain

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Hash the request's blocks that are full of computed tokens (only computed tokens are ever
        hashed: speculative tokens that may be rejected must never enter the cache)."""
        if not self.enable_prefix_caching:
            return
        num_full = min(num_computed_tokens // self.block_size, len(request.block_ids))
        start = self._num_hashed.get(request.request_id, 0)
        if num_full <= start:
            return
        hashes = self._hashes(request, num_full)
        for i in range(start, num_full):
            self.pool.cache_block(request.block_ids[i], hashes[i])
        self._num_hashed[request.request_id] = num_full

    # --- allocation ---------------------------------------------------------------------------

    def can_allocate(self, request: Request, num_new_tokens: int, computed_block_ids: Sequence[int] = ()) -> bool:
        """Whether ``allocate`` can admit a request that holds no blocks yet."""
        return self._num_new_for_admission(num_new_tokens, computed_block_ids) <= self.pool.num_free_blocks

    def _num_new_for_admission(self, num_new_tokens: int, computed_block_ids: Sequence[int]) -> int:
        total = len(computed_block_ids) * self.block_size + num_new_tokens
        fresh = self.blocks_needed(total) - len(computed_block_ids)
        # Cached blocks nobody references sit in the free queue: touching them uses up free capacity.
        revived = sum(1 for b in computed_block_ids if self.pool.ref_cnt[b] == 0)
        return fresh + revived

    def allocate(self, request: Request, num_new_tokens: int, computed_block_ids: Sequence[int] = ()) -> list[int]:
        """Admit a request: take the cached blocks (ref +1) then fresh ones for ``num_new_tokens`` more
        tokens. Sets ``request.block_ids``; the caller sets ``num_computed_tokens``."""
        if request.block_ids:
            raise ValueError(f"request {request.request_id!r} already holds blocks; use append_slots")
        need = self._num_new_for_admission(num_new_tokens, computed_block_ids)
        if need > self.pool.num_free_blocks:
            raise ValueError(f"cannot allocate for request {request.request_id!r}: needs {need} blocks, "
                             f"{self.pool.num_free_blocks} free (call can_allocate first)")
        # Touch first: otherwise the fresh allocation below could evict the very blocks we hit.
        self.pool.touch(computed_block_ids)
        total = len(computed_block_ids) * self.block_size + num_new_tokens
        fresh = self.pool.get_new_blocks(self.blocks_needed(total) - len(computed_block_ids),
                                         after=computed_block_ids[-1] if computed_block_ids else None)
        request.block_ids = list(computed_block_ids) + fresh
        self._num_hashed[request.request_id] = len(computed_block_ids)
        if self.enable_prefix_caching:
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += len(computed_block_ids) * self.block_size
        return request.block_ids

    def num_slots_missing(self, request: Request, num_new_tokens: int) -> int:
        """Fresh blocks ``append_slots`` would take to feed ``num_new_tokens`` more tokens."""
        return max(0, self.blocks_needed(request.num_computed_tokens + num_new_tokens) - len(request.block_ids))

    def can_append(self, request: Request, num_new_tokens: int) -> bool:
        return self.num_slots_missing(request, num_new_tokens) <= self.pool.num_free_blocks

    def append_slots(self, request: Request, num_new_tokens: int) -> list[int]:
        """Grow a running request's table so positions up to num_computed + num_new_tokens have slots."""
        missing = self.num_slots_missing(request, num_new_tokens)
        if missing > self.pool.num_free_blocks:
            raise ValueError(f"cannot append {num_new_tokens} tokens for request {request.request_id!r}: "
                             f"needs {missing} blocks, {self.pool.num_free_blocks} free (call can_append first)")
        if missing:
            after = request.block_ids[-1] if request.block_ids else None
            request.block_ids.extend(self.pool.get_new_blocks(missing, after=after))
        return request.block_ids

    # --- release and ownership ----------------------------------------------------------------

    def free(self, request: Request) -> None:
        """Return the request's blocks (ref -1; hashed blocks stay cached) and forget its hash state."""
        blocks = request.block_ids
        request.block_ids = []
        self._forget(request.request_id)
        self.release(blocks)

    def release(self, block_ids: Sequence[int]) -> None:
        """Drop one reference from each block. Tail first, so a prefix's later blocks are evicted
        before its earlier ones (earlier blocks are shared by more prefixes)."""
        self.pool.free_blocks(reversed(block_ids))

    def detach(self, request: Request) -> list[int]:
        """Take the request's blocks over with their references (a session pins them between turns)."""
        blocks = request.block_ids
        request.block_ids = []
        self._forget(request.request_id)
        return blocks

    def _forget(self, request_id: str) -> None:
        self._req_hashes.pop(request_id, None)
        self._num_hashed.pop(request_id, None)

    # --- addressing and checks ----------------------------------------------------------------

    def slot(self, block_ids: Sequence[int], position: int) -> int:
        return block_ids[position // self.block_size] * self.block_size + position % self.block_size

    def slot_mapping(self, block_ids: Sequence[int], start: int, num_tokens: int) -> list[int]:
        bs = self.block_size
        return [block_ids[p // bs] * bs + p % bs for p in range(start, start + num_tokens)]

    def check_integrity(self, holders: Iterable[Sequence[int]] | None = None) -> None:
        """Pool self-consistency; with ``holders`` (every live block table: running requests, sessions)
        also that each block's ref count equals the number of tables that hold it."""
        self.pool.check_integrity()
        if holders is None:
            return
        counts = [0] * self.pool.num_blocks
        for table in holders:
            for block in table:
                counts[block] += 1
        for block, (want, have) in enumerate(zip(counts, self.pool.ref_cnt)):
            assert want == have, f"block {block} has ref count {have} but {want} block tables hold it"
