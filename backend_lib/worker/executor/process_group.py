"""Joining the tensor-parallel process group, and what every rank process does to its own threads and lifetime.

Rendezvous is torch.distributed's TCPStore (the store torchrun's workers use): the driver hosts it at
``master_addr:master_port``, publishes the engine configuration in it, and every rank, local or on another node,
joins the gloo group through it. Keys under ``deepinfer/`` carry the configuration and each rank's progress
(joined, failed with a message), so the driver can name a rank that never arrived or failed to load.
"""
from __future__ import annotations

import datetime
import json
import logging
import os
import shutil
import signal
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from backend_lib.core.config import EngineConfig, ParallelConfig
from backend_lib.core.processes import set_parent_death_signal
from backend_lib.models.parallel import ContextGroup, ParallelContext
from kernels.cpu_kernels import load_cpu_kernels

CONFIG_KEY = "deepinfer/config"
SHM_KEY = "deepinfer/shm_all_reduce"
_SHM_SLOT_BYTES = 4 << 20  # per rank and buffer set; larger tensors go in pieces
# Left free in /dev/shm beside the segment (Triton's Python backend stub keeps its regions there too).
_SHM_HEADROOM_BYTES = 16 << 20


def joined_key(rank: int) -> str:
    return f"deepinfer/joined/{rank}"


def error_key(rank: int) -> str:
    return f"deepinfer/error/{rank}"


@dataclass
class Rendezvous:
    store: Any  # torch.distributed.TCPStore
    master_addr: str
    master_port: int


def host_rendezvous(parallel: ParallelConfig, flat_config: dict[str, Any]) -> Rendezvous:
    """The driver's store (a free port when master_port is 0), holding the configuration for the workers."""
    store = dist.TCPStore(parallel.master_addr, parallel.master_port, parallel.world_size, True,
                          timeout=datetime.timedelta(seconds=parallel.distributed_timeout_s),
                          wait_for_workers=False)
    store.set(CONFIG_KEY, json.dumps(flat_config))
    return Rendezvous(store, parallel.master_addr, store.port)


def join_rendezvous(master_addr: str, master_port: int, timeout_s: float) -> tuple[Rendezvous, dict[str, Any]]:
    """A worker's client store and the engine configuration the driver published."""
    store = dist.TCPStore(master_addr, master_port, None, False, timeout=datetime.timedelta(seconds=timeout_s))
    return Rendezvous(store, master_addr, master_port), json.loads(store.get(CONFIG_KEY))


def init_group(rendezvous: Rendezvous, config: EngineConfig, rank: int) -> ParallelContext:
    """Join the gloo group (every rank calls it; it returns when all have), with the shared-memory all-reduce when
    every rank is on this host and all of them form the one tensor-parallel group. ``rank`` is global:
    ``cp * tensor_parallel_size + tp``."""
    parallel = config.parallel
    rendezvous.store.set(joined_key(rank), "1")
    dist.init_process_group("gloo", store=dist.PrefixStore("group", rendezvous.store), rank=rank,
                            world_size=parallel.world_size,
                            timeout=datetime.timedelta(seconds=parallel.distributed_timeout_s))
    tp_group, context = _subgroups(parallel, rank)
    shm_handle = None
    if parallel.nnodes == 1 and config.model.device == "cpu" and parallel.context_parallel_size == 1:
        # Every rank takes the same path: all use the segment only if all could build the kernel and find room.
        usable = load_cpu_kernels() and _shm_has_room(parallel.tensor_parallel_size, rank)
        usable = torch.tensor([int(usable)], dtype=torch.int64)
        dist.all_reduce(usable, op=dist.ReduceOp.MIN)
        if usable.item():
            shm_handle = _attach_shm_all_reduce(rendezvous, parallel, rank)
    tp = parallel.tensor_parallel_size
    eplb = config.eplb.num_redundant_experts if config.eplb.enable_eplb else None
    return ParallelContext(rank=rank % tp, world_size=tp, expert_parallel=parallel.enable_expert_parallel,
                           group=tp_group, shm_handle=shm_handle, context=context, eplb_redundant_experts=eplb)


