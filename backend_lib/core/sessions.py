"""Open sessions (Triton sequences) and the KV each one pins between turns. No torch.

A session keeps its conversation's token history and, while memory allows, the KV of that history: blocks (one
reference each) and, on the hybrid cache, the fixed state slot at ``num_computed_tokens``. The next turn takes them
over (``Scheduler._admit``) and gives them back when it ends (``Scheduler._release``). Under memory pressure the least
recently used session's KV goes first (``evict_kv``); its next turn recomputes the history.

This is the server's one session table: the scheduler owns it, and the engine asks it (a turn's checks in
``engine/intake.py``, chat history, idle closing, the session count).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from backend_lib.core.errors import RequestError
from backend_lib.core.hybrid_kv import HybridKVManager
from backend_lib.core.kv_cache import KVCacheManager
from backend_lib.core.request import PromptImage, Request


@dataclass
class Session:
    """A multi-turn conversation's token history and the pinned KV blocks that hold its prefix."""

    session_id: str
    last_used: float
    token_ids: list[int] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)  # one reference each, held between turns
    num_computed_tokens: int = 0  # leading tokens of token_ids whose KV sits in block_ids
    state_slot: int | None = None  # hybrid cache: the fixed state at num_computed_tokens, kept with block_ids
    turn_request_id: str | None = None  # the turn in flight (waiting or running)
    closing: bool = False  # close_session arrived during a turn: close when it ends
    priority: int = 0  # its turns' scheduling priority (a turn that gives one changes it)
    # A session driven by chat messages: the conversation so far (the engine renders it whole each turn; the prefix
    # cache supplies the history's KV, so such a turn's request is not tied to the session here).
    messages: list[dict] = field(default_factory=list)
    # Images: the history's image spans (a recompute of it needs their embeddings; text turns), and a chat session's
    # images in its messages' placeholder order (the conversation is rendered, and so expanded, whole each turn).
    images: tuple[PromptImage, ...] = ()
    image_data: tuple[bytes, ...] = ()


class SessionTable:
    def __init__(self, kv_cache: KVCacheManager | HybridKVManager, clock: Callable[[], float]) -> None:
        self.kv_cache = kv_cache
        self._clock = clock
        self._by_id: dict[str, Session] = {}
        self.num_evictions = 0

    def __len__(self) -> int:
        return len(self._by_id)

    def get(self, session_id: str | None) -> Session | None:
        return self._by_id.get(session_id) if session_id is not None else None

    def open(self, session_id: str) -> None:
        if session_id in self._by_id:
            raise ValueError(f"session {session_id!r} is already open")
        self._by_id[session_id] = Session(session_id=session_id, last_used=self._clock())

    def close(self, session_id: str) -> None:
        """Free the session's KV. With a turn in flight, the session closes when that turn ends."""
        session = self._known(session_id)
        if session.turn_request_id is not None:
            session.closing = True
            return
        self.remove(session)

    def remove(self, session: Session) -> None:
        self.drop_kv(session)
        del self._by_id[session.session_id]

    def check_turn(self, session_id: str, start: bool = False) -> None:
        """The one rule for a turn: its session is open (or this turn STARTs it), no turn of it is in flight and
        it is not closing. The engine's intake checks it before any work; the scheduler again when it queues the
        turn (its own contract)."""
        session = self._by_id.get(session_id)
        if session is None:
            if not start:
                raise RequestError("sequence_id", f"unknown session {session_id}: the first request of a sequence "
                                   "must carry START")
            return
        if session.turn_request_id is not None:
            again = "; cannot START it again" if start else ""
            raise RequestError("sequence_id", f"session {session_id} already has a turn in flight (request "
                               f"{session.turn_request_id}){again}")
        if session.closing:
            raise RequestError("sequence_id", f"session {session_id} is closing")

    def begin_turn(self, session_id: str, request_id: str) -> Session:
        """Mark a turn in flight (the scheduler for turns it runs on the session's KV, the engine for chat turns)."""
        session = self._known(session_id)
        session.turn_request_id = request_id
        session.last_used = self._clock()
        return session

    def end_turn(self, session_id: str, request_id: str) -> None:
        """The turn ``begin_turn`` marked is over; a session closed during it goes now."""
        session = self._by_id.get(session_id)
        if session is None or session.turn_request_id != request_id:
            return
        session.turn_request_id = None
        session.last_used = self._clock()
        if session.closing:
            self.remove(session)

    def busy(self, session_id: str) -> bool:
        session = self._by_id.get(session_id)
        return session is not None and session.turn_request_id is not None

    def history(self, session_id: str) -> list[int]:
        return list(self._known(session_id).token_ids)

    def num_cached_tokens(self, session_id: str) -> int:
        """History tokens whose KV the session currently pins (0 after eviction)."""
        session = self._by_id.get(session_id)
        return session.num_computed_tokens if session is not None else 0

    def close_idle(self, now: float, idle_timeout_s: float) -> list[str]:
        """Close sessions with no turn in flight, unused for more than ``idle_timeout_s`` (``now`` on the clock)."""
        idle = [s for s in self._by_id.values() if s.turn_request_id is None and now - s.last_used > idle_timeout_s]
        for session in idle:
            self.remove(session)
        return [s.session_id for s in idle]

    def kv_usable(self, session: Session, request: Request) -> bool:
        """Whether the turn's prompt continues the history the session's KV holds (with one token left to run)."""
        history = len(session.token_ids)
        return (session.num_computed_tokens <= request.num_tokens - 1
                and request.prompt_token_ids[:history] == session.token_ids)

    def store_kv(self, session: Session, blocks: list[int], num_computed: int, state_slot: int | None = None) -> None:
        """Pin the blocks that hold the first ``num_computed`` tokens (and their state slot); release the rest."""
        bs = self.kv_cache.block_size
        keep = min(len(blocks), self.kv_cache.blocks_needed(num_computed))
        num_computed = min(num_computed, keep * bs)
        if keep and num_computed % bs:
            # The next turn writes into the last, partial block: it must be this session's alone.
            last = blocks[keep - 1]
            if self.kv_cache.pool.block_hash[last] is not None or self.kv_cache.pool.ref_cnt[last] > 1:
                keep -= 1
                num_computed = keep * bs
        self.kv_cache.release(blocks[keep:])
        session.block_ids = blocks[:keep]
        session.num_computed_tokens = num_computed
        if keep:
            session.state_slot = state_slot
        elif state_slot is not None:
            self.kv_cache.release_state(state_slot)

    def drop_kv(self, session: Session) -> None:
        self.kv_cache.release(session.block_ids)
        if session.state_slot is not None:
            self.kv_cache.release_state(session.state_slot)
        session.block_ids = []
        session.num_computed_tokens = 0
        session.state_slot = None

    def evict_kv(self, exclude: str | None = None) -> bool:
        """Release the KV of the least recently used session holding blocks; its next turn recomputes."""
        candidates = [s for s in self._by_id.values() if s.block_ids and s.session_id != exclude]
        if not candidates:
            return False
        self.drop_kv(min(candidates, key=lambda s: s.last_used))
        self.num_evictions += 1
        return True

    def held_blocks(self) -> list[list[int]]:
        return [s.block_ids for s in self._by_id.values()]

    def held_state_slots(self) -> list[int]:
        return [s.state_slot for s in self._by_id.values() if s.state_slot is not None]

    def _known(self, session_id: str) -> Session:
        session = self._by_id.get(session_id)
        if session is None:
            raise ValueError(f"unknown session {session_id!r}")
        return session
