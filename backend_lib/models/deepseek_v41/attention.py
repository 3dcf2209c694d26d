"""DeepSeek-V4.1 CSA2 attention over the hybrid cache.

Every layer: shared-KV MQA (one K = V latent) with q LoRA, interleaved RoPE on the trailing channels (undone on the
output), per-head sinks, a sliding window of ``sliding_window`` positions read from the layer's ring, and the grouped
low-rank output projection. Unlike V4, q is not normalised after ``wq_b``. A compressed layer (ratio 1 or 2) also
attends compressed entries, by role (``config.LayerRole``):

- **FULL** (a KV source) owns the compressor: each token that closes a group (every token at ratio 1, every second
  at ratio 2) pools the group's projections (ratio 2: fp32 ``wkv`` / ``wgate`` of its two tokens from the layer's
  compressor ring, channel-wise softmax) into a pre-RoPE latent; the entry is the latent rotated at the group's
  first position, the index key ``k_norm(wk(latent))`` rotated there, both stored in the paged tensors of the
  source. Then it scores like a Reindex layer;
- **REINDEX** scores the source's index keys with its own ``wq_b`` / ``weights_proj``; the candidate source cuts the
  candidate pool (``kernels/csa2.py``) from its scores, and later index sources score only inside it; the top
  ``index_topk`` (ties in entry order) are published for the step's group;
- **REUSE** attends the latest source's entries with the latest index source's picks unchanged.

A step's picks and pool live in ``V41Step`` (per query group: decode rows, or one prefill chunk), so the layers of a
step pass them on the way transformers' per-forward ``shared`` dict does, except that each source's entries are its
own (the oracle's mend: nothing appends to the previous source's). Quantization-aware activations (``qat``) follow
the reference: window KV fp8 / 32, entries fp4 / 16 (e4m3 scales), index q and keys fp4 / 32.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from backend_lib.models.deepseek_v3.layers import BlockLinear, RMSNorm
from backend_lib.models.deepseek_v41.config import FULL, REUSE, LayerRole
from backend_lib.models.parallel import ParallelContext, Shard
from backend_lib.models.deepseek_v4.attention import (
    LayerCache, StepContext, V4Rope, entry_rows_visible, ring_write_index,
)
from kernels.compressed_attention import (
    ChunkPages, TokenPages, entry_write_rows, gather_rows, held_entries, indexer_scores, pool_window, sink_attention,
)
from kernels.context_attention import merge_partials, partial_sink_attention
from kernels.csa2 import candidate_pool, fake_quant_fp4, fake_quant_fp8, select_in_order
from kernels.csa2_records import Fp4Record
from kernels.interleaved_rope import apply_tail_rope
from kernels.state_ring import chunk_recent_rows, recent_rows, write_recent
from kernels.v4_fp8 import entry_values, store_entries


@dataclass(frozen=True)
class V41Dims:
    hidden: int
    num_heads: int
    head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    sliding_window: int
    eps: float
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    candidate_topk_blocks: int
    candidate_block_size: int
    block_size: tuple[int, int]  # fp8 weight blocks


@dataclass(frozen=True)
class V41Step:
    """A step's shared context (V4's: pages, state rows, rotaries, query groups) plus what CSA2 layers pass on."""

    ctx: StepContext
    qat: bool
    picks: dict[int, torch.Tensor] = field(default_factory=dict)  # group's first row -> [L, E] bool, latest top-k
    pool: dict[int, torch.Tensor] = field(default_factory=dict)  # group's first row -> [L, E] bool candidate pool


class V41Compressor(nn.Module):
    """A KV source's compressor (``attn.compressor.{wkv, wgate, norm}``; no ``wgate`` at ratio 1)."""

    def __init__(self, d: V41Dims, ratio: int) -> None:
        super().__init__()
        self.ratio = ratio
        self.wkv = BlockLinear(d.hidden, d.head_dim, block_size=d.block_size)
        self.wgate = BlockLinear(d.hidden, d.head_dim, block_size=d.block_size) if ratio > 1 else None
        self.norm = RMSNorm(d.head_dim, d.eps)

    def forward(self, x: torch.Tensor,  # [T, hidden] the attention's normed input
                ctx: StepContext,
                state: torch.Tensor | None,  # ring [S + 1, ratio + drafts, 2D] of fp32 [kv | gate] (ratio 2)
                ) -> tuple[torch.Tensor, torch.Tensor]:  # latents [N, D] pre-RoPE, the closing rows [N] int64
        positions = ctx.pages.positions
        if self.wgate is None:  # ratio 1: every token is its own group, no pooling
            return self.norm(self.wkv(x)), torch.arange(x.shape[0], device=x.device)
        # the reference pools in fp32 whatever the model dtype
        projections = torch.cat([self.wkv(x).float(), self.wgate(x).float()], dim=-1)
        closing = torch.nonzero((positions + 1) % self.ratio == 0).flatten()
        dim = projections.shape[-1] // 2
        pooled = projections.new_zeros(0, dim)
        if closing.numel():  # a decode step between group ends closes none (eager: a host sync, as V4's)
            window, _ = recent_rows(state, projections.to(state.dtype), ctx.rows, positions, self.ratio,
                                    longest_chunk=ctx.longest_chunk, tokens=closing)
            pooled = pool_window(window[..., :dim].float(), window[..., dim:].float())
        # after the read: the ring keeps each chunk's last positions for the groups still open
        write_recent(state, projections, ctx.rows, positions, ring_write_index(ctx, state))
        return self.norm(pooled.to(x.dtype)), closing


