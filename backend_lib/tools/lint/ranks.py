"""``deepinfer lint-graphs --tensor-parallel-size N``: every rank lints the regions of its own shard.

N processes join a gloo group on this host (the collectives in the graphs run while each region is checked, so
they must pair up) without the host's shared-memory all-reduce: the graphs carry the functional collectives that
Neuron's backend receives. Rank 0 reports every rank's result.
"""
from __future__ import annotations

import datetime
import multiprocessing
import queue
from dataclasses import dataclass

import torch
import torch.distributed as dist

from backend_lib.core.processes import free_port
from backend_lib.models.parallel import ParallelContext
from backend_lib.tools.lint.regions import lint_all_regions


@dataclass(frozen=True)
class RankResult:
    rank: int
    region: str
    error: str | None


def _lint_rank(rank: int, world_size: int, port: int, archs: list[str], results) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world_size, rank == 0, timeout=datetime.timedelta(seconds=300))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    try:
        par = ParallelContext(rank=rank, world_size=world_size, group=dist.group.WORLD)
        for region, error in lint_all_regions(archs, par):
            results.put(RankResult(rank, region, None if error is None else str(error)))
    finally:
        dist.destroy_process_group()


def lint_with_ranks(archs: list[str], world_size: int) -> list[RankResult]:
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    port = free_port()
    procs = [context.Process(target=_lint_rank, args=(rank, world_size, port, archs, results))
             for rank in range(world_size)]
    for proc in procs:
        proc.start()
    collected: list[RankResult] = []
    while any(p.is_alive() for p in procs) or not results.empty():
        try:
            collected.append(results.get(timeout=0.5))
        except queue.Empty:  # keep waiting while a rank runs
            continue
    failed = [f"rank {rank} exited with code {p.exitcode}" for rank, p in enumerate(procs) if p.exitcode]
    if failed:
        raise RuntimeError("lint ranks failed: " + "; ".join(failed))
    return sorted(collected, key=lambda r: r.rank)
