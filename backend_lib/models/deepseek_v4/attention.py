"""DeepSeek-V4 attention, per layer type, over the hybrid cache: fixed per-request rings (the sliding window's K = V
and each compressor's projections of a window not yet closed, ``kernels/state_ring.py``) and paged compressed entries
(``kernels/compressed_attention.py``).

Every layer: shared-KV MQA (one K = V head) with q LoRA, an unweighted per-head q norm, interleaved partial RoPE on
the trailing ``rope_dim`` channels (undone on the output with the conjugate rotation), per-head sinks, the
sliding-window branch and the grouped low-rank output projection. ``heavily_compressed_attention`` adds the entries
of a non-overlapping compressor (all visible ones attended); ``compressed_sparse_attention`` adds an overlapping
two-series compressor whose entries a lightning indexer filters to the ``index_topk`` best per query.

Module and tensor names follow the release checkpoint (``attn.wq_a``, ``attn.compressor.wkv``, ``attn.indexer.wq_b``)
so loading needs no renaming. Tensor parallelism shards the query heads (``wq_b``, ``attn_sink``) and the output
groups (``wo_a`` rows, ``wo_b`` columns, one all-reduce); the single KV head, the compressors and the indexer are
small and stay whole on every rank.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from backend_lib.models.deepseek_v3.layers import BlockLinear, RMSNorm, fuse_blocked, fused_linear
from backend_lib.models.parallel import ParallelContext, Shard
from kernels.attention_metadata import ContextShare, StateRows
from kernels.compressed_attention import (
    ChunkPages, TokenPages, cpu_ring_sink_attention, cpu_sink_attention, entry_write_rows, gather_rows, held_entries,
    indexer_scores, indexer_select, pool_heavily_compressed, pool_overlapping, sink_attention, top_k_in_order,
)
from kernels.context_attention import merge_partials, partial_sink_attention
from kernels.gemv import TILE, blocked_linear
from kernels.hyper_connections import unweighted_rms_norm
from kernels.interleaved_rope import apply_tail_rope, rope_cos_sin
from kernels.quant import DEFAULT_BLOCK
from kernels.state_ring import chunk_recent_rows, recent_rows, write_index, write_recent
from kernels.v4_fp8 import EntryRecord, IndexKeyRecord, entry_values, store_entries

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
LAYER_TYPES = (SLIDING, CSA, HCA)


@dataclass(frozen=True)
class V4Rope:
    """One of V4's two rotaries ("main" for sliding layers, "compress" for CSA / HCA layers and compressors)."""

    inv_freq: torch.Tensor  # [P / 2] float32
    attention_scaling: float

    def at(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:  # [T]
        return rope_cos_sin(self.inv_freq, positions, self.attention_scaling, dtype)


def compress_rope_scaling(config: dict[str, Any]) -> dict | None:
    """The "compress" rotary's YaRN parameters (transformers nests them under ``rope_parameters["compress"]``;
    older configs give a flat ``rope_parameters`` / ``rope_scaling``); None for plain RoPE."""
    rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    compress = dict(rope["compress"]) if isinstance(rope.get("compress"), dict) else {
        k: v for k, v in rope.items() if k != "main"}
    rope_type = compress.get("rope_type", compress.get("type", "default"))
    if rope_type == "default":
        return None
    if rope_type != "yarn":
        raise ValueError(f"rope_parameters['compress'].rope_type must be 'default' or 'yarn', got {rope_type!r}")
    compress.setdefault("attention_factor", 1.0)  # the V4 reference does not scale cos / sin
    compress.setdefault("original_max_position_embeddings", config.get("max_position_embeddings", 1048576))
    return compress


@dataclass(frozen=True)
class V4AttentionDims:
    hidden: int
    num_heads: int
    head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    sliding_window: int
    eps: float
    layer_type: str
    compress_rate: int  # 0 for sliding layers
    index_n_heads: int
    index_head_dim: int
    index_topk: int


@dataclass(frozen=True)
class StepContext:
    """What every layer of one step shares: token pages (paged entries), the step's slots and state rows (rings),
    each rotary's cos / sin, and the query groups attention runs over (decode rows with per-token keys, then each
    prefill chunk with shared keys)."""

    pages: TokenPages
    slot_mapping: torch.Tensor  # [T] int64
    rows: StateRows
    main_rope: tuple[torch.Tensor, torch.Tensor]  # cos, sin [T, P / 2]
    compress_rope: tuple[torch.Tensor, torch.Tensor]
    groups: tuple[tuple[int, int, TokenPages | ChunkPages], ...]  # (first row, end row, pages)
    decode_query_len: int = 1  # tokens per decode row (1 + drafts)
    longest_chunk: int | None = None  # the step's longest chunk (None: unknown); bounds a token's fresh positions
    # index arithmetic every layer of the step would redo (``shared``): ring write rows, closing tokens, entry rows
    memo: dict = field(default_factory=dict, compare=False, repr=False)
    context: ContextShare | None = None  # context parallelism: the compressed entries are split across the ranks

    def shared(self, key: tuple, make: Callable[[], Any]) -> Any:
        """``make()`` once per step for all layers asking for ``key`` (what it depends on beyond this context);
        eagerly ~15 small ops each, from every layer. Compiled regions compute it in place (the graph shares it)."""
        if torch.compiler.is_compiling():
            return make()
        if key not in self.memo:
            self.memo[key] = make()
        return self.memo[key]


@dataclass(frozen=True)
class LayerCache:
    """One layer's views into the cache tensors: rings ``[state slots + 1, capacity, width]`` and paged entries
    ``[blocks * entry rows per block, width]``."""

    window: torch.Tensor  # ring [S + 1, window + drafts, D]: K = V of the last tokens
    state: torch.Tensor | None = None  # ring [S + 1, span + drafts, (1 or 2) * 2D]: compressor [kv | gate]
    entries: torch.Tensor | None = None  # paged [E, D]: compressed entries
    index_state: torch.Tensor | None = None  # ring [S + 1, span + drafts, 4 Di]: indexer compressor projections
    index_entries: torch.Tensor | None = None  # paged [E, Di]
    engram_ring: torch.Tensor | None = None  # ring [S + 1, conv lookback + drafts, hc * D]: Engram's ShortConv input
    engram_rows: torch.Tensor | None = None  # [T, width]: this step's gathered Engram rows


def ring_write_index(ctx: StepContext, ring: torch.Tensor,  # [S + 1, C, W]
                     ) -> tuple[torch.Tensor, torch.Tensor]:  # [T] slot, [T] entry
    """Where ``write_recent`` puts the step's rows in rings of this shape (shared by the step's layers)."""
    return ctx.shared(("ring_write", ring.shape[0], ring.shape[1]),
                      lambda: write_index(ctx.rows, ctx.pages.positions, ring.shape[1], ring.shape[0] - 1))


def entry_rows_visible(pages: TokenPages | ChunkPages,
                       rate: int) -> tuple[torch.Tensor, torch.Tensor]:  # [G, E] entry rows, [L, E] bool
    """The paged rows of every compressed entry a group's tables hold, and which of them each query sees."""
    entry_pos, visible = pages.entries(rate)
    return pages.entry_slots(entry_pos, rate), visible


class Compressor(nn.Module):
    """Pools every ``rate`` tokens' projections into one entry (kv_norm, then RoPE at the window's first position).

    ``overlap`` (CSA and its indexer): projections are ``2 * dim`` wide, two series A | B, and entry ``w`` pools
    series A of window ``w - 1`` with series B of window ``w``. Otherwise (HCA) one series, non-overlapping.
    """

    def __init__(self, hidden: int, dim: int, rate: int, overlap: bool, eps: float, rope: V4Rope,
                 block_size: tuple[int, int]) -> None:
        super().__init__()
        self.dim, self.rate, self.overlap, self.rope = dim, rate, overlap, rope
        width = 2 * dim if overlap else dim
        self.wkv = BlockLinear(hidden, width, block_size=block_size)
        self.wgate = BlockLinear(hidden, width, block_size=block_size)
        self.ape = nn.Parameter(torch.zeros(rate, width), requires_grad=False)
        self.norm = RMSNorm(dim, eps)
        self.cpp_rope = False  # host engines with the C++ ops (V4 model's use_cpu_attention)
        self.register_buffer("kv_gate_blocked", None, persistent=False)  # fuse_for_cpu
        # fp8 KV cache (the model's use_fp8_kv): the paged entries are records (kernels/v4_fp8.py)
        self.record: EntryRecord | IndexKeyRecord | None = None

    def fuse_for_cpu(self) -> None:
        """``wkv`` and ``wgate`` as one blocked GEMM (after BlockLinear.block_for_cpu): they read the same input."""
        self.register_buffer("kv_gate_blocked", fuse_blocked(self.wkv, self.wgate), persistent=False)

    def forward(self, x: torch.Tensor,  # [T, hidden] the attention block's normed input
                ctx: StepContext,
                state: torch.Tensor,  # ring [S + 1, C, 2 * width]: [kv | gate] projections
                entries: torch.Tensor) -> None:  # paged [E, dim]
        """Pool the window ending at every token (earlier steps' projections from the ring, this step's fresh), keep
        the entries of the windows that close, then leave each chunk's last projections in the ring.

        Eagerly only the tokens that close a window are pooled (at decode, 1 in ``rate``; an HCA layer's window is
        128 tokens wide): the others' candidates only ever reach the scratch rows. Compiled regions keep every
        token (static shapes)."""
        projections = fused_linear(x, self.kv_gate_blocked, (self.wkv, self.wgate))
        positions = ctx.pages.positions
        if torch.compiler.is_compiling():
            self._pool(projections, ctx, state, entries, None)
        else:
            closing = ctx.shared(("closing", self.rate),
                                 lambda: torch.nonzero((positions + 1) % self.rate == 0).flatten())
            if closing.numel():
                self._pool(projections, ctx, state, entries, closing)
        # the ring write comes after every use of the rows read from it: inductor then updates the ring (a graph
        # input) in place; a write before the pooling made it copy the whole ring per layer and step
        write_recent(state, projections, ctx.rows, positions, ring_write_index(ctx, state))

    def _pool(self, projections: torch.Tensor,  # [T, 2 * width] this step's [kv | gate]
              ctx: StepContext, state: torch.Tensor, entries: torch.Tensor,
              tokens: torch.Tensor | None) -> None:  # [N] int64 the rows to pool, None: all
        span = 2 * self.rate if self.overlap else self.rate
        positions, slots = ctx.pages.positions, ctx.slot_mapping
        window, exists = recent_rows(state, projections, ctx.rows, positions, span,
                                     longest_chunk=ctx.longest_chunk, tokens=tokens)
        if tokens is not None:
            positions, slots = positions[tokens], slots[tokens]
        ape = self.ape.to(projections.dtype)
        pooled = pool_overlapping(window, exists, ape) if self.overlap else pool_heavily_compressed(window, ape)
        cos, sin = self.rope.at(positions - self.rate + 1, projections.dtype)
        rows = entry_write_rows(slots, positions, self.rate, ctx.pages.block_size, entries.shape[0])
        store_entries(entries, rows, apply_tail_rope(self.norm(pooled), cos, sin, self.cpp_rope), self.record)


class Indexer(nn.Module):
    """Lightning indexer: its own overlapping compressor at ``index_head_dim`` plus scoring queries and weights."""

    def __init__(self, d: V4AttentionDims, rope: V4Rope, block_size: tuple[int, int]) -> None:
        super().__init__()
        self.d = d
        self.wq_b = BlockLinear(d.q_lora_rank, d.index_n_heads * d.index_head_dim, block_size=block_size)
        self.weights_proj = BlockLinear(d.hidden, d.index_n_heads, block_size=block_size)
        self.compressor = Compressor(d.hidden, d.index_head_dim, d.compress_rate, True, d.eps, rope, block_size)
        self.cpp_rope = False

    def queries(self, x: torch.Tensor,  # [T, hidden]
                q_residual: torch.Tensor,  # [T, q_lora_rank]
                ctx: StepContext) -> tuple[torch.Tensor, torch.Tensor]:  # [T, Hi, Di], [T, Hi]
        d = self.d
        q = self.wq_b(q_residual).view(-1, d.index_n_heads, d.index_head_dim)
        return (apply_tail_rope(q, *ctx.compress_rope, self.cpp_rope),
                self.weights_proj(x).float() * d.index_n_heads ** -0.5)

    def select(self, q: torch.Tensor,  # [L, Hi, Di] this group's index queries
               head_weights: torch.Tensor,  # [L, Hi]
               cache: LayerCache,
               entry_slots: torch.Tensor,  # [L or 1, E]
               visible: torch.Tensor,  # [L, E] bool
               ) -> torch.Tensor:  # [L, E] bool
        if self.d.index_topk >= visible.shape[1]:  # all visible entries are picked: skip the gather and scores
            return visible
        keys = entry_values(gather_rows(cache.index_entries, entry_slots), self.compressor.record, q.dtype)
        keys = keys.to(q.dtype)
        return indexer_select(q, keys, head_weights, visible, self.d.index_topk)


class V4Attention(nn.Module):
    def __init__(self, d: V4AttentionDims, main_rope: V4Rope, compress_rope: V4Rope, par: ParallelContext,
                 block_size: tuple[int, int] = DEFAULT_BLOCK) -> None:
        super().__init__()
        if d.layer_type not in LAYER_TYPES:
            raise ValueError(f"layer_types entries must be one of {LAYER_TYPES}, got {d.layer_type!r}")
        if d.num_heads % d.o_groups:
            raise ValueError(f"o_groups ({d.o_groups}) must divide num_attention_heads ({d.num_heads})")
        self.d, self.par = d, par
        self.scale = d.head_dim ** -0.5
        head_start, self.num_heads = par.even(d.num_heads, "num_attention_heads")
        group_start, self.o_groups = par.even(d.o_groups, "o_groups")
        rank = d.o_lora_rank
        self.wq_a = BlockLinear(d.hidden, d.q_lora_rank, block_size=block_size)
        self.q_norm = RMSNorm(d.q_lora_rank, d.eps)
        self.wq_b = BlockLinear(d.q_lora_rank, self.num_heads * d.head_dim, block_size=block_size)
        self.wkv = BlockLinear(d.hidden, d.head_dim, block_size=block_size)
        self.norm = RMSNorm(d.head_dim, d.eps)
        self.wo_a = BlockLinear(d.num_heads * d.head_dim // d.o_groups, self.o_groups * rank, block_size=block_size)
        self.wo_b = BlockLinear(self.o_groups * rank, d.hidden, block_size=block_size)
        self.attn_sink = nn.Parameter(torch.zeros(self.num_heads), requires_grad=False)
        self.compressor = None if d.layer_type == SLIDING else Compressor(
            d.hidden, d.head_dim, d.compress_rate, d.layer_type == CSA, d.eps, compress_rope, block_size)
        self.indexer = Indexer(d, compress_rope, block_size) if d.layer_type == CSA else None
        self.cpp_attention = False  # host engines with the C++ ops: kernels/csrc/sink_attention.cpp
        self.cpp_rope = False
        self.register_buffer("q_kv_blocked", None, persistent=False)  # fuse_for_cpu
        # checkpoint tensor -> the part this rank holds (tensors not listed are whole on every rank)
        self.shards = {
            "wq_b.weight": Shard(0, head_start * d.head_dim, self.num_heads * d.head_dim),
            "attn_sink": Shard(0, head_start, self.num_heads),
            "wo_a.weight": Shard(0, group_start * rank, self.o_groups * rank),
            "wo_b.weight": Shard(1, group_start * rank, self.o_groups * rank),
        }

    def fuse_for_cpu(self) -> None:
        """``wq_a`` and ``wkv`` as one blocked GEMM (after BlockLinear.block_for_cpu): they read the same input."""
        self.register_buffer("q_kv_blocked", fuse_blocked(self.wq_a, self.wkv), persistent=False)

    def forward(self, x: torch.Tensor,  # [T, hidden] normed block input
                ctx: StepContext, cache: LayerCache) -> torch.Tensor:  # [T, hidden]
        d = self.d
        cos, sin = ctx.main_rope if d.layer_type == SLIDING else ctx.compress_rope
        q_a, kv = fused_linear(x, self.q_kv_blocked, (self.wq_a, self.wkv)).split([d.q_lora_rank, d.head_dim], -1)
        q_residual = self.q_norm(q_a)
        q = unweighted_rms_norm(self.wq_b(q_residual).view(-1, self.num_heads, d.head_dim), d.eps, self.cpp_rope)
        q = apply_tail_rope(q, cos, sin, self.cpp_rope)
        kv = apply_tail_rope(self.norm(kv), cos, sin, self.cpp_rope)

        index_q = None
        if self.compressor is not None:
            self.compressor(x, ctx, cache.state, cache.entries)
        if self.indexer is not None:
            self.indexer.compressor(x, ctx, cache.index_state, cache.index_entries)
            index_q = self.indexer.queries(x, q_residual, ctx)
        parts = [self._attend(q[start:end], None if index_q is None else (index_q[0][start:end], index_q[1][start:end]),
                              kv, ctx, start, end, pages, cache)
                 for start, end, pages in ctx.groups]
        # after every group read the window
        write_recent(cache.window, kv, ctx.rows, ctx.pages.positions, ring_write_index(ctx, cache.window))
        out = torch.cat(parts) if len(parts) > 1 else parts[0]
        out = apply_tail_rope(out, cos, -sin, self.cpp_rope)
        return self.par.all_reduce(self.wo_b(self._grouped_output(out)))

    def _window(self, kv: torch.Tensor,  # [T, D] this step's K = V
                ctx: StepContext, start: int, end: int, pages: TokenPages | ChunkPages,
                ring: torch.Tensor,  # [S + 1, C, D]
                ) -> tuple[torch.Tensor, torch.Tensor]:  # keys [L or 1, K, D], allowed [L, K]
        """The sliding-window keys of a group's queries: per token (decode rows), or shared by a prefill chunk."""
        w = self.d.sliding_window
        if isinstance(pages, ChunkPages):
            _, allowed = pages.recent(w)
            return chunk_recent_rows(ring, kv, ctx.rows, start, pages.first, pages.length, w - 1), allowed
        return recent_rows(ring, kv, ctx.rows, ctx.pages.positions, w, start, end - start,
                           longest_chunk=ctx.decode_query_len)  # TokenPages groups: decode rows

    def _attend(self, q: torch.Tensor,  # [L, H, D] one group's queries
                index_q: tuple[torch.Tensor, torch.Tensor] | None,  # its index queries [L, Hi, Di], weights [L, Hi]
                kv: torch.Tensor,  # [T, D] this step's K = V
                ctx: StepContext, start: int, end: int, pages: TokenPages | ChunkPages,
                cache: LayerCache) -> torch.Tensor:  # [L, H, D]
        """Sliding window plus (CSA: the indexer's picks among) the visible compressed entries."""
        d = self.d
        if ctx.context is not None and self.compressor is not None:
            return self._attend_held(q, index_q, kv, ctx, start, end, pages, cache)
        entry_keys, visible = None, None  # sliding layers: no second key set
        if self.compressor is not None:
            entry_slots, visible = ctx.shared(("entries", start, d.compress_rate),
                                              lambda: entry_rows_visible(pages, d.compress_rate))
            if index_q is not None:
                visible = self.indexer.select(*index_q, cache, entry_slots, visible)
            entry_keys = entry_values(gather_rows(cache.entries, entry_slots), self.compressor.record, q.dtype)
        # both key sets in one pass, no concatenation; eager only: an opaque op over the ring's rows made inductor
        # copy the rings again (a batch-32 graph step 0.09 -> 0.45 s), and graphs fuse the torch form anyway
        cpp = self.cpp_attention and q.dtype == torch.float32 and not torch.compiler.is_compiling()
        if cpp and isinstance(pages, TokenPages) and cache.window.dtype == kv.dtype and cache.window.is_contiguous():
            # decode rows: the window read in place from the ring (no gathered copy)
            if entry_keys is None:
                entry_keys = q.new_empty(1, 0, d.head_dim)
                visible = torch.zeros(q.shape[0], 0, dtype=torch.bool, device=q.device)
            return cpu_ring_sink_attention(q, cache.window, kv, ctx.rows, ctx.pages.positions, start,
                                           d.sliding_window, entry_keys.to(q.dtype), visible, self.attn_sink,
                                           self.scale)
        keys, allowed = self._window(kv, ctx, start, end, pages, cache.window)
        if entry_keys is None:
            entry_keys, visible = keys[:, :0], allowed[:, :0]
        if cpp:
            return cpu_sink_attention(q, keys.to(q.dtype), allowed, entry_keys.to(q.dtype), visible, self.attn_sink,
                                      self.scale)
        keys = torch.cat([keys, entry_keys.to(keys.dtype)], dim=1)
        allowed = torch.cat([allowed, visible], dim=1)
        return sink_attention(q, keys.to(q.dtype), allowed, self.attn_sink, self.scale)

    def _attend_held(self, q: torch.Tensor,  # [L, H, D] one group's queries (every context rank has every row)
                     index_q: tuple[torch.Tensor, torch.Tensor] | None,  # [L, Hi, Di], [L, Hi]
                     kv: torch.Tensor,  # [T, D]
                     ctx: StepContext, start: int, end: int, pages: TokenPages | ChunkPages,
                     cache: LayerCache) -> torch.Tensor:  # [L, H, D]
        """Context parallelism: the compressed entries this rank holds (the indexer's top-k chosen over every
        rank's scores, so each rank keeps exactly its share of the one-rank picks); context rank 0 adds the sliding
        window (every rank's rings hold it) and the sinks; the parts are merged by log-sum-exp."""
        d, share, group = self.d, ctx.context, self.par.context
        entry_slots, visible = ctx.shared(("entries", start, d.compress_rate),
                                          lambda: entry_rows_visible(pages, d.compress_rate))
        held = ctx.shared(("held", start, d.compress_rate),
                          lambda: held_entries(pages, d.compress_rate, share.scratch_block))  # [L or 1, E]
        if index_q is not None and d.index_topk < visible.shape[1]:
            keys = entry_values(gather_rows(cache.index_entries, entry_slots), self.indexer.compressor.record,
                                q.dtype)
            scores = indexer_scores(*index_q[:1], keys.to(q.dtype), index_q[1], visible & held)
            visible = top_k_in_order(group.all_gather(scores).max(dim=0).values, d.index_topk) & visible
        entry_keys = entry_values(gather_rows(cache.entries, entry_slots), self.compressor.record, q.dtype)
        allowed = visible & held
        if share.rank == 0:
            window, window_allowed = self._window(kv, ctx, start, end, pages, cache.window)
            entry_keys = torch.cat([window.to(entry_keys.dtype), entry_keys.expand(window.shape[0], -1, -1)
                                    if window.shape[0] != entry_keys.shape[0] else entry_keys], dim=1)
            allowed = torch.cat([window_allowed, allowed], dim=1)
        out, lse = partial_sink_attention(q, entry_keys, allowed, self.attn_sink if share.rank == 0 else None,
                                          self.scale)
        parts = group.all_gather(torch.cat([out.flatten(1), lse], dim=1))  # [R, L, H * D + H]
        heads, dim = out.shape[1:]
        return merge_partials(parts[..., :heads * dim].unflatten(-1, (heads, dim)), parts[..., heads * dim:]).to(
            q.dtype)

    def _grouped_output(self, out: torch.Tensor) -> torch.Tensor:  # [T, H, D] -> [T, G * R]
        """Block-diagonal ``wo_a``: each group of heads has its own projection to ``o_lora_rank``."""
        rank, blocked = self.d.o_lora_rank, self.wo_a.blocked
        if (blocked is not None and rank % TILE == 0 and out.dtype == self.wo_a.weight.dtype
                and self.wo_a.gemv_policy.use_blocked(out.shape[0])):
            # group g's rows of wo_a are whole 16-row tiles of its blocked layout: one few-row GEMM per group
            # (MKL's batched GEMM took ~3x their time at batch 32)
            tiles = rank // TILE
            flat = out.reshape(out.shape[0], self.o_groups, -1)
            return torch.cat([blocked_linear(flat[:, g].contiguous(), blocked[g * tiles:(g + 1) * tiles], None, rank)
                              for g in range(self.o_groups)], dim=1)
        groups = out.reshape(out.shape[0], self.o_groups, -1).transpose(0, 1)  # [G, T, H * D / G]
        weight = self.wo_a.dense_weight(out.dtype)
        weight = weight.view(self.o_groups, -1, weight.shape[-1]).transpose(1, 2)  # [G, H * D / G, R]
        return torch.bmm(groups, weight).transpose(0, 1).flatten(1)
