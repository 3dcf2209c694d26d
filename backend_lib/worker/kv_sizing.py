"""How many KV cache blocks to allocate, from the memory actually free after the weights are loaded (with their
host layouts: packed and blocked copies, screened heads; backend_lib/worker/executor/rank.py builds those first).

``plan_kv_cache`` is a pure function (config, bytes per block, free bytes -> a plan or a ValueError naming the
numbers), so every rule is unit-tested without a model; ``kv_cache_num_blocks`` is the engine's one call, which
measures the free memory and logs the plan.

Rules, first match wins:
- ``num_blocks`` > 0: exactly that many.
- ``kv_cache_memory_gb`` > 0: that many GiB.
- otherwise (auto): ``kv_cache_memory_fraction`` of the free memory, capped at what the running requests can use
  (``max_num_seqs`` x ``max_model_len``: more blocks than that only feed the prefix cache, and every block is
  zero-filled, i.e. committed, at start), and at least a floor that still serves one full-length request.
Whatever the rule, a cache that does not fit in the free memory fails the load with needed vs available: the
allocation would otherwise succeed and the OOM killer would end the server later, mid-request.

A hybrid-cache model (``backend_lib/core/hybrid_kv.py``) also has fixed state slots (``fixed_bytes``): they come off the
memory first (and off the fraction's budget in the auto rule), the blocks get the rest.
"""
from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass

import torch

from backend_lib.core.config import CacheConfig, EngineConfig
from backend_lib.models.interfaces import keeps_hybrid_state

logger = logging.getLogger(__name__)

# The auto size never goes below this many blocks (nor below one full-length request's blocks): fewer make
# every request wait for blocks or be preempted.
MIN_AUTO_BLOCKS = 16
_GIB = 2**30


@dataclass(frozen=True)
class KVCachePlan:
    num_blocks: int
    bytes_per_block: int
    available_bytes: int | None  # free memory measured after the weights were loaded; None = unknown device
    rule: str  # which setting decided, for the log
    fixed_bytes: int = 0  # a hybrid model's state slots, allocated next to the blocks
    kv_dtype: str = ""  # the KV element type (kv_cache_dtype, or the model dtype for "auto"), for the log

    @property
    def total_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block

    def describe(self) -> str:
        free = "unknown" if self.available_bytes is None else f"{self.available_bytes / _GIB:.2f} GiB"
        fixed = f" + {self.fixed_bytes / _GIB:.2f} GiB of state slots" if self.fixed_bytes else ""
        dtype = f" of {self.kv_dtype}" if self.kv_dtype else ""
        return (f"KV cache{dtype}: {self.num_blocks} blocks x {self.bytes_per_block} B = "
                f"{self.total_bytes / _GIB:.2f} GiB"
                f"{fixed} ({self.rule}; free memory after loading the weights: {free})")


def is_hybrid(model: torch.nn.Module) -> bool:
    """Whether the model keeps fixed per-request state next to its paged blocks (backend_lib/core/hybrid_kv.py)."""
    return keeps_hybrid_state(model)


def kv_bytes_per_block(model: torch.nn.Module, block_size: int, dtype: torch.dtype, drafts: int = 0) -> int:
    """Bytes of one paged KV block (``dtype``: the paged cache's element type)."""
    size = torch.empty((), dtype=dtype).element_size()
    if is_hybrid(model):
        paged, _ = model.hybrid_cache_shapes(1, block_size, 0, drafts)
        return sum(math.prod(shape) for shape in paged) * size
    per_slot = sum(math.prod(shape) for shape in model.kv_cache_shapes(1))
    return per_slot * block_size * size


def state_bytes_per_slot(model: torch.nn.Module, block_size: int, dtype: torch.dtype, drafts: int = 0) -> int:
    """Bytes of one fixed state slot (0 for models without one)."""
    if not is_hybrid(model):
        return 0
    _, state = model.hybrid_cache_shapes(0, block_size, 1, drafts)
    return sum(math.prod(shape) for shape in state) * torch.empty((), dtype=dtype).element_size()


def _blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


