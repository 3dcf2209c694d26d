"""Children die with their parent: nothing of a server outlives `deepinfer serve` (no tritonserver, no Python-backend
stub, no /dev/shm region).

The bug this answers: `deepinfer serve` killed with SIGKILL (a supervisor, the OOM killer) left tritonserver
running in its own session, and its stub held 2.5 GB and its shared-memory region for 18 minutes. Three links:
- tritonserver gets a parent-death signal (``die_with_parent``): the kernel kills it when the launcher dies.
- the stub runs a ``ParentWatchdog``: when tritonserver is gone (the stub's parent pid changes; a dead parent may
  linger as a zombie, so asking whether it exists is not enough), it removes its shm region and exits at once.
  The stub's own health thread also notices a dead parent, but it exits through Python's finalization, which can
  block on our engine's threads; and it leaves the region behind.
- every region of ours is named with ``shm_prefix()`` (the launcher's pid), so a launcher removes its own on stop
  and the regions of launchers that died (``remove_stale_shm_regions``) on start.
"""
from __future__ import annotations

import ctypes
import os
import re
import secrets
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

SHM_DIR = Path("/dev/shm")
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_OUR_REGION = re.compile(r"^deepinfer_(\d+)_[0-9a-f]+_")


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
        except FileNotFoundError:  # removed meanwhile (e.g. by the stub's watchdog)
            pass
    return removed


def pid_alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie does not: it holds no memory and will never run again)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


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


def exit_orphaned_stub(region: str | None) -> NoReturn:
    """tritonserver is gone: nobody will unload us or remove our region. Remove it and exit without Python's
    finalization (which would wait on the engine's threads)."""
    sys.stderr.write(f"[deepinfer] tritonserver is gone: the stub (pid {os.getpid()}) removes its shm region "
                     f"{region} and exits\n")
    sys.stderr.flush()
    if region:
        remove_shm_regions(region)
    os._exit(1)


class ParentWatchdog:
    """Calls ``on_orphaned`` once the process's parent changed (the parent died; we were re-parented)."""

    def __init__(self, on_orphaned: Callable[[], None], poll_s: float = 0.2) -> None:
        self._parent = os.getppid()
        self._on_orphaned = on_orphaned
        self._poll_s = poll_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="deepinfer-parent-watchdog", daemon=True)

    def start(self) -> "ParentWatchdog":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self._poll_s):
            if os.getppid() != self._parent:
                self._on_orphaned()
                return
