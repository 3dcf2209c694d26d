"""Tensor and expert parallelism inside the model code: which part of a checkpoint tensor a rank holds, and the
collective that joins the ranks' partial results.

Every rank runs the same model code over its shard (Megatron's scheme, as vLLM lays it out):
- column-parallel projections keep a contiguous range of output rows (heads, intermediate units, vocabulary);
- row-parallel projections keep the matching input columns and produce partial sums that one all-reduce joins;
- the vocabulary-parallel embedding looks up only the ids in its range and all-reduces; the vocabulary-parallel head
  all-gathers the logits, so every rank holds the full row (the driver samples from it, the MTP proposer takes its
  argmax on every rank without another exchange).
With ``world_size == 1`` every collective is the identity and every shard is the whole tensor, so one code path
serves one rank and many.

Collectives are ``torch.distributed`` calls on the process group the executor built (gloo on the host, the
Neuron collectives backend on Trainium). Dynamo turns these in-place calls into functional collectives, so a
compiled region keeps them inside the graph in their static form (fixed shapes). Ranks that share one host
all-reduce through a shared-memory segment instead (an opaque custom op in graphs), as vLLM's CPU backend does.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Shard:
    """The part of a checkpoint tensor this rank holds: ``size`` entries from ``start`` along ``dim``."""

    dim: int
    start: int
    size: int

    def take(self, tensor: Any) -> torch.Tensor:
        """The slice from a torch tensor or a lazy checkpoint tensor (loader.LazyTensor reads only these bytes)."""
        return tensor.narrow(self.dim, self.start, self.size)


def read_shard(tensor: Any, shard: Shard | None) -> torch.Tensor:
    """This rank's part of a (possibly lazy) checkpoint tensor; ``None`` reads all of it."""
    if shard is not None:
        return shard.take(tensor)
    return tensor if isinstance(tensor, torch.Tensor) else tensor.load()


def even_range(total: int, world_size: int, rank: int, what: str) -> tuple[int, int]:
    """(start, size) of rank's equal share of ``total``; a total the ranks cannot split evenly is an error."""
    if total % world_size:
        raise ValueError(f"tensor_parallel_size={world_size} does not divide {what} ({total})")
    size = total // world_size
    return rank * size, size


def balanced_range(total: int, world_size: int, rank: int, what: str) -> tuple[int, int]:
    """(start, size) with shares differing by at most one (the first ranks take the extras); every rank needs one."""
    if world_size > total:
        raise ValueError(f"tensor_parallel_size={world_size} exceeds {what} ({total}): every rank needs at least one")
    base, extra = divmod(total, world_size)
    return rank * base + min(rank, extra), base + (1 if rank < extra else 0)


@dataclass(frozen=True)
class ContextGroup:
    """This rank's place among the context-parallel ranks: those holding the same tensor-parallel shard, each with
    its share of every request's KV blocks (worker/context_share.py decides which rows and blocks are its)."""

    rank: int = 0
    size: int = 1
    group: Any = None  # torch.distributed.ProcessGroup; None when size == 1

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"context-parallel rank must be in [0, {self.size}), got {self.rank}")
        if self.size > 1 and self.group is None:
            raise ValueError("a context-parallel group of size > 1 needs a process group")

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:  # [N, ...] per rank -> [size, N, ...] in rank order
        if self.size == 1:
            return x[None]
        out = x.new_empty((self.size * x.shape[0], *x.shape[1:]))  # gloo fills one tensor, rank parts end to end
        dist.all_gather_single(out, x.contiguous(), group=self.group)
        return out.view(self.size, *x.shape)

    def gather_rows(self, x: torch.Tensor,  # [row_counts[rank], ...] this rank's rows
                    row_counts: list[int] | None) -> torch.Tensor:  # [sum(row_counts), ...] every rank's, in order
        """A split step's rows from every context rank (None: the step is not split, every rank has them all)."""
        if row_counts is None:
            return x
        widest = max(row_counts)
        padded = torch.cat([x, x.new_zeros((widest - x.shape[0], *x.shape[1:]))]) if x.shape[0] < widest else x
        parts = self.all_gather(padded)
        return torch.cat([part[:count] for part, count in zip(parts, row_counts)])


@dataclass(frozen=True)
class ParallelContext:
    """This rank's place in the tensor-parallel group (the layers ask it for shards and collectives) and in the
    context-parallel group (``context``)."""

    rank: int = 0
    world_size: int = 1
    expert_parallel: bool = False  # MoE experts partitioned across ranks instead of each expert sharded
    group: Any = None  # torch.distributed.ProcessGroup; None when world_size == 1
    # Ranks on one host all-reduce through shared memory (kernels/csrc/shm_all_reduce.cpp): gloo's TCP round trips
    # cost ~0.5 ms a call there. None: the process group's all-reduce.
    shm_handle: int | None = None
    context: ContextGroup = ContextGroup()
    # EPLB (models/expert_slots.py): top-k MoE layers hold placement slots, with this many beyond the experts;
    # None: off (each rank holds a contiguous range of experts)
    eplb_redundant_experts: int | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), got {self.rank}")
        if self.eplb_redundant_experts is not None and not self.expert_parallel:
            raise ValueError("EPLB slots need expert parallelism (enable_expert_parallel)")
        if self.world_size > 1 and self.group is None:
            raise ValueError("a tensor-parallel context with world_size > 1 needs a process group")

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    def even(self, total: int, what: str) -> tuple[int, int]:
        return even_range(total, self.world_size, self.rank, what)

    def balanced(self, total: int, what: str) -> tuple[int, int]:
        return balanced_range(total, self.world_size, self.rank, what)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:  # [...] partial sums -> [...] the sum over ranks
        if self.world_size == 1:
            return x
        if self.shm_handle is not None and x.dtype in (torch.float32, torch.bfloat16):
            return torch.ops.deepinfer.shm_all_reduce(x, self.shm_handle)
        dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:  # [N, d] per rank -> [N, world_size * d]
        """Concatenate equal-width shards along the last dim (the vocabulary-parallel head)."""
        if self.world_size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)


def vocab_parallel_embedding(input_ids: torch.Tensor,  # [T] int64 (global ids)
                             weight: torch.Tensor,  # [V / world, hidden] this rank's rows
                             vocab_start: int, par: ParallelContext) -> torch.Tensor:  # [T, hidden]
    """Each rank embeds the ids in its range (zeros elsewhere); the all-reduce adds the one non-zero row."""
    return vocab_parallel_lookup(input_ids, lambda ids: torch.nn.functional.embedding(ids, weight), weight.shape[0],
                                 vocab_start, par)


def vocab_parallel_lookup(input_ids: torch.Tensor,  # [T] int64 (global ids)
                          lookup: Callable[[torch.Tensor], torch.Tensor],  # local ids [T] -> rows [T, hidden]
                          vocab_local: int, vocab_start: int,
                          par: ParallelContext) -> torch.Tensor:  # [T, hidden]
    """``vocab_parallel_embedding`` over any row lookup (a packed embedding's dequantizing one)."""
    if par.world_size == 1:
        return lookup(input_ids)
    local = input_ids - vocab_start
    inside = (local >= 0) & (local < vocab_local)
    rows = lookup(torch.where(inside, local, torch.zeros_like(local)))
    return par.all_reduce(rows * inside[:, None].to(rows.dtype))
