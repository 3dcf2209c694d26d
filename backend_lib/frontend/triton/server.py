"""`deepinfer serve`: run a real tritonserver with the DeepInfer model, no Docker needed (and in the Docker
image: NVIDIA's Triton, the image's /models). Where tritonserver and the model repository come from:
backend_lib/frontend/triton/install.py.

Lifecycle. tritonserver dies with the launcher (a parent-death signal) and its stub with tritonserver (the stub's
guard process, see lifeline.py); our shm regions carry a per-launcher prefix and are removed on stop. The model is
loaded in explicit model-control mode, for two reasons: a model whose engine died can unload itself (Triton
then reports it not ready), and a drain can unload it. Triton 2.51 on SIGINT/SIGTERM closes its HTTP and gRPC
endpoints at once, so in-flight streams never get their last responses; unloading the model instead makes
Triton refuse new requests (not ready) while the in-flight streams run to their end. The unload itself does not
tell when they ended: Triton finalizes the model only once every client closed its gRPC stream, and an idle
client may never do so; the engine's gauges on /metrics (requests running + waiting) do. So
``stop(drain_timeout_s)``: unload, wait until the engine is idle or the deadline, then the stop file (the model
aborts what is left), then SIGINT, then SIGKILL once Triton's exit timeout is over (an open client stream keeps
Triton waiting that long, after which Triton 2.51 was seen to crash and hang instead of exiting).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from backend_lib.core import envs
from backend_lib.core.processes import PROJECT_ROOT, die_with_parent
from backend_lib.frontend.triton import lifeline
from backend_lib.frontend.triton.install import (MODEL_NAME, MODEL_SOURCE, checked_model_repository,
                                                 installed_tritonserver, prepare_tritonserver, render_config,
                                                 server_env, write_model_repository)
from backend_lib.frontend.triton.shutdown import ExitNow, ShutdownSignals

_STOP_FILE_GRACE_S = 1.0  # the model polls the stop file every 0.5 s
_DRAIN_POLL_S = 0.3
_METRICS_REFRESH_S = 0.6  # the model refreshes its gauges every 0.5 s: two idle reads this far apart agree
_IN_FLIGHT_GAUGES = ("deepinfer_num_requests_running", "deepinfer_num_requests_waiting")


@dataclass
class TritonServer:
    """One tritonserver process serving our model; ``start`` waits until the model is READY."""

    http_port: int = 8000
    grpc_port: int = 8001
    metrics_port: int = 8002
    overrides: dict[str, str] = field(default_factory=dict)
    workdir: Path | None = None  # model repository + log; a temporary dir when None
    triton_root: Path | None = None  # an installed Triton (bin/, backends/); None: the nvidia-pytriton wheel's
    model_repository: Path | None = None  # the user's, served as is; None: written to workdir with overrides
    log_to_stdout: bool = False  # tritonserver's and the front's output to ours (docker logs), no log files
    log_verbose: int = 0
    # How long Triton waits on shutdown for the model to unload (requests were drained or aborted before: this
    # only covers finalize, and idle client streams that hold the model); then stop() kills what is left.
    exit_timeout_s: int = 10
    process: subprocess.Popen | None = None
    log_path: Path | None = None
    stop_file: Path | None = None  # created on stop(): the model then aborts in-flight requests
    env: dict[str, str] = field(default_factory=dict)  # extra environment for tritonserver and the model
    shm_prefix: str = ""  # the Python backend's shm-region-prefix-name, unique to this launcher; set by start()
    openai_port: int | None = None  # the OpenAI-compatible front (backend_lib/frontend/openai) listens here when set
    openai_process: subprocess.Popen | None = None

    @property
    def http_url(self) -> str:
        return f"localhost:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"localhost:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://localhost:{self.metrics_port}/metrics"

    @property
    def openai_url(self) -> str | None:
        return f"http://localhost:{self.openai_port}/v1" if self.openai_port is not None else None

    def start(self, timeout_s: float = 600.0, stop_requested: Callable[[], bool] | None = None) -> "TritonServer":
        if self.model_repository is not None and self.overrides:
            raise ValueError(f"model settings ({', '.join(sorted(self.overrides))}) go into the config.pbtxt of "
                             f"the repository served as is ({self.model_repository}), not into overrides")
        install = installed_tritonserver(self.triton_root) if self.triton_root else prepare_tritonserver()
        work = self.workdir or Path(tempfile.mkdtemp(prefix="deepinfer-serve-"))
        work.mkdir(parents=True, exist_ok=True)  # the logs and the stop file go here (the image's /tmp/deepinfer)
        repo = (checked_model_repository(self.model_repository) if self.model_repository is not None
                else write_model_repository(work / "models", self.overrides))
        self.log_path = None if self.log_to_stdout else work / "tritonserver.log"
        command = [str(install.binary), f"--model-repository={repo}", f"--backend-directory={install.backends}",
                   f"--http-port={self.http_port}", f"--grpc-port={self.grpc_port}",
                   f"--metrics-port={self.metrics_port}", "--allow-metrics=true", "--allow-cpu-metrics=true",
                   f"--log-verbose={self.log_verbose}", f"--exit-timeout-secs={self.exit_timeout_s}",
                   "--exit-on-error=true", "--strict-readiness=true",
                   "--model-control-mode=explicit", f"--load-model={MODEL_NAME}"]
        lifeline.remove_stale_shm_regions()  # left by launchers that were killed before their stubs could
        self.shm_prefix = lifeline.shm_prefix()
        command.append(f"--backend-config=python,shm-region-prefix-name={self.shm_prefix}")
        self.stop_file = work / "stopping"
        self.stop_file.unlink(missing_ok=True)
        env = server_env(install)
        env.update(self.env)
        env["DEEPINFER_STOP_FILE"] = str(self.stop_file)
        with self._output_to(work / "tritonserver.log") as log:
            # Own process group: stop() signals tritonserver and its Python stub together. The parent-death
            # signal: if this process dies without stop() (SIGKILL, OOM killer), tritonserver dies with it.
            self.process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, start_new_session=True,
                                            preexec_fn=die_with_parent(signal.SIGKILL))
        try:
            self._wait_ready(timeout_s, stop_requested or (lambda: False))
            if self.openai_port is not None:
                self._start_openai_front(work)
        except BaseException:
            self.kill()  # never ready: no request to drain or abort
            raise
        return self

    def _start_openai_front(self, work: Path) -> None:
        """The OpenAI front as a child that dies with this process (parent-death signal), once Triton is ready."""
        command = [sys.executable, "-m", "backend_lib.frontend.openai", f"--port={self.openai_port}",
                   f"--grpc-url={self.grpc_url}", f"--triton-model={MODEL_NAME}", f"--parent-pid={os.getpid()}"]
        # Not tritonserver's environment: its LD_LIBRARY_PATH holds the wheel's bundled libraries.
        front_env = envs.child_env(pythonpath_first=(str(PROJECT_ROOT),))
        with self._output_to(work / "openai.log") as log:
            self.openai_process = subprocess.Popen(command, env=front_env, stdout=log, stderr=subprocess.STDOUT,
                                                   stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.openai_process.poll() is not None:
                output = ("its output is above" if self.log_to_stdout else
                          f"log {work / 'openai.log'}:\n{(work / 'openai.log').read_text(errors='replace')[-4000:]}")
                raise RuntimeError(f"the OpenAI front exited with code {self.openai_process.returncode}; {output}")
            try:
                with urllib.request.urlopen(f"http://localhost:{self.openai_port}/health", timeout=2) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.2)
        raise TimeoutError(f"the OpenAI front on port {self.openai_port} was not ready within 60 s")

    def _stop_openai_front(self) -> None:
        process, self.openai_process = self.openai_process, None
        if process is None or process.poll() is not None:
            return
        process.terminate()  # uvicorn closes its streams (their Triton requests are cancelled) and exits
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)

    def _output_to(self, path: Path) -> contextlib.AbstractContextManager:
        """A child's stdout: the file at ``path``, or None (ours) when logging to stdout."""
        return contextlib.nullcontext(None) if self.log_to_stdout else open(path, "ab")

    def log_tail(self, lines: int = 40) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def is_ready(self) -> bool:
        url = f"http://localhost:{self.http_port}/v2/models/{MODEL_NAME}/ready"
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                return response.status == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return False

    def _wait_ready(self, timeout_s: float, stop_requested: Callable[[], bool]) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"tritonserver exited with code {self.process.returncode} before the model "
                                   f"was ready; log {self.log_path or 'above'}:\n{self.log_tail()}")
            if self.is_ready():  # first: a stop asked for after the model came up is a drain, not an abort
                return
            if stop_requested():
                raise ExitNow("stop requested before the model was ready")
            time.sleep(0.5)
        raise TimeoutError(f"model {MODEL_NAME} not ready within {timeout_s:.0f} s; log "
                           f"{self.log_path or 'above'}:\n{self.log_tail()}")

    def _repository(self, path: str, body: dict | None = None, timeout_s: float = 5.0) -> object:
        request = urllib.request.Request(f"http://localhost:{self.http_port}/v2/repository{path}",
                                         data=json.dumps(body or {}).encode(), method="POST")
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            payload = response.read()
        return json.loads(payload) if payload else None

    def requests_in_flight(self) -> int | None:
        """Requests running or waiting in the engine (its gauges on /metrics); None when they cannot be read."""
        try:
            with urllib.request.urlopen(self.metrics_url, timeout=2) as response:
                text = response.read().decode()
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return None
        values = [float(line.rsplit(None, 1)[1]) for line in text.splitlines() if line.startswith(_IN_FLIGHT_GAUGES)]
        return int(sum(values)) if values else None

    def drain(self, timeout_s: float) -> bool:
        """Stop taking requests and let the in-flight ones finish: unload the model (Triton then answers new
        requests with an error and reports it not ready; in-flight streams go on) and wait until the engine is
        idle. True when it was within ``timeout_s``."""
        try:
            self._repository(f"/models/{MODEL_NAME}/unload")
        except (urllib.error.URLError, ConnectionError, TimeoutError) as exc:
            print(f"deepinfer: could not unload the model to drain it ({exc}); aborting in-flight requests",
                  file=sys.stderr, flush=True)
            return False
        deadline = time.monotonic() + timeout_s
        idle_since = None
        while time.monotonic() < deadline:
            if self.process is None or self.process.poll() is not None:
                return False
            if self.requests_in_flight() == 0:
                idle_since = idle_since or time.monotonic()
                if time.monotonic() - idle_since >= _METRICS_REFRESH_S:
                    return True
            else:  # busy, or unknown (metrics off): wait for the deadline
                idle_since = None
            time.sleep(_DRAIN_POLL_S)
        return False

    def stop(self, timeout_s: float = 60.0, drain_timeout_s: float = 0.0) -> int | None:
        """Drain for up to ``drain_timeout_s`` (0: no drain), then the stop file (the model aborts in-flight
        requests), SIGINT (Triton unloads the model), SIGKILL after ``timeout_s``; finally remove our shm regions.
        The OpenAI front stops when the drain is over, before Triton goes."""
        process = self.process
        if process is None:
            return None
        if process.poll() is None:
            drained = drain_timeout_s > 0 and self.drain(drain_timeout_s)
            self._stop_openai_front()  # its clients' requests end before Triton goes
            if self.stop_file is not None and not drained:
                # Triton unloads a decoupled model only after its streams end: let the model end them first.
                self.stop_file.touch()
                time.sleep(_STOP_FILE_GRACE_S)
            self._signal_group(process, signal.SIGINT)
            try:
                process.wait(timeout=min(timeout_s, self.exit_timeout_s + 5))
            except subprocess.TimeoutExpired:
                print(f"deepinfer: tritonserver did not exit within its exit timeout ({self.exit_timeout_s} s; "
                      "client streams left open hold the model): killing it", file=sys.stderr, flush=True)
        self.kill()
        return process.returncode

    def kill(self) -> None:
        """End at once what is left of the process group we started (the stub may outlive a killed server), and
        remove our shm regions."""
        self._stop_openai_front()
        process = self.process
        if process is not None:
            self._signal_group(process, signal.SIGKILL)
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                print(f"deepinfer: tritonserver {process.pid} did not die within 30 s of SIGKILL", file=sys.stderr)
        self.process = None
        if self.shm_prefix:
            lifeline.remove_shm_regions(self.shm_prefix)

    @staticmethod
    def _signal_group(process: subprocess.Popen, sig: int) -> None:
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            pass

    def __enter__(self) -> "TritonServer":
        return self.start() if self.process is None else self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def _parse_overrides(items: list[str]) -> dict[str, str]:
    overrides = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise SystemExit(f"--param must be NAME=VALUE, got {item!r}")
        overrides[name] = value
    return overrides


