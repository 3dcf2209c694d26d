"""Static shapes for compiled regions: batch / block-table-width / prefill-length buckets and padding rules.

A compiled region sees only bucketed shapes, so the number of graphs is bounded by the bucket lists:
decode graphs = len(batch_sizes) * len(block_table_widths); prefill graphs = len(prefill_lengths) (one width
each: the smallest width bucket that holds the chunk). A step whose shape is above every bucket runs eagerly.

Padding rules (they never change what real rows compute):
- padded decode rows read token 0 at position 0, write their K/V into the scratch block (one block past the
  pool, ``block id == num_blocks``) and see one key; their outputs are discarded;
- padded block-table columns point at the scratch block and sit past every real row's ``seq_len``, so the
  causal mask hides them;
- a prefill chunk of ``q`` tokens padded to ``L`` runs as a decode-shaped batch of one row with ``L`` queries;
  the padded queries come after the real ones, so causality hides them from the real queries (their own
  positions may run past the table: they only read garbage, and are discarded).
"""
from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kernels.attention_metadata import AttentionMetadata, StateRows


def powers_of_two_up_to(limit: int, start: int = 1) -> tuple[int, ...]:
    """start, 2*start, 4*start, ... below ``limit``, then ``limit`` itself (so the largest bucket is exact)."""
    if limit < 1 or start < 1:
        raise ValueError(f"bucket limit and start must be >= 1, got limit={limit}, start={start}")
    out: list[int] = []
    value = start
    while value < limit:
        out.append(value)
        value *= 2
    out.append(limit)
    return tuple(out)


def _check_buckets(name: str, values: Sequence[int]) -> tuple[int, ...]:
    values = tuple(int(v) for v in values)
    if not values:
        raise ValueError(f"{name} must hold at least one bucket")
    if any(v < 1 for v in values) or list(values) != sorted(set(values)):
        raise ValueError(f"{name} must be strictly increasing positive ints, got {values}")
    return values


def _bucket(buckets: tuple[int, ...], n: int) -> int | None:
    i = bisect_left(buckets, n)
    return buckets[i] if i < len(buckets) else None


