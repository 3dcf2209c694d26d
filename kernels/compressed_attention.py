"""DeepSeek-V4 attention over a paged per-token cache: sliding window + compressed entries, with sinks.

Every token of a step reads its request's earlier tokens through the request's block table (``TokenPages``), so
decode rows, prefill chunks that continue a cached prefix and padded rows are all handled by one set of gathers
with shapes fixed by the step (no host syncs):

* the sliding-window keys are the last ``window`` positions up to the token itself;
* a compressor "window" of ``rate`` tokens closes at position ``(w + 1) * rate - 1``; its compressed entry is
  stored at the slot of that position, so entry ``w`` is visible to query ``t`` iff ``w < (t + 1) // rate``;
* the pooled candidate is computed for *every* token (as if its window closed there) and written at the token's
  slot: only the slots of window-closing positions are ever read, so the others are harmless scratch, and the step
  needs no data-dependent list of closing windows.

Gathers clamp negative positions to 0 and mask them; masked keys get probability 0, so stale slot contents never
reach an output. Decode rows gather their keys per token (``TokenPages``); a prefill chunk gathers them once for all
its queries (``ChunkPages``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.attention_metadata import StateRows


@dataclass(frozen=True)
class TokenPages:
    """Per step token: its position and its request's block table (scratch-padded to a common width)."""

    positions: torch.Tensor  # [T] int64
    block_tables: torch.Tensor  # [T, width] int64
    block_size: int

    @property
    def capacity(self) -> int:
        """Positions addressable through the tables (static for the step)."""
        return self.block_tables.shape[1] * self.block_size

    def slots(self, pos: torch.Tensor  # [T, K] int64, negative allowed (read as position 0, mask them)
              ) -> torch.Tensor:  # [T, K] int64 cache slots
        pos = pos.clamp(min=0)
        block = pos // self.block_size
        # pos - block * size rather than %: remainder is slow on Neuron (graph lint rule)
        return self.block_tables.gather(1, block) * self.block_size + (pos - block * self.block_size)

    def entry_slots(self, pos: torch.Tensor, rate: int) -> torch.Tensor:  # [T, E] closing positions -> entry rows
        """Rows of the paged compressed entries (``entry_rows_per_block`` per block) of windows closing at ``pos``."""
        return entry_rows(self.block_tables, pos, rate, self.block_size)

    def recent(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions ``t - length + 1 .. t`` of every token ([T, length]) and whether each exists (>= 0)."""
        offsets = torch.arange(1 - length, 1, device=self.positions.device)
        pos = self.positions[:, None] + offsets[None, :]
        return pos, pos >= 0

    def entries(self, rate: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Closing positions of every compressor window the tables can hold ([T, E]) and which each token sees."""
        num_entries = self.capacity // rate
        index = torch.arange(num_entries, device=self.positions.device)
        pos = ((index + 1) * rate - 1)[None, :].expand(self.positions.shape[0], -1)
        visible = index[None, :] < ((self.positions + 1) // rate)[:, None]
        return pos, visible


@dataclass(frozen=True)
class ChunkPages:
    """One prefill chunk: ``length`` consecutive positions from ``first`` (host ints) under one block table. Its
    queries share their keys, gathered once ([1, K]) instead of per token: a long context's entries are read once
    per chunk, not once per query."""

    first: int
    length: int
    block_table: torch.Tensor  # [1, width] int64
    block_size: int

    @property
    def positions(self) -> torch.Tensor:  # [L] int64
        return torch.arange(self.first, self.first + self.length, device=self.block_table.device)

    def slots(self, pos: torch.Tensor) -> torch.Tensor:  # [1, K] int64 -> [1, K] slots
        return TokenPages(pos[0], self.block_table, self.block_size).slots(pos)

    def entry_slots(self, pos: torch.Tensor, rate: int) -> torch.Tensor:  # [1, E] -> [1, E] entry rows
        return entry_rows(self.block_table, pos, rate, self.block_size)

    def recent(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions from ``first - length + 1`` to the last query ([1, K]) and each query's window ([L, K])."""
        q = self.positions
        pos = torch.arange(self.first - length + 1, self.first + self.length, device=q.device)
        allowed = (pos[None, :] <= q[:, None]) & (pos[None, :] > q[:, None] - length) & (pos >= 0)[None, :]
        return pos[None, :], allowed

    def entries(self, rate: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Closing positions of the windows closed by the last query ([1, E]) and which each query sees ([L, E])."""
        index = torch.arange((self.first + self.length) // rate, device=self.block_table.device)
        visible = index[None, :] < ((self.positions + 1) // rate)[:, None]
        return ((index + 1) * rate - 1)[None, :], visible


def held_entries(pages: "TokenPages | ChunkPages", rate: int,
                 scratch_block: int) -> torch.Tensor:  # [G, E] bool
    """Context parallelism: which of ``pages.entries(rate)``'s entries this rank holds (their block is not the
    scratch block the tables give for another rank's blocks)."""
    pos, _ = pages.entries(rate)
    tables = pages.block_tables if isinstance(pages, TokenPages) else pages.block_table
    return tables.gather(1, pos // pages.block_size) != scratch_block


def entry_rows_per_block(block_size: int, rate: int) -> int:
    """Compressed entries one block holds: windows of ``rate`` closing among its ``block_size`` positions (exact
    when ``rate`` divides ``block_size``; otherwise some rows of a block stay unused)."""
    return -(-block_size // rate)


def entry_rows(block_tables: torch.Tensor,  # [G, width] int64
               pos: torch.Tensor,  # [G, E] int64 closing positions (>= 0)
               rate: int, block_size: int) -> torch.Tensor:  # [G, E] int64
    """The paged entry of the window closing at ``pos``: its block's rows, then the window's index in the block."""
    block = pos // block_size
    offset = pos - block * block_size
    return block_tables.gather(1, block) * entry_rows_per_block(block_size, rate) + offset // rate


def entry_write_rows(slot_mapping: torch.Tensor,  # [T] int64 each token's paged slot
                     positions: torch.Tensor,  # [T] int64
                     rate: int, block_size: int, num_rows: int) -> torch.Tensor:  # [T] int64
    """Where each token's candidate entry goes: the entry of its window when the token closes that window, else a
    row of the scratch block (the last block), so a step writes each real entry once."""
    per_block = entry_rows_per_block(block_size, rate)
    block = slot_mapping // block_size
    row = block * per_block + (slot_mapping - block * block_size) // rate
    closes = (positions + 1) // rate * rate == positions + 1
    return torch.where(closes, row, torch.full_like(row, num_rows - per_block))


def gather_rows(layer_cache: torch.Tensor,  # [num_slots, C] one layer of one cache tensor
                slots: torch.Tensor,  # [G, K] int64 (G = T per-token keys, or 1 shared by a chunk)
                ) -> torch.Tensor:  # [G, K, C]
    return layer_cache.index_select(0, slots.flatten()).view(*slots.shape, layer_cache.shape[-1])


def pool_window(kv: torch.Tensor,  # [T, n, D] the window's per-token values
                gate: torch.Tensor,  # [T, n, D] gate logits (position bias included, -inf for absent tokens)
                ) -> torch.Tensor:  # [T, D]
    """Gated softmax pooling over the window's tokens, per channel (softmax in fp32)."""
    return (kv * gate.softmax(dim=1, dtype=torch.float32).to(kv.dtype)).sum(dim=1)


def pool_heavily_compressed(state: torch.Tensor,  # [T, rate, 2D]: per token [kv | gate], window order
                            position_bias: torch.Tensor,  # [rate, D]
                            ) -> torch.Tensor:  # [T, D]
    """HCA: one entry per non-overlapping window of ``rate`` tokens."""
    dim = position_bias.shape[-1]
    return pool_window(state[..., :dim], state[..., dim:] + position_bias)


def pool_overlapping(state: torch.Tensor,  # [T, 2 * rate, 4D]: per token [kv_a | kv_b | gate_a | gate_b]
                     exists: torch.Tensor,  # [T, 2 * rate] bool: the position is >= 0
                     position_bias: torch.Tensor,  # [rate, 2D]: [bias_a | bias_b]
                     ) -> torch.Tensor:  # [T, D]
    """CSA (and its indexer): entry ``w`` pools series A of window ``w - 1`` with series B of window ``w``, an
    overlapping width of ``2 * rate`` at stride ``rate``. Window 0 has no predecessor: those slots get weight 0."""
    rate, dim = position_bias.shape[0], position_bias.shape[1] // 2
    previous, current = state[:, :rate], state[:, rate:]
    kv = torch.cat([previous[..., :dim], current[..., dim:2 * dim]], dim=1)
    gate = torch.cat([previous[..., 2 * dim:3 * dim] + position_bias[:, :dim],
                      current[..., 3 * dim:] + position_bias[:, dim:]], dim=1)
    kv = torch.where(exists[..., None], kv, torch.zeros_like(kv))
    gate = torch.where(exists[..., None], gate, torch.full_like(gate, float("-inf")))
    return pool_window(kv, gate)


def indexer_select(q: torch.Tensor,  # [T, Hi, Di] post-rope index queries
                   keys: torch.Tensor,  # [T or 1, E, Di] compressed index keys (per query, or shared)
                   head_weights: torch.Tensor,  # [T, Hi] already scaled by Hi ** -0.5
                   visible: torch.Tensor,  # [T, E] bool
                   top_k: int) -> torch.Tensor:  # [T, E] bool: the entries each query attends
    """Lightning indexer: ``sum_h w[t, h] * relu(q[t, h] . k[s]) / sqrt(Di)``; the ``top_k`` best visible entries,
    equal scores in entry order (``top_k_in_order``)."""
    if top_k >= visible.shape[1]:  # every visible entry is picked (short contexts): no scores needed
        return visible
    if top_k == 0:
        return torch.zeros_like(visible)
    return top_k_in_order(indexer_scores(q, keys, head_weights, visible), top_k) & visible


def indexer_scores(q: torch.Tensor,  # [T, Hi, Di] post-rope index queries
                   keys: torch.Tensor,  # [T or 1, E, Di]
                   head_weights: torch.Tensor,  # [T, Hi]
                   visible: torch.Tensor,  # [T, E] bool
                   ) -> torch.Tensor:  # [T, E] float32, -inf where not visible
    """The lightning indexer's score of every visible entry (``indexer_select`` picks the best)."""
    scores = F.relu(torch.matmul(q.float(), keys.float().transpose(1, 2))) * q.shape[-1] ** -0.5
    scores = (scores * head_weights.float()[..., None]).sum(dim=1)
    return scores.masked_fill(~visible, float("-inf"))


def top_k_in_order(scores: torch.Tensor,  # [T, E] float, columns in entry order
                   top_k: int) -> torch.Tensor:  # [T, E] bool
    """The ``top_k`` largest scores per row, equal scores taken in column order (the earlier entry first).

    ``torch.topk`` leaves the order of equal values unspecified, and it differs between row lengths: a prefill row
    (every entry of the chunk, future ones -inf) and a decode row (closed entries only) picked different blocks among
    tied scores, and the indexer's scores tie often (an entry whose every head's ReLU is 0 scores exactly 0). This
    rule depends on the values alone, so prefill, decode, draft verification, every rank and compiled graphs agree:
    the k-th value comes from ``topk`` (values are unique whatever the order), then ties at it fill the remaining
    places left to right. Static shapes, no sort."""
    kth = scores.topk(top_k, dim=-1).values[:, -1:]
    above = scores > kth
    tied = scores == kth
    room = top_k - above.sum(dim=-1, keepdim=True)
    return above | (tied & (tied.cumsum(dim=-1) <= room))


def sink_attention(q: torch.Tensor,  # [T, H, D] post-rope queries
                   keys: torch.Tensor,  # [T or 1, K, D] one K = V head (per query, or shared by a chunk)
                   allowed: torch.Tensor,  # [T, K] bool
                   sinks: torch.Tensor,  # [H] float32 per-head sink logits
                   scale: float) -> torch.Tensor:  # [T, H, D]
    """Softmax over each query's allowed keys plus one per-head sink logit that takes mass but carries no value.
    Keys that are not allowed get probability exactly 0; every cache row holds finite values (zeros, or a value
    some step wrote), so they add nothing."""
    scores = torch.matmul(q, keys.transpose(1, 2)) * scale
    scores = scores.masked_fill(~allowed[:, None, :], float("-inf"))
    sink = sinks.to(scores.dtype)[None, :, None].expand(q.shape[0], -1, 1)
    logits = torch.cat([scores, sink], dim=-1)
    logits = logits - logits.max(dim=-1, keepdim=True).values
    probs = torch.softmax(logits, dim=-1, dtype=logits.dtype)[..., :-1]
    return torch.matmul(probs.to(keys.dtype), keys)


def cpu_sink_attention(q: torch.Tensor,  # [T, H, D] float32 post-rope queries
                       keys: torch.Tensor,  # [T or 1, K, D] float32
                       allowed: torch.Tensor,  # [T, K] bool
                       extra: torch.Tensor,  # [T or 1, E, D] float32: a second key set (compressed entries)
                       extra_allowed: torch.Tensor,  # [T, E] bool
                       sinks: torch.Tensor,  # [H]
                       scale: float) -> torch.Tensor:  # [T, H, D]
    """``sink_attention`` over the two key sets concatenated, in one C++ pass (kernels/csrc/sink_attention.cpp;
    needs ``kernels.cpu_kernels.load_cpu_kernels()``)."""
    return torch.ops.deepinfer.sink_attention(q, keys, allowed, extra, extra_allowed, sinks, scale)


def cpu_ring_sink_attention(q: torch.Tensor,  # [L, H, D] float32: decode rows first .. first + L of the step
                            ring: torch.Tensor,  # [S + 1, C, D] float32 contiguous: the layer's window ring
                            fresh: torch.Tensor,  # [T, D] float32: this step's K = V rows
                            rows: StateRows, positions: torch.Tensor,  # [T] int64
                            first: int, window: int,
                            extra: torch.Tensor,  # [L or 1, E, D] float32 compressed entries
                            extra_allowed: torch.Tensor,  # [L, E] bool
                            sinks: torch.Tensor,  # [H]
                            scale: float) -> torch.Tensor:  # [L, H, D]
    """``cpu_sink_attention`` with each token's sliding window read in place (``kernels/state_ring.py``'s
    ``recent_rows`` layout: the ring before the token's chunk start, ``fresh`` after), not gathered first."""
    return torch.ops.deepinfer.ring_sink_attention(q, ring, fresh, rows.slots, rows.chunk_starts, positions, first,
                                                   window, extra, extra_allowed, sinks, scale)
