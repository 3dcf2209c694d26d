"""`deepinfer worker`: the ranks of one more machine (node 1, 2, ...) of a tensor-parallel engine.

Node 0 runs `deepinfer serve` (or `LLM`) with ``nnodes`` > 1 and an explicit ``master_port``; its driver hosts the
rendezvous store. Here we read the engine configuration the driver published there, then launch this node's ranks
with torchrun (one process per local device, ``LOCAL_RANK`` set by torchrun; torchrun supervises them and stops
them together); each rank joins the driver's group through the store.
"""
from __future__ import annotations

import argparse
import os
import sys

from backend_lib.core import envs
from backend_lib.core.config import EngineConfig
from backend_lib.core.processes import PROJECT_ROOT, python_executable
from backend_lib.worker.executor.process_group import join_rendezvous


def torchrun_command(node_rank: int, ranks_per_node: int, master_addr: str, master_port: int,
                     timeout_s: float) -> list[str]:
    return [python_executable(), "-m", "torch.distributed.run", "--standalone", "--nnodes=1",
            f"--nproc-per-node={ranks_per_node}", "-m", "backend_lib.worker.executor.worker",
            "--rank-base", str(node_rank * ranks_per_node), "--master-addr", master_addr,
            "--master-port", str(master_port), "--timeout", str(timeout_s)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="deepinfer worker",
                                     description="run this machine's ranks of a multi-node DeepInfer engine")
    parser.add_argument("--nnodes", type=int, required=True, help="machines in the engine (node 0 = the driver's)")
    parser.add_argument("--node-rank", type=int, required=True, help="this machine's index, 1 .. nnodes-1")
    parser.add_argument("--master-addr", required=True, help="node 0's address (the driver's rendezvous store)")
    parser.add_argument("--master-port", type=int, required=True, help="node 0's master_port parameter")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for the driver's store")
    args = parser.parse_args(argv)
    if not 1 <= args.node_rank < args.nnodes:
        parser.error(f"--node-rank must be in [1, {args.nnodes - 1}] (node 0 runs the driver), got {args.node_rank}")
    _, flat = join_rendezvous(args.master_addr, args.master_port, args.timeout)
    parallel = EngineConfig.from_flat(flat).parallel
    if parallel.nnodes != args.nnodes:
        parser.error(f"--nnodes={args.nnodes} but the driver was started with nnodes={parallel.nnodes}")
    command = torchrun_command(args.node_rank, parallel.ranks_per_node, args.master_addr, args.master_port,
                               args.timeout)
    env = envs.child_env(pythonpath_first=(str(PROJECT_ROOT),))
    sys.stdout.flush()
    os.execvpe(command[0], command, env)  # torchrun takes over this process: Ctrl-C and SIGTERM reach it
    return 0