class V41Indexer(nn.Module):
    """``attn.indexer.{wq_b, weights_proj}`` on index sources, plus ``{wk, k_norm}`` on KV sources."""

    def __init__(self, d: V41Dims, owns_keys: bool) -> None:
        super().__init__()
        self.d = d
        self.wq_b = BlockLinear(d.q_lora_rank, d.index_n_heads * d.index_head_dim, block_size=d.block_size)
        self.weights_proj = BlockLinear(d.hidden, d.index_n_heads, block_size=d.block_size)
        self.wk = BlockLinear(d.head_dim, d.index_head_dim, block_size=d.block_size) if owns_keys else None
        self.k_norm = RMSNorm(d.index_head_dim, d.eps) if owns_keys else None

    def queries(self, x: torch.Tensor,  # [T, hidden]
                q_residual: torch.Tensor,  # [T, q_lora_rank]
                step: V41Step) -> tuple[torch.Tensor, torch.Tensor]:  # [T, Hi, Di], [T, Hi]
        d = self.d
        q = apply_tail_rope(self.wq_b(q_residual).view(-1, d.index_n_heads, d.index_head_dim), *step.ctx.compress_rope)
        if step.qat:
            q = fake_quant_fp4(q, 32)
        return q, self.weights_proj(x).float() * d.index_n_heads ** -0.5


