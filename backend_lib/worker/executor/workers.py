"""The driver's worker processes on its own machine: started, watched, stopped.

Each worker is ``python -m backend_lib.worker.executor.worker`` with the project on its path: a fresh interpreter
rather than a multiprocessing fork, because the driver may live inside Triton's Python stub (whose ``sys.executable`` is
not a Python) and forking a process that already runs OpenMP and gloo threads is unsafe. Workers die with the
thread that started them (PR_SET_PDEATHSIG), so no worker outlives the engine, even after SIGKILL.
"""
from __future__ import annotations

import os
import subprocess
import time

from backend_lib.core import envs
from backend_lib.core.processes import PROJECT_ROOT, python_executable
from backend_lib.worker.executor.process_group import Rendezvous, error_key, joined_key
from backend_lib.worker.failures import FatalEngineError


class RankFailure(FatalEngineError):
    """A rank died, hung past the timeout or failed to load; the message names it. Fatal: a group that lost a
    rank cannot run another step, so the engine ends every request and the model goes not ready."""


def _process_state(pid: int) -> str:
    """The state letter of /proc/PID/stat (R, S, D, T, Z...); "" when it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def rank_name(rank: int, tensor_parallel_size: int, context_parallel_size: int) -> str:
    """How errors name a rank: its global number, and its place in both groups when there are context ranks."""
    if context_parallel_size == 1:
        return f"tensor-parallel rank {rank}"
    return (f"rank {rank} (tensor-parallel rank {rank % tensor_parallel_size}, context-parallel rank "
            f"{rank // tensor_parallel_size})")


class WorkerPool:
    def __init__(self, rendezvous: Rendezvous, ranks: range, tensor_parallel_size: int, context_parallel_size: int,
                 timeout_s: float) -> None:
        self.rendezvous, self.timeout_s = rendezvous, timeout_s
        self.sizes = (tensor_parallel_size, context_parallel_size)
        self.world_size = tensor_parallel_size * context_parallel_size
        env = envs.child_env(pythonpath_first=(str(PROJECT_ROOT),))
        self.procs = {rank: subprocess.Popen(
            [python_executable(), "-m", "backend_lib.worker.executor.worker", "--rank", str(rank),
             "--master-addr", rendezvous.master_addr, "--master-port", str(rendezvous.master_port),
             "--parent-pid", str(os.getpid())], env=env) for rank in ranks}

    def wait_joined(self) -> None:
        """Until every rank (local and remote) announced itself; a local worker that exits first is named."""
        deadline = time.monotonic() + self.timeout_s
        pending = list(range(1, self.world_size))
        while pending:
            failed = self.failure()
            if failed:
                raise RankFailure(failed)
            pending = [r for r in pending if not self.rendezvous.store.check([joined_key(r)])]
            if pending and time.monotonic() > deadline:
                raise RankFailure(f"rank(s) {pending} did not join within {self.timeout_s:.0f} s "
                                  f"(master {self.rendezvous.master_addr}:{self.rendezvous.master_port})")
            time.sleep(0.05)

    def failure(self) -> str | None:
        """A description of the first failed rank: its own error message, or its exit code; None if all run."""
        for rank in range(1, self.world_size):
            if self.rendezvous.store.check([error_key(rank)]):
                reason = self.rendezvous.store.get(error_key(rank)).decode()
                return f"{rank_name(rank, *self.sizes)} failed: {reason}"
        for rank, proc in sorted(self.procs.items()):
            code = proc.poll()
            if code is not None:
                return f"{rank_name(rank, *self.sizes)} (pid {proc.pid}) exited with code {code}"
        for rank, proc in sorted(self.procs.items()):
            if _process_state(proc.pid) == "T":  # alive but stopped (SIGSTOP, a debugger): it hangs every step
                return f"{rank_name(rank, *self.sizes)} (pid {proc.pid}) is stopped and does not answer"
        return None

    def wait_failure(self, grace_s: float) -> str | None:
        """``failure()``, allowing a dying rank ``grace_s`` to be reaped (its peers see the broken connection
        first)."""
        deadline = time.monotonic() + grace_s
        while (failed := self.failure()) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        return failed

    def stop(self, grace_s: float = 5.0) -> None:
        """Workers leave on the driver's SHUTDOWN message; any still running after ``grace_s`` is killed."""
        deadline = time.monotonic() + grace_s
        for proc in self.procs.values():
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
