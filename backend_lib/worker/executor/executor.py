"""The engine's handle on its ranks: builds this process's rank (the driver, rank 0), starts and joins the others,
runs steps, turns a lost rank into one clear error, and stops every worker.

With one rank (``tensor_parallel_size x context_parallel_size == 1``) there is no group and no worker: the model
runner runs in this process as before. Otherwise the driver hosts the rendezvous, starts the ranks of its own node,
waits until every rank (including those ``deepinfer worker`` starts on other nodes) has joined, and builds its own
shard; every step's inputs then go to the workers over the step channel (worker/step_messages.py: the runner sends
through its ``StepLink``; each worker's loop hands its runner the received inputs).
"""
from __future__ import annotations

import logging

import torch

from backend_lib.core.config import EngineConfig, config_to_flat
from backend_lib.core.outputs import EplbStats, RunnerOutput, SchedulerOutput, SpecSurvivalStats
from backend_lib.models.parallel import ParallelContext
from backend_lib.worker.eplb import ExpertLoadBalancer
from backend_lib.worker.executor.process_group import host_rendezvous, init_group, leave_group, pin_rank_threads
from backend_lib.worker.executor.rank import RankState, build_rank
from backend_lib.worker.executor.workers import RankFailure, WorkerPool
from backend_lib.worker.model_inputs import ModelInputs, StepOverlap
from backend_lib.worker.model_runner import ModelRunner

log = logging.getLogger("deepinfer.executor")


class Executor:
    def __init__(self, config: EngineConfig) -> None:
        parallel = config.parallel
        self.pool: WorkerPool | None = None
        self.failed: str | None = None
        self.state: RankState | None = None
        self.balancer: ExpertLoadBalancer | None = None  # enable_eplb (only with ranks: EplbConfig checks)
        if parallel.world_size == 1:
            self.state = build_rank(config, ParallelContext())
            return
        rendezvous = host_rendezvous(parallel, config_to_flat(config))
        self.pool = WorkerPool(rendezvous, range(1, parallel.ranks_per_node), parallel.tensor_parallel_size,
                               parallel.context_parallel_size, parallel.distributed_timeout_s)
        try:
            pin_rank_threads(config, 0)
            self.pool.wait_joined()
            par = init_group(rendezvous, config, 0)
            log.info("parallel: %d ranks = tensor %d x context %d (%d per node, expert parallel %s), rendezvous %s:%d",
                     parallel.world_size, parallel.tensor_parallel_size, parallel.context_parallel_size,
                     parallel.ranks_per_node, parallel.enable_expert_parallel,
                     rendezvous.master_addr, rendezvous.master_port)
            self.state = build_rank(config, par)
            if config.eplb.enable_eplb:
                self.balancer = ExpertLoadBalancer(self.state.model, config.eplb, parallel.nnodes, self.state.link)
        except Exception as exc:
            failure = self.pool.failure()
            self.failed = failure or str(exc)
            self.close()
            # A bad configuration fails the driver as it fails every rank: its own message is the one to show.
            if failure and not isinstance(exc, ValueError):
                raise RankFailure(failure) from exc
            raise
        self._rendezvous = rendezvous  # the store lives as long as the group

    @property
    def model(self) -> torch.nn.Module:
        return self.state.model

    @property
    def runner(self) -> ModelRunner:
        return self.state.runner

    @property
    def num_blocks(self) -> int:
        return self.state.num_blocks

    @property
    def num_state_slots(self) -> int:
        return self.state.num_state_slots

    def execute(self, scheduler_output: SchedulerOutput, inputs: ModelInputs | None = None,
                overlap: StepOverlap | None = None) -> RunnerOutput:
        """One step (``inputs`` and ``overlap``: a step prepared while the previous one ran, ModelRunner.execute).
        Zero-overhead scheduling calls it from its device thread, one step at a time, in order."""
        if self.failed:
            raise RankFailure(self.failed)
        try:
            output = self.state.runner.execute(scheduler_output, inputs, overlap)
            if self.balancer is not None:  # between this step and the next: no step sees half-moved experts
                self.balancer.after_step()
            return output
        except RuntimeError as exc:  # with ranks: a collective failed (a peer died, or hung past the timeout)
            if self.pool is None:
                raise
            self.failed = self.pool.wait_failure(grace_s=2.0) or f"a collective between ranks failed: {exc}"
            log.error("engine cannot go on: %s", self.failed)
            raise RankFailure(self.failed) from exc

    def eplb_stats(self) -> EplbStats | None:
        return None if self.balancer is None else self.balancer.stats()

    def spec_survival_stats(self) -> SpecSurvivalStats | None:
        drafter = self.state.runner.block_drafter
        return None if drafter is None else drafter.calibration.snapshot()

    def close(self) -> None:
        """Stop every worker (idempotent). After a failure the survivors are killed rather than told."""
        if self.pool is None:
            return
        pool, self.pool = self.pool, None
        if not self.failed and self.state is not None:
            try:
                self.state.link.shutdown()
            except RuntimeError as exc:
                log.warning("workers did not take the shutdown message: %s", exc)
        pool.stop(grace_s=5.0 if not self.failed else 0.0)
        leave_group()