class V41Attention(nn.Module):
    def __init__(self, d: V41Dims, role: LayerRole, main_rope: V4Rope, compress_rope: V4Rope,
                 par: ParallelContext = ParallelContext()) -> None:
        super().__init__()
        if d.num_heads % d.o_groups:
            raise ValueError(f"o_groups ({d.o_groups}) must divide num_attention_heads ({d.num_heads})")
        self.d, self.role, self.scale, self.par = d, role, d.head_dim ** -0.5, par
        self.compress_rope = compress_rope
        # tensor parallelism as V4's: query heads and output groups split, one all-reduce after wo_b; the K = V
        # latent, the compressor and the indexer are small and whole on every rank (so the picks are the same)
        head_start, self.num_heads = par.even(d.num_heads, "num_attention_heads")
        group_start, self.o_groups = par.even(d.o_groups, "o_groups")
        rank = d.o_lora_rank
        self.wq_a = BlockLinear(d.hidden, d.q_lora_rank, block_size=d.block_size)
        self.q_norm = RMSNorm(d.q_lora_rank, d.eps)
        self.wq_b = BlockLinear(d.q_lora_rank, self.num_heads * d.head_dim, block_size=d.block_size)
        self.wkv = BlockLinear(d.hidden, d.head_dim, block_size=d.block_size)
        self.kv_norm = RMSNorm(d.head_dim, d.eps)
        self.wo_a = BlockLinear(d.num_heads * d.head_dim // d.o_groups, self.o_groups * rank, block_size=d.block_size)
        self.wo_b = BlockLinear(self.o_groups * rank, d.hidden, block_size=d.block_size)
        self.attn_sink = nn.Parameter(torch.zeros(self.num_heads), requires_grad=False)
        self.shards = {  # checkpoint tensor -> this rank's part (tensors not listed are whole on every rank)
            "wq_b.weight": Shard(0, head_start * d.head_dim, self.num_heads * d.head_dim),
            "attn_sink": Shard(0, head_start, self.num_heads),
            "wo_a.weight": Shard(0, group_start * rank, self.o_groups * rank),
            "wo_b.weight": Shard(1, group_start * rank, self.o_groups * rank),
        }
        self.compressor = V41Compressor(d, role.ratio) if role.mode == FULL else None
        self.indexer = V41Indexer(d, role.mode == FULL) if role.scores else None
        # kv_cache_dtype=fp8_e4m3 (the model's use_fp8_kv): the paged entries and index keys are fp4 records
        # (kernels/csa2_records.py), None: values in the cache's dtype
        self.records: tuple[Fp4Record, Fp4Record] | None = None

    def forward(self, x: torch.Tensor,  # [T, hidden] normed block input
                step: V41Step, cache: LayerCache) -> torch.Tensor:  # [T, hidden]
        d, ctx, role = self.d, step.ctx, self.role
        cos, sin = ctx.compress_rope if role.ratio else ctx.main_rope
        q_residual = self.q_norm(self.wq_a(x))
        q = apply_tail_rope(self.wq_b(q_residual).view(-1, self.num_heads, d.head_dim), cos, sin)
        kv = apply_tail_rope(self.kv_norm(self.wkv(x)), cos, sin)
        if step.qat:
            kv = fake_quant_fp8(kv, 32)
        if self.compressor is not None:
            self._compress(x, step, cache)
        index_q = self.indexer.queries(x, q_residual, step) if self.indexer is not None else None
        parts = [self._attend(q[start:end], index_q, kv, step, start, end, pages, cache)
                 for start, end, pages in ctx.groups]
        write_recent(cache.window, kv, ctx.rows, ctx.pages.positions, ring_write_index(ctx, cache.window))
        return self.project_output(torch.cat(parts) if len(parts) > 1 else parts[0], cos, sin)

    def project_output(self, out: torch.Tensor,  # [T, H, D] attended values (post-RoPE)
                       cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:  # [T, hidden]
        """RoPE undone, then the grouped ``wo_a`` and ``wo_b`` (also the DSpark drafter's, models/dspark/)."""
        out = apply_tail_rope(out, cos, -sin)
        groups = out.reshape(out.shape[0], self.o_groups, -1).transpose(0, 1)  # [G, T, H * D / G]
        weight = self.wo_a.dense_weight(out.dtype)
        weight = weight.view(self.o_groups, -1, weight.shape[-1]).transpose(1, 2)  # block-diagonal [G, H D / G, R]
        return self.par.all_reduce(self.wo_b(torch.bmm(groups, weight).transpose(0, 1).flatten(1)))

    def _compress(self, x: torch.Tensor, step: V41Step, cache: LayerCache) -> None:
        """Store the entries and index keys of the groups this step's tokens close."""
        ctx, ratio = step.ctx, self.role.ratio
        latent, rows = self.compressor(x, ctx, cache.state)
        if rows.numel() == 0:
            return
        positions = ctx.pages.positions[rows]
        cos, sin = self.compress_rope.at(positions - ratio + 1, latent.dtype)  # the group's first position
        entries = apply_tail_rope(latent, cos, sin)
        keys = apply_tail_rope(self.indexer.k_norm(self.indexer.wk(latent)), cos, sin)
        if step.qat:
            entries, keys = fake_quant_fp4(entries, 16, e4m3_scales=True), fake_quant_fp4(keys, 32)
        where = entry_write_rows(ctx.slot_mapping[rows], positions, ratio, ctx.pages.block_size,
                                 cache.entries.shape[0])
        entry_rec, key_rec = self.records or (None, None)
        store_entries(cache.entries, where, entries, entry_rec)
        store_entries(cache.index_entries, where, keys, key_rec)

    def _gather(self, paged: torch.Tensor,  # [E, C] the source's entries or keys (fp8 cache: records)
                slots: torch.Tensor,  # [L or 1, E] rows
                which: int,  # 0 entries, 1 index keys
                dtype: torch.dtype) -> torch.Tensor:  # [L or 1, E, dim]
        rows = gather_rows(paged, slots)
        return rows if self.records is None else entry_values(rows, self.records[which], dtype)

    def _window(self, kv: torch.Tensor, ctx: StepContext, start: int, end: int, pages: TokenPages | ChunkPages,
                ring: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # keys [L or 1, K, D], allowed [L, K]
        w = self.d.sliding_window
        if isinstance(pages, ChunkPages):
            _, allowed = pages.recent(w)
            return chunk_recent_rows(ring, kv, ctx.rows, start, pages.first, pages.length, w - 1), allowed
        return recent_rows(ring, kv, ctx.rows, ctx.pages.positions, w, start, end - start,
                           longest_chunk=ctx.decode_query_len)

    def _attend(self, q: torch.Tensor,  # [L, H, D] one group's queries
                index_q: tuple[torch.Tensor, torch.Tensor] | None,  # the step's index queries and weights
                kv: torch.Tensor, step: V41Step, start: int, end: int, pages: TokenPages | ChunkPages,
                cache: LayerCache) -> torch.Tensor:  # [L, H, D]
        """Window plus the picked entries. Context parallelism (``ctx.context``): each rank holds some blocks'
        entries; picks are made over every rank's scores (so each rank keeps its share of the one-rank picks), rank
        0 adds the window (every rank's rings hold it) and the sinks, and the parts merge by log-sum-exp. Window
        layers need no split: every rank has every row and ring."""
        ctx, ratio = step.ctx, self.role.ratio
        share = ctx.context if ratio else None
        keys, allowed = self._window(kv, ctx, start, end, pages, cache.window)
        if not ratio:
            return sink_attention(q, keys.to(q.dtype), allowed, self.attn_sink, self.scale)
        entry_slots, visible = ctx.shared(("entries", start, ratio), lambda: entry_rows_visible(pages, ratio))
        held = None if share is None else ctx.shared(
            ("held", start, ratio), lambda: held_entries(pages, ratio, share.scratch_block))  # [L or 1, E]
        picked = self._pick(index_q, step, start, end, cache, entry_slots, visible, held)
        entries = ctx.shared(("entry_keys", self.role.kv_source, start),
                             lambda: self._gather(cache.entries, entry_slots, 0, q.dtype)).to(keys.dtype)
        if share is None:
            keys = torch.cat([keys, entries.expand(keys.shape[0], -1, -1)
                              if entries.shape[0] != keys.shape[0] else entries], dim=1)
            return sink_attention(q, keys.to(q.dtype), torch.cat([allowed, picked], dim=1), self.attn_sink,
                                  self.scale)
        picked = picked & held
        if share.rank == 0:
            entries = torch.cat([keys, entries.expand(keys.shape[0], -1, -1)
                                 if entries.shape[0] != keys.shape[0] else entries], dim=1)
            picked = torch.cat([allowed, picked], dim=1)
        out, lse = partial_sink_attention(q, entries.to(q.dtype), picked,
                                          self.attn_sink if share.rank == 0 else None, self.scale)
        parts = self.par.context.all_gather(torch.cat([out.flatten(1), lse], dim=1))  # [R, L, H * D + H]
        heads, dim = out.shape[1:]
        return merge_partials(parts[..., :heads * dim].unflatten(-1, (heads, dim)),
                              parts[..., heads * dim:]).to(q.dtype)

    def _pick(self, index_q: tuple[torch.Tensor, torch.Tensor] | None, step: V41Step, start: int, end: int,
              cache: LayerCache, entry_slots: torch.Tensor,  # [L or 1, E]
              visible: torch.Tensor,  # [L, E] bool
              held: torch.Tensor | None,  # [L or 1, E] bool: context parallelism, the entries this rank holds
              ) -> torch.Tensor:  # [L, E] bool: the entries this group's queries attend (over every rank)
        role, d = self.role, self.d
        if role.mode == REUSE:
            return step.picks[start]
        if visible.shape[1] == 0:
            picked = visible
        else:
            q, head_weights = index_q[0][start:end], index_q[1][start:end]
            keys = self._gather(cache.index_entries, entry_slots, 1, q.dtype).to(q.dtype)
            scores = indexer_scores(q, keys, head_weights, visible if held is None else visible & held)
            if held is not None:  # each entry is scored on the one rank that holds it (-inf elsewhere)
                scores = self.par.context.all_gather(scores).max(dim=0).values
            if role.candidate_source:
                counts = (step.ctx.pages.positions[start:end] + 1) // role.ratio
                step.pool[start] = candidate_pool(scores, counts, d.candidate_topk_blocks, d.candidate_block_size)
            elif role.uses_candidates and start in step.pool:
                scores = scores.masked_fill(~step.pool[start], float("-inf"))
            picked = select_in_order(scores, d.index_topk)
        step.picks[start] = picked
        return picked
