"""OS process helpers every layer uses: a child dies with its parent (PR_SET_PDEATHSIG), whether a pid still runs,
the Python interpreter for our child processes, the project root to put on their path, and a free TCP port.

Torch-free and free of any server state: the launcher (frontend/triton), the executor's worker processes and the
lint tool's ranks all start children with these.
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import random
import signal
import socket
import sys
from collections.abc import Callable
from pathlib import Path

from backend_lib.core import envs

PROJECT_ROOT = Path(__file__).resolve().parents[2]  # holds backend_lib/ and kernels/ (the source tree or site-packages)
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent(sig: int = signal.SIGKILL) -> Callable[[], None]:
    """A ``preexec_fn`` for subprocess.Popen: the child gets ``sig`` when the calling thread's process dies.

    Linux sends the signal when the *thread* that forked the child exits, so call Popen from a thread that lives
    as long as the server (the main thread of `deepinfer serve` and of pytest do).
    """
    parent = os.getpid()
    return lambda: set_parent_death_signal(sig, parent)


def set_parent_death_signal(sig: int, parent_pid: int) -> None:
    """In the child: ``sig`` when the parent dies (PR_SET_PDEATHSIG); a parent already gone ends us now."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent_pid:  # the parent died before prctl: the signal will never come
        os._exit(1)


def python_executable() -> str:
    """A Python interpreter for our child processes. Inside the Triton stub ``sys.executable`` is the stub binary, so
    `deepinfer serve` passes its own interpreter as DEEPINFER_PYTHON; the venv's python is the fallback."""
    if envs.read("DEEPINFER_PYTHON"):
        return envs.read("DEEPINFER_PYTHON")
    if "python" in Path(sys.executable).name:
        return sys.executable
    return str(Path(sys.prefix) / "bin" / "python3")


def pid_alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie does not: it holds no memory and will never run again)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def free_port(lowest: int = 10000) -> int:
    """A TCP port free now, below the kernel's ephemeral range. bind(0) hands out a port inside that range, which
    any outgoing connection (a client of another test, another server's workers) may take as its local port
    before our server binds it: Triton then fails to start a service (seen with two pytest workers)."""
    ephemeral_low = 32768
    with contextlib.suppress(OSError, ValueError):
        ephemeral_low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    choose = random.SystemRandom()  # not the process's seeded generator: forked workers would pick alike
    tries = 200 if ephemeral_low - lowest >= 1000 else 0  # else no room below the range
    for _ in range(tries):
        port = choose.randrange(lowest, ephemeral_low)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:  # any free port
        sock.bind(("", 0))
        return sock.getsockname()[1]