def _subgroups(parallel: ParallelConfig, rank: int) -> tuple[Any, ContextGroup]:
    """This rank's tensor-parallel group (None alone) and context-parallel group. Every rank creates every group,
    in the same order, as torch.distributed requires."""
    tp, cp = parallel.tensor_parallel_size, parallel.context_parallel_size
    if cp == 1:
        return dist.group.WORLD, ContextGroup()
    # A subgroup's own timeout (its default is gloo's 30 minutes, not the world's): a hung peer fails a step in
    # distributed_timeout_s here too.
    timeout = datetime.timedelta(seconds=parallel.distributed_timeout_s)
    tp_groups = ([dist.new_group([c * tp + t for t in range(tp)], timeout=timeout) for c in range(cp)]
                 if tp > 1 else None)
    cp_groups = [dist.new_group([c * tp + t for c in range(cp)], timeout=timeout) for t in range(tp)]
    return (tp_groups[rank // tp] if tp_groups else None,
            ContextGroup(rank=rank // tp, size=cp, group=cp_groups[rank % tp]))


def shm_segment_bytes(tensor_parallel_size: int) -> int:
    """The all-reduce segment: a 64-byte flag line and two slot sets per rank (kernels/csrc/shm_all_reduce.cpp)."""
    return tensor_parallel_size * (64 + 2 * _SHM_SLOT_BYTES)


def _shm_has_room(tensor_parallel_size: int, rank: int, shm_dir: str = "/dev/shm") -> bool:
    """Whether /dev/shm can hold the segment. tmpfs takes an oversized segment without a word and kills the
    process touching a page past its size (SIGBUS), so a small /dev/shm (Docker's default is 64 MB) must be caught
    here: the ranks then all-reduce over gloo, slower, and rank 0 says how to give them room."""
    need = shm_segment_bytes(tensor_parallel_size) + _SHM_HEADROOM_BYTES
    try:
        free = shutil.disk_usage(shm_dir).free
    except OSError:  # no /dev/shm: every rank answers, so none waits on the others' all-reduce
        free = 0
    if free >= need:
        return True
    if rank == 0:
        logging.getLogger("deepinfer").warning(
            "tensor_parallel_size %d: the shared-memory all-reduce needs %d MiB of %s, only %d MiB free; all-reduce "
            "goes over gloo (slower). In Docker, run with --shm-size=1g (or --ipc=host).",
            tensor_parallel_size, need >> 20, shm_dir, free >> 20)
    return False


def _attach_shm_all_reduce(rendezvous: Rendezvous, parallel: ParallelConfig, rank: int) -> int:
    """Rank 0 creates the segment and names it in the store; once every rank has mapped it, the name is removed,
    so no /dev/shm entry survives the engine however it ends."""
    if rank == 0:
        name = f"/deepinfer_allreduce_{os.getpid()}_{rendezvous.master_port}"
        handle = torch.ops.deepinfer.shm_all_reduce_attach(name, 0, parallel.tensor_parallel_size, _SHM_SLOT_BYTES,
                                                           parallel.distributed_timeout_s, True)
        rendezvous.store.set(SHM_KEY, name)
    else:
        name = rendezvous.store.get(SHM_KEY).decode()
        handle = torch.ops.deepinfer.shm_all_reduce_attach(name, rank, parallel.tensor_parallel_size,
                                                           _SHM_SLOT_BYTES, parallel.distributed_timeout_s, False)
    dist.barrier()
    if rank == 0:
        torch.ops.deepinfer.shm_all_reduce_unlink(name)
    return handle


def leave_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def pin_rank_threads(config: EngineConfig, rank: int) -> None:
    """Give each rank of a node its own cores and as many torch threads: ranks that share cores stall each other's
    OpenMP barriers. Pins the calling thread (which runs the rank's torch ops; OpenMP workers inherit it)."""
    local_rank, per_node = rank % config.parallel.ranks_per_node, config.parallel.ranks_per_node
    cores = sorted(os.sched_getaffinity(0))
    if per_node == 1 or len(cores) < per_node:
        return
    share = len(cores) // per_node
    mine = cores[local_rank * share:(local_rank + 1) * share]
    os.sched_setaffinity(0, mine)
    torch.set_num_threads(config.num_threads or len(mine))


def die_with_parent(parent_pid: int) -> None:
    """A worker must not outlive the process that started it: SIGKILL when it exits (lifeline)."""
    set_parent_death_signal(signal.SIGKILL, parent_pid)
