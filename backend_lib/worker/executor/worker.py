"""A worker rank's process: join the driver's group, build this rank's shard, then follow the driver's steps.

Started by the driver for the ranks on its own machine (``WorkerPool``), or by ``deepinfer worker`` on the other
nodes (through torchrun, with ``--rank-base``). Usage:
``python -m backend_lib.worker.executor.worker --rank R --master-addr A --master-port P --parent-pid PID``.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import traceback

from backend_lib.core import envs
from backend_lib.core.config import EngineConfig
from backend_lib.worker.executor.process_group import (die_with_parent, error_key, init_group, join_rendezvous,
                                                       leave_group, pin_rank_threads)
from backend_lib.worker.eplb import apply_placements
from backend_lib.worker.executor.rank import build_rank
from backend_lib.worker.model_runner import ModelRunner
from backend_lib.worker.step_channel import StepChannel, StepOp
from backend_lib.worker.step_messages import received_inputs

log = logging.getLogger("deepinfer.worker")


def follow(runner: ModelRunner, channel: StepChannel) -> bool:
    """One of the driver's steps on this rank; False when the driver shuts the ranks down."""
    message = channel.receive()
    if message.op == StepOp.SHUTDOWN:
        return False
    if message.op == StepOp.REBALANCE:
        apply_placements(runner.model, message.tensors["placement"])
        return True
    inputs = received_inputs(message.tensors, runner.block_size)
    runner.follow_step(inputs, message.tensors, lambda: channel.receive().tensors["verified"])
    return True


def run_worker(rank: int, master_addr: str, master_port: int, timeout_s: float) -> int:
    rendezvous, flat = join_rendezvous(master_addr, master_port, timeout_s)
    config = EngineConfig.from_flat(flat)
    try:
        pin_rank_threads(config, rank)
        par = init_group(rendezvous, config, rank)
        state = build_rank(config, par)
        while follow(state.runner, state.channel):
            pass
    except Exception as exc:  # the driver reads the reason from the store and names this rank
        rendezvous.store.set(error_key(rank), f"{type(exc).__name__}: {exc}")
        traceback.print_exc()
        return 1
    finally:
        leave_group()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="one DeepInfer tensor-parallel worker rank")
    who = parser.add_mutually_exclusive_group(required=True)
    who.add_argument("--rank", type=int)
    who.add_argument("--rank-base", type=int, help="under torchrun: this node's first rank (+ LOCAL_RANK)")
    parser.add_argument("--master-addr", required=True)
    parser.add_argument("--master-port", type=int, required=True)
    parser.add_argument("--parent-pid", type=int, default=0, help="exit with this process (0: the actual parent)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds to reach the driver's store")
    args = parser.parse_args(argv)
    rank = args.rank if args.rank is not None else args.rank_base + envs.required("LOCAL_RANK")
    die_with_parent(args.parent_pid or os.getppid())
    logging.basicConfig(level=logging.INFO, format=f"[rank {rank}] %(levelname)s %(message)s")
    return run_worker(rank, args.master_addr, args.master_port, args.timeout)


if __name__ == "__main__":
    sys.exit(main())