@dataclass(frozen=True)
class BucketSpec:
    batch_sizes: tuple[int, ...]  # decode rows (and sampler rows) per graph
    block_table_widths: tuple[int, ...]  # blocks per decode row
    prefill_lengths: tuple[int, ...]  # tokens of a single prefill chunk; () = prefill stays eager
    block_size: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "batch_sizes", _check_buckets("batch_sizes", self.batch_sizes))
        object.__setattr__(self, "block_table_widths", _check_buckets("block_table_widths",
                                                                      self.block_table_widths))
        if self.prefill_lengths:
            object.__setattr__(self, "prefill_lengths", _check_buckets("prefill_lengths", self.prefill_lengths))
            too_long = [n for n in self.prefill_lengths if self.width_bucket(-(-n // self.block_size)) is None]
            if too_long:
                raise ValueError(f"prefill_lengths {too_long} need more than the largest block_table_width "
                                 f"({self.block_table_widths[-1]} blocks of {self.block_size})")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")

    @classmethod
    def build(cls, max_num_seqs: int, max_model_len: int, block_size: int,
              batch_sizes: Sequence[int] | None = None, block_table_widths: Sequence[int] | None = None,
              prefill_lengths: Sequence[int] | None = None, min_width: int = 8) -> "BucketSpec":
        """Defaults: powers of two up to max_num_seqs rows and up to the blocks of max_model_len (from
        ``min_width``); prefill buckets must be given (prefill is compute-bound, eager by default).

        Every graph is compiled at start, so a bucket no step can reach is a wasted compile: given buckets past
        what the scheduler produces (rows past max_num_seqs, block-table widths past max_model_len's blocks, a
        prefill chunk longer than max_model_len) are refused, naming the limit."""
        max_blocks = -(-max_model_len // block_size)
        for name, given, limit, what in (("batch_buckets", batch_sizes, max_num_seqs, "max_num_seqs"),
                                          ("width_buckets", block_table_widths, max_blocks,
                                           f"the blocks of max_model_len={max_model_len} (block_size {block_size})"),
                                          ("prefill_buckets", prefill_lengths, max_model_len, "max_model_len")):
            past = [v for v in given or () if v > limit]
            if past:
                raise ValueError(f"{name} {past} exceed {what} = {limit}: no step reaches them, "
                                 f"and each one is a graph compiled at start")
        return cls(
            batch_sizes=tuple(batch_sizes) if batch_sizes else powers_of_two_up_to(max_num_seqs),
            block_table_widths=(tuple(block_table_widths) if block_table_widths
                                else powers_of_two_up_to(max_blocks, min(min_width, max_blocks))),
            prefill_lengths=tuple(prefill_lengths or ()),
            block_size=block_size,
        )

    def batch_bucket(self, n: int) -> int | None:
        return _bucket(self.batch_sizes, n)

    def width_bucket(self, n: int) -> int | None:
        return _bucket(self.block_table_widths, n)

    def prefill_bucket(self, n: int) -> int | None:
        return _bucket(self.prefill_lengths, n) if self.prefill_lengths else None

    def prefill_width(self, length: int) -> int:
        """The one block-table width compiled for prefill chunks of bucket ``length``."""
        width = self.width_bucket(-(-length // self.block_size))
        if width is None:
            raise ValueError(f"prefill length {length} needs more than {self.block_table_widths[-1]} blocks")
        return width

    def decode_keys(self) -> list[tuple[int, int]]:
        """(rows, width) of every decode graph."""
        return [(b, w) for b in self.batch_sizes for w in self.block_table_widths]

    def prefill_keys(self) -> list[tuple[int, int]]:
        """(queries, width) of every prefill graph."""
        return [(n, self.prefill_width(n)) for n in self.prefill_lengths]

    @property
    def max_graphs(self) -> int:
        return len(self.decode_keys()) + len(self.prefill_keys())


@dataclass
class PaddedStep:
    """A step's inputs padded to a graph's static shape; rows [0, num_real) are the real tokens."""

    input_ids: torch.Tensor  # [N] int64
    positions: torch.Tensor  # [N] int64
    meta: AttentionMetadata  # decode-shaped: num_prefills == 0
    num_real: int  # real tokens (rows of the output to keep)


def _pad_rows(x: torch.Tensor, rows: int, value: int) -> torch.Tensor:
    if x.shape[0] == rows:
        return x
    pad = x.new_full((rows - x.shape[0], *x.shape[1:]), value)
    return torch.cat([x, pad])


def pad_state(state: StateRows | None, rows: int) -> StateRows | None:
    """Padded rows have no state slot (-1: they write the scratch slot)."""
    if state is None:
        return None
    return StateRows(_pad_rows(state.slots, rows, -1), _pad_rows(state.chunk_starts, rows, 0),
                     _pad_rows(state.chunk_ends, rows, 0))


def pad_engram_rows(rows_in: torch.Tensor | None, rows: int) -> torch.Tensor | None:  # [L_e, T, W] -> [L_e, rows, W]
    """Padded tokens gather zeros (nothing reads what they compute)."""
    if rows_in is None or rows_in.shape[1] == rows:
        return rows_in
    return torch.cat([rows_in, rows_in.new_zeros(rows_in.shape[0], rows - rows_in.shape[1], rows_in.shape[2])], dim=1)


def _pad_table(table: torch.Tensor, rows: int, width: int, scratch: int) -> torch.Tensor:  # [B, w] -> [rows, width]
    out = table.new_full((rows, width), scratch)
    out[: table.shape[0], : table.shape[1]] = table
    return out


def pad_decode(input_ids: torch.Tensor,  # [B] int64
               positions: torch.Tensor,  # [B] int64
               meta: AttentionMetadata, rows: int, width: int, scratch_block: int) -> PaddedStep:
    """Pad a decode-only step (Q = 1) to ``rows`` rows and ``width`` block-table columns."""
    if meta.num_prefills or meta.decode_query_len != 1:
        raise ValueError("pad_decode needs a decode-only step with decode_query_len 1, got "
                         f"{meta.num_prefills} prefills and decode_query_len {meta.decode_query_len}")
    b = meta.num_decodes
    if not (b <= rows and meta.decode_block_tables.shape[1] <= width):
        raise ValueError(f"decode step [{b}, {meta.decode_block_tables.shape[1]}] does not fit bucket "
                         f"[{rows}, {width}]")
    scratch_slot = scratch_block * meta.block_size
    padded_meta = AttentionMetadata(
        block_size=meta.block_size,
        slot_mapping=_pad_rows(meta.slot_mapping, rows, scratch_slot),
        num_decodes=rows,
        decode_query_len=1,
        decode_block_tables=_pad_table(meta.decode_block_tables, rows, width, scratch_block),
        decode_seq_lens=_pad_rows(meta.decode_seq_lens, rows, 1),
        num_prefills=0, prefill_query_lens=[], prefill_seq_lens=[],
        prefill_block_tables=meta.prefill_block_tables.new_zeros((0, width)),
        state=pad_state(meta.state, rows),
        engram_rows=pad_engram_rows(meta.engram_rows, rows),
    )
    return PaddedStep(_pad_rows(input_ids, rows, 0), _pad_rows(positions, rows, 0), padded_meta, b)


def pad_prefill(input_ids: torch.Tensor,  # [q] int64
                positions: torch.Tensor,  # [q] int64
                meta: AttentionMetadata, length: int, width: int, scratch_block: int) -> PaddedStep:
    """Pad a step of exactly one prefill chunk to ``length`` queries, as a decode-shaped row of Q = length."""
    if meta.num_decodes or meta.num_prefills != 1:
        raise ValueError(f"pad_prefill needs exactly one prefill chunk and no decodes, got {meta.num_prefills} "
                         f"prefills and {meta.num_decodes} decodes")
    q_len, seq_len = meta.prefill_query_lens[0], meta.prefill_seq_lens[0]
    start = seq_len - q_len
    if q_len > length or -(-seq_len // meta.block_size) > width:
        raise ValueError(f"prefill chunk (start {start}, {q_len} tokens) does not fit bucket "
                         f"[{length} tokens, {width} blocks]")
    scratch_slot = scratch_block * meta.block_size
    padded_meta = AttentionMetadata(
        block_size=meta.block_size,
        slot_mapping=_pad_rows(meta.slot_mapping, length, scratch_slot),
        num_decodes=1,
        decode_query_len=length,
        # Query i sits at position seq_len - Q + i = start + i: the real queries keep their positions.
        decode_block_tables=_pad_table(meta.prefill_block_tables, 1, width, scratch_block),
        decode_seq_lens=torch.tensor([start + length], dtype=torch.int32, device=input_ids.device),
        num_prefills=0, prefill_query_lens=[], prefill_seq_lens=[],
        prefill_block_tables=meta.prefill_block_tables.new_zeros((0, width)),
        state=pad_state(meta.state, length),
        engram_rows=pad_engram_rows(meta.engram_rows, length),
    )
    return PaddedStep(_pad_rows(input_ids, length, 0), _pad_rows(positions, length, 0), padded_meta, q_len)
