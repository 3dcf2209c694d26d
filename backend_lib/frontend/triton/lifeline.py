"""Children die with their parent: nothing of a server outlives `deepinfer serve` (no tritonserver, no Python-backend
stub, no /dev/shm region).

The bug this answers: `deepinfer serve` killed with SIGKILL (a supervisor, the OOM killer) left tritonserver
running in its own session, and its stub held 2.5 GB and its shared-memory region for 18 minutes. Three links:
- tritonserver gets a parent-death signal (``core.processes.die_with_parent``): the kernel kills it when the
  launcher dies.
- the stub starts a ``StubGuard``: a small sidecar process that, once tritonserver is gone (not running, or a
  zombie nobody reaps), kills the stub and removes its shm region. A process, not a thread in the stub: the stub's
  own health thread also notices a dead parent and exits through ``stub.reset()`` and Python's finalization, and
  once that has begun, a watchdog thread in the stub may never run again (with one, a loaded CI machine once kept
  the stub and its region past a test's 10 s deadline).
- every region of ours is named with ``shm_prefix()`` (the launcher's pid), so a launcher removes its own on stop
  and the regions of launchers that died (``remove_stale_shm_regions``) on start.
"""
from __future__ import annotations

import argparse
import os
import re
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

from backend_lib.core import envs
from backend_lib.core.processes import PROJECT_ROOT, pid_alive, python_executable

SHM_DIR = Path("/dev/shm")
_OUR_REGION = re.compile(r"^deepinfer_(\d+)_[0-9a-f]+_")


def shm_prefix() -> str:
    """A Python-backend shm-region-prefix-name unique to this launcher (its pid, so leftovers can be traced)."""
    return f"deepinfer_{os.getpid()}_{secrets.token_hex(4)}_"


def remove_shm_regions(prefix: str, shm_dir: Path = SHM_DIR) -> list[str]:
    """Unlink every region whose name starts with ``prefix``; the names removed."""
    removed = []
    for path in shm_dir.glob(f"{prefix}*"):
        try:
            path.unlink()
            removed.append(path.name)
        except FileNotFoundError:  # removed meanwhile (e.g. by the stub's guard)
            pass
    return removed


def remove_stale_shm_regions(shm_dir: Path = SHM_DIR) -> list[str]:
    """Unlink the regions of ours whose launcher no longer runs; the names removed."""
    removed = []
    for path in shm_dir.glob("deepinfer_*"):
        match = _OUR_REGION.match(path.name)
        if match and not pid_alive(int(match.group(1))):
            removed += remove_shm_regions(path.name, shm_dir)
    return removed


def stub_shm_region() -> str | None:
    """The shm region of the Python-backend stub this process is (argv[2] of triton_python_backend_stub)."""
    try:
        argv = Path("/proc/self/cmdline").read_bytes().split(b"\0")
    except OSError:
        return None
    if len(argv) > 2 and argv[0].endswith(b"triton_python_backend_stub"):
        return argv[2].decode(errors="replace")
    return None


class StubGuard:
    """The sidecar of a Python-backend stub: it ends the stub and removes its region when tritonserver is gone,
    and ends itself when the stub is gone (it polls both; it has no parent-death signal because the stub thread
    that starts it may end before the stub does)."""

    def __init__(self, region: str | None, poll_s: float = 0.1) -> None:
        command = [python_executable(), "-m", "backend_lib.frontend.triton.lifeline", "--stub-pid",
                   str(os.getpid()), "--server-pid", str(os.getppid()), "--region", region or "",
                   "--poll-s", str(poll_s)]
        env = envs.child_env(pythonpath_first=(str(PROJECT_ROOT),))
        self.process = subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=10)


def guard_stub(stub_pid: int, server_pid: int, region: str, poll_s: float) -> int:
    """The sidecar's loop (``python -m backend_lib.frontend.triton.lifeline``): 0 when the stub ended first, 1 when
    it ended it."""
    while True:
        if not pid_alive(stub_pid):
            return 0
        if not pid_alive(server_pid):
            sys.stderr.write(f"[deepinfer] tritonserver (pid {server_pid}) is gone: killing the stub (pid "
                             f"{stub_pid}) and removing its shm region {region or '(unknown)'}\n")
            sys.stderr.flush()
            try:
                os.kill(stub_pid, signal.SIGKILL)
            except ProcessLookupError:  # it ended meanwhile
                pass
            if region:
                remove_shm_regions(region)
            return 1
        time.sleep(poll_s)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m backend_lib.frontend.triton.lifeline",
                                     description=guard_stub.__doc__)
    parser.add_argument("--stub-pid", type=int, required=True)
    parser.add_argument("--server-pid", type=int, required=True)
    parser.add_argument("--region", default="")
    parser.add_argument("--poll-s", type=float, default=0.1)
    args = parser.parse_args(argv)
    # `deepinfer serve` stops tritonserver with a SIGINT to its process group, which holds this sidecar: it
    # guards until the stub or the server is gone (StubGuard.stop and kill() end it with SIGTERM / SIGKILL).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    return guard_stub(args.stub_pid, args.server_pid, args.region, args.poll_s)


if __name__ == "__main__":
    sys.exit(main())
