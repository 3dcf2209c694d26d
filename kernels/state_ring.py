"""Fixed per-request rings of recent per-token rows (the hybrid cache's sliding window and open-window buffers).

A ring tensor is ``[S + 1, C, width]``: one row of ``C`` entries per state slot (the last slot is scratch: padded
rows and tokens without state write there, and nobody reads it), position ``p`` at entry ``p mod C``. A step never
reads what it wrote itself from the ring: a token's recent positions before its chunk start come from the ring
(written by earlier steps), the others from the step's fresh rows, so a chunk may be any length and the ring only
needs the lookback (plus the draft positions a verification may roll back). After the reads, each chunk writes its
last ``C`` positions.

Shapes are fixed by the step; ``StateRows`` comes from the runner (``AttentionMetadata.state``).
"""
from __future__ import annotations

import torch

from kernels.attention_metadata import StateRows


def _mod(pos: torch.Tensor, capacity: int) -> torch.Tensor:
    # pos - floor(pos / C) * C rather than %: remainder is slow on Neuron (graph lint rule)
    return pos - torch.div(pos, capacity, rounding_mode="floor") * capacity


def _slot(slots: torch.Tensor, ring: torch.Tensor) -> torch.Tensor:
    """State slot per token, -1 (no state) mapped to the scratch slot."""
    scratch = ring.shape[0] - 1
    return torch.where(slots < 0, torch.full_like(slots, scratch), slots)


def recent_rows(ring: torch.Tensor,  # [S + 1, C, W] one layer's ring
                fresh: torch.Tensor,  # [T, W] this step's rows (every token of the step)
                rows: StateRows, positions: torch.Tensor,  # [T] int64
                length: int, first: int = 0, count: int | None = None, longest_chunk: int | None = None,
                tokens: torch.Tensor | None = None,  # [N] int64: these step rows instead of first .. first + count
                ) -> tuple[torch.Tensor, torch.Tensor]:  # [N, length, W], [N, length] bool
    """Positions ``t - length + 1 .. t`` of tokens ``first .. first + count`` (or of the rows ``tokens``), per
    token: from the ring before the token's chunk start, from ``fresh`` after it; the mask says which positions
    exist (>= 0).

    ``longest_chunk`` (a host int, None = unknown): no chunk of these tokens is longer, so at most the last
    ``longest_chunk`` positions of a token can be fresh. A decode row (one token, or 1 + drafts) then reads its
    window from the ring and only its last position(s) from the step: one gather of the window instead of two plus
    a select over it."""
    if tokens is None:
        end = fresh.shape[0] if count is None else min(first + count, fresh.shape[0])
        tokens = torch.arange(first, end, device=positions.device)
        t, slots, starts = positions[first:end], rows.slots[first:end], rows.chunk_starts[first:end]
    else:
        t, slots, starts = positions[tokens], rows.slots[tokens], rows.chunk_starts[tokens]
    pos = t[:, None] + torch.arange(1 - length, 1, device=t.device)[None, :]
    capacity = ring.shape[1]
    slot = _slot(slots, ring)
    ring_index = slot[:, None] * capacity + _mod(pos.clamp(min=0), capacity)
    from_ring = ring.reshape(-1, ring.shape[-1]).index_select(0, ring_index.flatten()).view(*pos.shape, -1)
    from_ring = from_ring.to(fresh.dtype)
    tail = length if longest_chunk is None else min(length, longest_chunk)
    tail_pos = pos[:, length - tail:]
    row = tokens[:, None] - (t[:, None] - tail_pos)
    from_step = fresh.index_select(0, row.clamp(0, fresh.shape[0] - 1).flatten()).view(*tail_pos.shape, -1)
    before = (tail_pos < starts[:, None])[..., None]
    # the gather's own buffer: its tail columns are overwritten in place (no copy of the whole window)
    from_ring[:, length - tail:] = torch.where(before, from_ring[:, length - tail:], from_step)
    return from_ring, pos >= 0


def chunk_recent_rows(ring: torch.Tensor,  # [S + 1, C, W]
                      fresh: torch.Tensor,  # [T, W]
                      rows: StateRows, first: int, start: int, length: int, lookback: int,
                      ) -> torch.Tensor:  # [1, lookback + length, W]
    """One prefill chunk (rows ``first .. first + length``, positions from ``start``): positions ``start - lookback
    .. start - 1`` from the ring (negative ones hold whatever the ring has: callers mask them), then the chunk's own
    rows. Shared by every query of the chunk."""
    capacity = ring.shape[1]
    slot = _slot(rows.slots[first:first + 1], ring)  # [1]: a device index, no host sync
    pos = torch.arange(start - lookback, start, device=fresh.device).clamp(min=0)
    index = slot * capacity + _mod(pos, capacity)
    before = ring.reshape(-1, ring.shape[-1]).index_select(0, index).to(fresh.dtype)
    return torch.cat([before, fresh[first:first + length]])[None]


def write_index(rows: StateRows, positions: torch.Tensor,  # [T] int64
                capacity: int, scratch: int) -> tuple[torch.Tensor, torch.Tensor]:  # [T] slot, [T] entry
    """Where ``write_recent`` stores each token in a ring of ``capacity`` entries whose scratch slot is
    ``scratch``: each chunk's last ``capacity`` rows (earlier ones would collide with them; they go to the scratch
    slot)."""
    keep = (positions >= rows.chunk_ends - capacity) & (rows.slots >= 0)
    slot = torch.where(keep, rows.slots, torch.full_like(rows.slots, scratch))
    return slot, _mod(positions.clamp(min=0), capacity)


def write_recent(ring: torch.Tensor,  # [S + 1, C, W]
                 fresh: torch.Tensor,  # [T, W]
                 rows: StateRows, positions: torch.Tensor,  # [T] int64
                 index: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:  # write_index's, for this ring
    """Store each chunk's last ``C`` rows in the ring (``index``: ``write_index`` computed once for rings of this
    shape)."""
    slot, entry = index if index is not None else write_index(rows, positions, ring.shape[1], ring.shape[0] - 1)
    # indexed on the ring itself, not on a flat view of it: inductor updates a graph input in place only then (an
    # index_put into ``ring.view(-1, W)`` copied the whole ring several times per layer and step: ~0.45 s of a
    # 0.5 s compiled V4 step at batch 32 with 1,057 state slots)
    ring[slot, entry] = fresh.to(ring.dtype)