def banner(server: TritonServer) -> str:
    chat = ('{"messages": "[{\\"role\\": \\"user\\", \\"content\\": \\"What is the capital of France?\\"}]", '
            '"max_tokens": 32, "temperature": 0}')
    stream = '{"text_input": "Once upon a time", "max_tokens": 32, "temperature": 0.7, "stream": true}'
    openai_chat = (f'{{"model": "{MODEL_NAME}", "messages": [{{"role": "user", "content": "What is the capital of '
                   'France?"}], "max_tokens": 32, "temperature": 0}')
    return "\n".join([
        f"DeepInfer is serving model '{MODEL_NAME}'",
        f"  HTTP     http://{server.http_url}   (/v2/models/{MODEL_NAME}/generate, /generate_stream)",
        f"  gRPC     {server.grpc_url}        (streaming: tritonclient.grpc, `deepinfer chat --url {server.grpc_url}`)",
        f"  metrics  {server.metrics_url}",
        *([f"  OpenAI   {server.openai_url}   (/models, /completions, /chat/completions)"]
          if server.openai_url else []),
        "Try:",
        f"  curl -s http://{server.http_url}/v2/models/{MODEL_NAME}/generate -d '{chat}'",
        f"  curl -sN http://{server.http_url}/v2/models/{MODEL_NAME}/generate_stream -d '{stream}'",
        *([f"  curl -s {server.openai_url}/chat/completions -H 'Content-Type: application/json' -d "
           f"'{openai_chat}'"] if server.openai_url else []),
        f"Log: {server.log_path or 'this output'}   Stop: Ctrl-C",
    ])


