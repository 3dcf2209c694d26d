"""The OpenAI front as a process: it answers without Triton where it can, and dies with its parent."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from backend_lib.core.processes import free_port

ROOT = Path(__file__).resolve().parents[2]
# A parent that starts the front (its pid as --parent-pid, as `deepinfer serve` does), prints the front's pid, waits.
PARENT = """
import os, subprocess, sys, time
front = subprocess.Popen([sys.executable, "-m", "backend_lib.frontend.openai", "--port", sys.argv[1],
                          "--grpc-url", "localhost:1", "--parent-pid", str(os.getpid())])
print(front.pid, flush=True)
time.sleep(600)
"""


def _get(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, json.loads(response.read() or b"{}")
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped by init) counts as gone.
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().split(")")[-1].split()[0] != "Z"


def test_front_answers_and_dies_with_its_parent():
    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(port)], env=env, stdout=subprocess.PIPE, text=True)
    front_pid = int(parent.stdout.readline())
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                status, body = _get(f"http://localhost:{port}/v1/models")
                break
            except (urllib.error.URLError, ConnectionError):
                assert time.monotonic() < deadline, "the front did not start listening"
                time.sleep(0.2)
        assert status == 200 and [m["id"] for m in body["data"]] == ["deepinfer"]
        # No Triton behind it: not ready, and an unknown path is a 404, both in OpenAI's error format.
        status, body = _get(f"http://localhost:{port}/health")
        assert status == 503 and body["error"]["type"] == "server_unavailable"
        status, body = _get(f"http://localhost:{port}/v1/nothing")
        assert status == 404 and set(body["error"]) == {"message", "type", "param", "code"}

        parent.send_signal(signal.SIGKILL)  # no chance to clean up: the kernel's parent-death signal must do it
        parent.wait(timeout=10)
        deadline = time.monotonic() + 20
        while _alive(front_pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _alive(front_pid), "the front outlived its parent"
    finally:
        if parent.poll() is None:
            parent.kill()
        if _alive(front_pid):
            os.kill(front_pid, signal.SIGKILL)
