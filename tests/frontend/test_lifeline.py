"""Process hygiene without a server: the parent-death signal, shm region naming and sweeping, the stub's
guard process, and the launcher's signal handling (a second Ctrl-C exits at once)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from backend_lib.core.processes import pid_alive
from backend_lib.frontend.triton import lifeline
from backend_lib.frontend.triton.shutdown import ExitNow, ShutdownSignals


def _wait_for(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_child_dies_with_its_parent():
    """A middle process starts a sleeper with die_with_parent and is SIGKILLed: the sleeper dies too."""
    code = ("import subprocess, sys, time; from backend_lib.core.processes import die_with_parent; "
            "p = subprocess.Popen(['sleep', '300'], preexec_fn=die_with_parent()); print(p.pid, flush=True); "
            "time.sleep(300)")
    middle = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                              env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    try:
        sleeper = int(middle.stdout.readline())
        assert pid_alive(sleeper)
        middle.kill()
        middle.wait(timeout=10)
        _wait_for(lambda: not pid_alive(sleeper))
    finally:
        middle.kill()
        middle.wait(timeout=10)


def test_shm_regions_are_named_per_launcher_and_swept_when_it_is_gone(tmp_path):
    prefix = lifeline.shm_prefix()
    assert prefix.startswith(f"deepinfer_{os.getpid()}_")
    ours = tmp_path / f"{prefix}region"
    stale = tmp_path / "deepinfer_999999999_abcd_region"  # a launcher pid that cannot exist
    foreign = tmp_path / "triton_python_backend_shm_region_x"
    for path in (ours, stale, foreign):
        path.write_bytes(b"x")
    assert lifeline.remove_stale_shm_regions(tmp_path) == [stale.name]  # ours: its launcher (we) runs
    assert lifeline.remove_shm_regions(prefix, tmp_path) == [ours.name]
    assert foreign.exists()  # never someone else's


@pytest.fixture()
def guarded():
    """A stand-in server and stub (two `sleep`s), a region of ours, and the stub's guard watching them."""
    region = lifeline.SHM_DIR / f"{lifeline.shm_prefix()}guard_test"
    region.write_bytes(b"x")
    server, stub = (subprocess.Popen(["sleep", "60"]) for _ in range(2))
    guard = subprocess.Popen([sys.executable, "-m", "backend_lib.frontend.triton.lifeline", "--stub-pid", str(stub.pid),
                              "--server-pid", str(server.pid), "--region", region.name, "--poll-s", "0.02"],
                             stderr=subprocess.PIPE, text=True)
    yield server, stub, guard, region
    for process in (server, stub, guard):
        process.kill()
        process.wait()
    region.unlink(missing_ok=True)


def test_stub_guard_kills_the_stub_and_removes_its_region_when_the_server_is_gone(guarded):
    server, stub, guard, region = guarded
    time.sleep(0.3)
    assert guard.poll() is None and stub.poll() is None  # both alive: it only watches
    server.kill()
    server.wait()
    assert guard.wait(timeout=10) == 1
    assert stub.wait(timeout=10) == -signal.SIGKILL
    assert not region.exists()
    assert f"killing the stub (pid {stub.pid})" in guard.stderr.read()


def test_stub_guard_ends_quietly_when_the_stub_ends_first(guarded):
    server, stub, guard, region = guarded
    stub.kill()
    stub.wait()
    assert guard.wait(timeout=10) == 0
    assert server.poll() is None and region.exists()  # the server and its region are not the guard's


def test_first_signal_asks_for_a_drain_and_the_second_exits_at_once():
    signals = ShutdownSignals()
    signals.serving = True
    signals.handle(signal.SIGTERM)
    assert signals.requested == "SIGTERM"
    with pytest.raises(ExitNow, match="SIGINT"):
        signals.handle(signal.SIGINT)
    signals.handle(signal.SIGINT)  # a third one does not interrupt the cleanup


def test_a_signal_while_loading_stops_the_start_but_one_after_ready_drains():
    """The launcher polls readiness: a SIGTERM that lands between the model turning ready and the launcher seeing
    it must still drain (requests may run already); one that lands while the model loads ends the start."""
    from types import SimpleNamespace

    from backend_lib.frontend.triton.server import TritonServer

    signals = ShutdownSignals()
    signals.handle(signal.SIGTERM)  # not serving yet: recorded, not raised
    assert signals.stop_requested()
    server = TritonServer(overrides={})
    server.process = SimpleNamespace(poll=lambda: None)
    server.is_ready = lambda: True
    server._wait_ready(5, signals.stop_requested)  # ready wins: the caller then drains
    server.is_ready = lambda: False
    with pytest.raises(ExitNow, match="before the model was ready"):
        server._wait_ready(5, signals.stop_requested)
