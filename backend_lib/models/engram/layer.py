"""One Engram module (DeepSeek's conditional memory) on a decoder layer: what it adds to the residual streams.

The math and the module names are DeepSeek's reference (``deepseek-ai/Engram``, ``engram_demo_v1.py``; checkpoint
tensors ``layers.{i}.engram.<name>``):
- the hashed rows of every head (``multi_head_embedding.embedding.weight``, one table, per-head offsets) are
  concatenated into ``e`` [T, (max_ngram - 1) * n_embed_per_ngram];
- per residual stream s: ``gate_s = sigmoid(signed_sqrt(<norm1_s(key_proj_s(e)), norm2_s(h_s)> / sqrt(hidden)))``
  (``signed_sqrt(g) = sign(g) sqrt(max(|g|, 1e-6))``), ``v_s = gate_s * value_proj(e)``;
- ``ShortConv``: per-stream RMSNorm (eps 1e-5) of ``v``, a depthwise causal Conv1d over positions (``kernel_size``
  taps, dilation ``max_ngram_size``, no bias), SiLU; the module returns ``v + conv(v)``, which the layer adds to its
  streams before attention.
The reference's ``norm1`` / ``norm2`` are ``nn.RMSNorm`` without an eps, i.e. the activation dtype's machine epsilon;
so are ours.

Serving state: the conv reads ``conv_lookback`` past positions of the normed values; they live in a ring of the
hybrid cache's state slots (``kernels/state_ring.py``), so a decode step convolves one token and chunked prefill,
preemption (recompute), sessions and rolled-back drafts behave as V4's other rings. The n-gram context comes from the
request's own token history (``AttentionMetadata.token_history``, built by the runner from the host's ids), so the
hash needs no state at all.

Tensor parallelism: each rank holds ``ceil(rows / world)`` consecutive rows of the table (the last rank fewer),
looks up the hashed rows it holds and zeros elsewhere; one all-reduce of the gathered [T, width] rows adds the parts.
The projections are replicated (they are small next to the table).
"""
from __future__ import annotations

import math
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kernels.attention_metadata import StateRows
from kernels.quant import dequantize_block_fp8
from kernels.state_ring import recent_rows, write_recent

from backend_lib.models.engram.config import EngramConfig
from backend_lib.models.engram.ngram_hash import (
    EngramVocabulary, NgramHasher, compressed_vocabulary, head_table_sizes,
)
from backend_lib.models.parallel import ParallelContext, Shard

FP8_ROW_BLOCK = (1, 128)  # an fp8 table's scale blocks: one row, 128 columns
_CONV_NORM_EPS = 1e-5
_GATE_FLOOR = 1e-6


def _linear(in_features: int, out_features: int) -> nn.Linear:
    layer = nn.Linear(in_features, out_features)
    layer.requires_grad_(False)
    return layer


class _Norm(nn.Module):
    """An RMSNorm's weight and eps under the reference's name (EngramLayer applies the streams' norms batched)."""

    def __init__(self, width: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(width), requires_grad=False)