def plan_kv_cache(cache: CacheConfig, bytes_per_block: int, available_bytes: int | None,
                  max_model_len: int, max_num_seqs: int, fixed_bytes: int = 0,
                  fixed_what: str = "state slots") -> KVCachePlan:
    """The KV cache size for ``cache``; ValueError (naming needed vs available) when it cannot fit. ``fixed_bytes``
    (``fixed_what`` names them in errors) are allocated besides the blocks."""
    if bytes_per_block <= 0:
        raise ValueError(f"bytes_per_block must be > 0, got {bytes_per_block}")
    plan = _plan_blocks(cache, bytes_per_block, available_bytes, max_model_len, max_num_seqs, fixed_bytes, fixed_what)
    plan = KVCachePlan(plan.num_blocks, bytes_per_block, available_bytes, plan.rule, fixed_bytes)
    if available_bytes is not None and plan.total_bytes + fixed_bytes > available_bytes:
        fixed = f" + {fixed_what} {fixed_bytes / _GIB:.3f} GiB" if fixed_bytes else ""
        raise ValueError(f"the KV cache does not fit: {plan.num_blocks} blocks x {bytes_per_block} B = "
                         f"{plan.total_bytes / _GIB:.3f} GiB{fixed} needed ({plan.rule}), but only "
                         f"{available_bytes / _GIB:.3f} GiB is free after loading the weights")
    return plan


def _plan_blocks(cache: CacheConfig, bytes_per_block: int, available_bytes: int | None, max_model_len: int,
                 max_num_seqs: int, fixed_bytes: int, fixed_what: str) -> KVCachePlan:
    one_request = _blocks_for(max_model_len, cache.block_size)
    if cache.num_blocks > 0:
        plan = KVCachePlan(cache.num_blocks, bytes_per_block, available_bytes, "num_blocks")
    elif cache.kv_cache_memory_gb > 0:
        blocks = int(cache.kv_cache_memory_gb * _GIB // bytes_per_block)
        if blocks < 1:
            raise ValueError(f"kv_cache_memory_gb={cache.kv_cache_memory_gb} holds no KV block "
                             f"({bytes_per_block} B each)")
        plan = KVCachePlan(blocks, bytes_per_block, available_bytes, f"kv_cache_memory_gb={cache.kv_cache_memory_gb}")
    else:
        if available_bytes is None:
            raise ValueError("cannot size the KV cache automatically: the free memory of this device is unknown; "
                             "set num_blocks or kv_cache_memory_gb")
        floor = max(MIN_AUTO_BLOCKS, one_request)
        budget = int(available_bytes * cache.kv_cache_memory_fraction) - fixed_bytes
        useful = max(floor, max_num_seqs * one_request)
        blocks = min(budget // bytes_per_block, useful)
        if blocks < floor:
            raise ValueError(
                f"the KV cache does not fit: at least {floor} blocks ({floor * bytes_per_block / _GIB:.3f} GiB: one "
                f"request of max_model_len={max_model_len}) are needed, but kv_cache_memory_fraction="
                f"{cache.kv_cache_memory_fraction} of the {available_bytes / _GIB:.3f} GiB free after loading the "
                f"weights is {budget / _GIB:.3f} GiB"
                + (f" after the {fixed_what} ({fixed_bytes / _GIB:.3f} GiB)" if fixed_bytes else "")
                + "; free memory, lower max_model_len or raise kv_cache_memory_fraction")
        rule = (f"kv_cache_memory_fraction={cache.kv_cache_memory_fraction}"
                + (f", capped at max_num_seqs x max_model_len = {useful} blocks" if blocks == useful else ""))
        plan = KVCachePlan(blocks, bytes_per_block, available_bytes, rule)
    return plan



def host_available_bytes(meminfo_path: str = "/proc/meminfo") -> int | None:
    """MemAvailable (what can be allocated without swapping), or None where /proc/meminfo has no such line."""
    try:
        with open(meminfo_path) as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # kB
    except OSError as exc:
        logger.warning("cannot read %s (%s): free host memory unknown", meminfo_path, exc)
    return None


def available_bytes(device: torch.device) -> int | None:
    """Free memory where the KV cache will live; None where we cannot tell (e.g. Neuron devices)."""
    if device.type == "cpu":
        return host_available_bytes()
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return None


def kv_cache_num_blocks(config: EngineConfig, bytes_per_block: int, device: torch.device, share: int = 1,
                        fixed_bytes: int = 0, fixed_what: str = "state slots", kv_dtype: str = "") -> int:
    """The engine's call, after the weights are on ``device``: measure, plan, log. ``share``: how many ranks size
    their caches from the same free memory (tensor-parallel ranks on one host; the driver's count is used by all,
    and assuming every rank on the driver's host is the safe side when they are spread over machines)."""
    free = available_bytes(device)
    plan = plan_kv_cache(config.cache, bytes_per_block, None if free is None else free // max(1, share),
                         config.model.max_model_len, config.scheduler.max_num_seqs, fixed_bytes, fixed_what)
    logger.info(dataclasses.replace(plan, kv_dtype=kv_dtype).describe())
    return plan.num_blocks