def command_line() -> argparse.ArgumentParser:
    """`deepinfer serve`'s flags (the Docker image's command uses them too: tests/test_packaging.py checks it)."""
    parser = argparse.ArgumentParser(prog="deepinfer serve", description="Serve the DeepInfer model with tritonserver.")
    parser.add_argument("--model", default=None, help="GGUF file or Hugging Face directory (default: bundled SmolLM2)")
    parser.add_argument("--http-port", type=int, default=8000)
    parser.add_argument("--grpc-port", type=int, default=8001)
    parser.add_argument("--metrics-port", type=int, default=8002)
    parser.add_argument("--openai-port", type=int, default=None,
                        help="also serve an OpenAI-compatible API on this port (a child process that forwards to "
                             "the model over gRPC)")
    parser.add_argument("--param", action="append", default=[], metavar="NAME=VALUE",
                        help="engine setting from config.pbtxt, e.g. --param max_num_seqs=8 (repeatable)")
    parser.add_argument("--workdir", type=Path, default=None, help="where to write the model repository and log")
    parser.add_argument("--model-repository", type=Path, default=None,
                        help="serve this repository as is (its deepinfer/config.pbtxt holds the engine settings; "
                             "no --param or --model then) instead of writing one from model_repository/")
    parser.add_argument("--tritonserver", type=Path, default=None, metavar="TRITON_ROOT",
                        help="an installed Triton to run (bin/tritonserver, backends/python; /opt/tritonserver in "
                             "NVIDIA's images) instead of the nvidia-pytriton wheel's")
    parser.add_argument("--log-verbose", type=int, default=0)
    parser.add_argument("--log-stdout", action="store_true",
                        help="tritonserver's and the OpenAI front's output to this process's stdout (docker logs) "
                             "instead of log files in the workdir")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds to wait for the model to load")
    parser.add_argument("--drain-timeout", type=float, default=30.0,
                        help="on SIGTERM or Ctrl-C: seconds in-flight requests may take to finish (new ones are "
                             "refused) before they are aborted; a second Ctrl-C exits at once")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = command_line().parse_args(argv)
    if args.drain_timeout < 0:
        raise SystemExit(f"--drain-timeout must be >= 0, got {args.drain_timeout}")

    overrides = _parse_overrides(args.param)
    if args.model is not None:
        overrides["model"] = str(Path(args.model).expanduser().resolve())
    if args.model_repository is not None and overrides:
        raise SystemExit("--model-repository is served as is: set the engine (--param, --model) in its "
                         "deepinfer/config.pbtxt instead")
    try:  # before anything starts: a missing part named now, not in Triton's log
        if args.tritonserver is not None:
            installed_tritonserver(args.tritonserver)
        if args.model_repository is not None:
            checked_model_repository(args.model_repository)
        else:  # an unknown --param or a bad value: named here, not in a traceback from start()
            render_config((MODEL_SOURCE / "config.pbtxt").read_text(), overrides)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    server = TritonServer(http_port=args.http_port, grpc_port=args.grpc_port, metrics_port=args.metrics_port,
                          openai_port=args.openai_port, overrides=overrides, workdir=args.workdir,
                          triton_root=args.tritonserver, model_repository=args.model_repository,
                          log_to_stdout=args.log_stdout, log_verbose=args.log_verbose)
    signals = ShutdownSignals().install()
    print("Starting tritonserver (loading the model takes a while) ...", flush=True)
    try:
        server.start(timeout_s=args.timeout, stop_requested=signals.stop_requested)
        signals.serving = True
        print(banner(server), flush=True)
        while signals.requested is None and server.process is not None and server.process.poll() is None:
            if server.openai_process is not None and server.openai_process.poll() is not None:
                print(f"the OpenAI front exited with code {server.openai_process.returncode}", file=sys.stderr)
                return 1
            time.sleep(0.2)
        if signals.requested is None:
            print(f"tritonserver exited with code {server.process.returncode if server.process else None}:\n"
                  f"{server.log_tail()}", file=sys.stderr)
            return 1
        print(f"Draining in-flight requests (up to {args.drain_timeout:g} s), then stopping tritonserver ...",
              flush=True)
        server.stop(drain_timeout_s=args.drain_timeout)
        return 0
    except ExitNow as exc:
        print(f"\n{exc}: exiting at once", file=sys.stderr, flush=True)
        return 130
    finally:
        server.kill()  # whatever happened above: no tritonserver, stub or shm region of ours outlives us