class _ShardedTable(nn.Module):
    """This rank's rows ``[start, start + rows)`` of the flat multi-head table (``embedding.weight``)."""

    def __init__(self, total_rows: int, width: int, par: ParallelContext) -> None:
        super().__init__()
        per_rank = -(-total_rows // par.world_size)
        self.start = min(par.rank * per_rank, total_rows)
        rows = min(per_rank, total_rows - self.start)
        self.total_rows, self.par = total_rows, par
        self.embedding = nn.Module()
        self.embedding.weight = nn.Parameter(torch.zeros(rows, width), requires_grad=False)
        self.embedding.register_buffer("scale", None)  # fp8 tables: ue8m0 factors [rows, ceil(width / 128)]
        self.shards = {"embedding.weight": Shard(0, self.start, rows)}

    def set_fp8(self, weight: torch.Tensor,  # [rows, width] float8_e4m3fn: this rank's rows
                scale: torch.Tensor,  # [rows, ceil(width / 128)] powers of two (ue8m0)
                dtype: torch.dtype) -> None:
        """Keep an fp8 table as stored (1 byte a value); gathered rows are dequantized."""
        if tuple(weight.shape) != tuple(self.embedding.weight.shape) or scale.shape != (
                weight.shape[0], -(-weight.shape[1] // FP8_ROW_BLOCK[1])):
            raise ValueError(f"fp8 Engram table {tuple(weight.shape)} with scales {tuple(scale.shape)}: expected "
                             f"{tuple(self.embedding.weight.shape)} with one scale per row and "
                             f"{FP8_ROW_BLOCK[1]} columns")
        self.embedding.weight = nn.Parameter(weight, requires_grad=False)
        self.embedding.scale = scale.float()
        self.dtype = dtype

    def _lookup(self, rows: torch.Tensor) -> torch.Tensor:  # [T, heads] local rows -> [T, heads, width]
        weight, scale = self.embedding.weight, self.embedding.scale
        if scale is None:
            return F.embedding(rows, weight)
        flat = rows.flatten()
        values = dequantize_block_fp8(weight[flat], scale[flat], FP8_ROW_BLOCK, self.dtype)
        return values.view(*rows.shape, -1)

    def gather(self, rows: torch.Tensor,  # [T, heads] int64 global rows
               ) -> torch.Tensor:  # [T, heads * width]
        if self.par.world_size == 1:
            return self._lookup(rows).flatten(1)
        local = rows - self.start
        inside = (local >= 0) & (local < self.embedding.weight.shape[0])
        part = self._lookup(torch.where(inside, local, torch.zeros_like(local)))
        return self.par.all_reduce((part * inside[..., None].to(part.dtype)).flatten(1))


class _ShortConv(nn.Module):
    def __init__(self, hidden: int, streams: int, kernel_size: int, dilation: int) -> None:
        super().__init__()
        self.kernel_size, self.dilation = kernel_size, dilation
        self.conv = nn.Module()
        self.conv.weight = nn.Parameter(torch.zeros(streams * hidden, 1, kernel_size), requires_grad=False)
        self.norms = nn.ModuleList(_Norm(hidden, _CONV_NORM_EPS) for _ in range(streams))

    def forward(self, window: torch.Tensor,  # [T, lookback + 1, hc * hidden] normed values, oldest first
                ) -> torch.Tensor:  # [T, hc * hidden]
        taps = window[:, ::self.dilation]  # [T, kernel_size, C]: tap k reads position t - (K - 1 - k) * dilation
        weight = self.conv.weight[:, 0, :].t().to(taps.dtype)  # [K, C]
        return F.silu((taps * weight).sum(1))


class EngramLayer(nn.Module):
    def __init__(self, config: EngramConfig, hasher: NgramHasher, hidden: int, streams: int,
                 dtype: torch.dtype, par: ParallelContext) -> None:
        super().__init__()
        self.config, self.hasher, self.hidden, self.streams = config, hasher, hidden, streams
        self.multi_head_embedding = _ShardedTable(hasher.num_rows, config.head_dim, par)
        width = config.embed_width
        self.value_proj = _linear(width, hidden)
        self.key_projs = nn.ModuleList(_linear(width, hidden) for _ in range(streams))
        machine_eps = torch.finfo(dtype).eps  # the reference's nn.RMSNorm(hidden) without an eps
        self.norm1 = nn.ModuleList(_Norm(hidden, machine_eps) for _ in range(streams))
        self.norm2 = nn.ModuleList(_Norm(hidden, machine_eps) for _ in range(streams))
        self.short_conv = _ShortConv(hidden, streams, config.kernel_size, config.max_ngram_size)
        self._fused: tuple[torch.Tensor, ...] | None = None  # fuse()'s stacked weights

    def gather(self, context: torch.Tensor,  # [T, max_ngram] int64 token ids, oldest first, -1 before the start
               ) -> torch.Tensor:  # [T, width]: the hashed rows of every head (host work: int64, a table lookup)
        return self.multi_head_embedding.gather(self.hasher(context))

    def fuse(self) -> None:
        """One GEMM for value_proj and every key_proj, and each norm's per-stream weights stacked, so a step runs a
        few batched ops instead of ~4 per stream (the loader calls it once the weights are in)."""
        projections = [self.value_proj, *self.key_projs]
        self._fused = (torch.cat([p.weight for p in projections]), torch.cat([p.bias for p in projections]),
                       torch.stack([n.weight for n in self.norm1]), torch.stack([n.weight for n in self.norm2]),
                       torch.stack([n.weight for n in self.short_conv.norms]))

    def forward(self, streams: torch.Tensor,  # [T, hc, hidden]
                embedded: torch.Tensor,  # [T, width] ``gather``'s rows
                positions: torch.Tensor,  # [T] int64
                rows: StateRows, ring: torch.Tensor,  # ring [S + 1, lookback + drafts, hc * hidden]
                longest_chunk: int | None = None) -> torch.Tensor:  # [T, hc, hidden]: what to add to the streams
        if self._fused is None:
            self.fuse()
        weight, bias, norm1, norm2, conv_norm = self._fused
        hidden, eps = self.hidden, self.norm1[0].eps
        projected = F.linear(embedded.to(streams.dtype), weight, bias).view(-1, self.streams + 1, hidden)
        keys = F.rms_norm(projected[:, 1:], (hidden,), None, eps) * norm1  # [T, hc, hidden]
        queries = F.rms_norm(streams, (hidden,), None, eps) * norm2
        dot = (keys * queries).sum(-1) / math.sqrt(hidden)  # [T, hc]
        gates = torch.sigmoid(dot.abs().clamp_min(_GATE_FLOOR).sqrt() * dot.sign())
        values = gates[..., None] * projected[:, :1]  # [T, hc, hidden]
        normed = (F.rms_norm(values, (hidden,), None, _CONV_NORM_EPS) * conv_norm).flatten(1)  # [T, hc * hidden]
        window, exists = recent_rows(ring, normed, rows, positions, self.config.conv_lookback + 1,
                                     longest_chunk=longest_chunk)
        window = window * exists[..., None].to(window.dtype)  # the conv's zero padding before position 0
        write_recent(ring, normed, rows, positions)
        return values + self.short_conv(window).view_as(values)


class EngramPrefetch:
    """Runs a step's Engram gather (hash + table lookup) beside the layers before the first Engram layer.

    The rows depend only on the token ids, so they can be fetched while the first layers compute. A side thread
    does it (torch ops release the GIL); only at one rank, because a gather's all-reduce from a side thread could
    interleave with the main thread's collectives."""

    def __init__(self, overlap: bool) -> None:
        self.overlap = overlap
        self._pool: ThreadPoolExecutor | None = None

    def start(self, gather: Callable[[], torch.Tensor]) -> "Future[torch.Tensor]":
        if not self.overlap:
            done: Future[torch.Tensor] = Future()
            done.set_result(gather())
            return done
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engram-gather")
        return self._pool.submit(gather)


def engram_vocabulary_of(checkpoint_dir: str) -> Any:  # np.ndarray [vocab] int64
    """The compressed vocabulary of the checkpoint's own ``tokenizer.json`` (the hash is defined on it)."""
    path = Path(checkpoint_dir) / "tokenizer.json"
    if not checkpoint_dir or not path.is_file():
        raise ValueError(f"a checkpoint with Engram layers needs its tokenizer.json (the n-gram hash runs on its "
                         f"compressed vocabulary); none at {str(path)!r}")
    return compressed_vocabulary(path)


def attach_engram_layers(layers: nn.ModuleList, config: EngramConfig | None, lookup: Any, hidden: int,
                         streams: int, dtype: torch.dtype, par: ParallelContext) -> int:
    """Give ``layers[i].engram`` an EngramLayer for each of ``config.layer_ids``; returns the token history the
    runner must send (0 without Engram)."""
    if config is None:
        return 0
    if lookup is None:
        raise ValueError("a model with Engram layers needs the compressed vocabulary of its tokenizer")
    vocab = EngramVocabulary.build(lookup, config)
    sizes = head_table_sizes(config)
    for layer_id in config.layer_ids:
        hasher = NgramHasher(config, vocab, layer_id, sizes[layer_id])
        layers[layer_id].engram = EngramLayer(config, hasher, hidden, streams, dtype, par)
    return config.history


def engram_ring_shape(config: EngramConfig, num_state_slots: int, max_drafts: int,
                      width: int) -> tuple[int, int, int, int]:
    """The ShortConv history of every Engram layer in the hybrid cache's state slots: [L_e, S, lookback + drafts,
    streams * hidden] (at least one entry: a one-tap conv reads only its own token)."""
    return (len(config.layer_ids), num_state_slots, max(1, config.conv_lookback + max_drafts), width)


def engram_gather(layers: nn.ModuleList, config: EngramConfig,
                  input_ids: torch.Tensor,  # [T] int64
                  token_history: torch.Tensor | None,  # [T, H] int64 (meta.token_history)
                  ) -> torch.Tensor:  # [L_e, T, width]
    """Every Engram layer's hashed table rows for a step's tokens: host work (exact int64 hash, a lookup in the
    host table, one all-reduce under tensor parallelism), outside any compiled region."""
    if token_history is None:
        raise ValueError("Engram layers need meta.token_history (the ids before each token), which the model "
                         "runner sends when model.token_history > 0")
    context = torch.cat([token_history, input_ids[:, None]], dim=1)
    return torch.stack([layers[i].engram.gather(context) for i in config.layer_ids])
