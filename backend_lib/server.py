"""`deepinfer serve`: run a real tritonserver with the DeepInfer model, no Docker needed.

The nvidia-pytriton wheel carries tritonserver 2.51, libtritonserver and the Python backend. We copy its
``tritonserver/`` folder once into a cache dir, put the stub for this interpreter's Python version into
``backends/python/``, and launch ``bin/tritonserver`` with LD_LIBRARY_PATH holding the wheel's bundled
libraries and this interpreter's lib dir (the stub links libpython), and DEEPINFER_SITE_DIRS holding the
project and this environment's site-packages, which model.py puts on sys.path (the stub's Python runs
isolated and does not know our venv).
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

MODEL_NAME = "deepinfer"
_STOP_FILE_GRACE_S = 1.0  # the model polls the stop file every 0.5 s
PROJECT_ROOT = Path(__file__).resolve().parents[1]
MODEL_SOURCE = PROJECT_ROOT / "model_repository" / MODEL_NAME


def cache_dir() -> Path:
    base = os.environ.get("DEEPINFER_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "deepinfer")
    return Path(base)


@dataclass(frozen=True)
class TritonInstall:
    root: Path
    libs: Path  # the wheel's bundled shared libraries (nvidia_pytriton.libs)

    @property
    def binary(self) -> Path:
        return self.root / "bin" / "tritonserver"

    @property
    def backends(self) -> Path:
        return self.root / "backends"


def prepare_tritonserver(dest: Path | None = None) -> TritonInstall:
    """Copy tritonserver + the Python backend out of the nvidia-pytriton wheel (once per Python version)."""
    try:
        import pytriton
    except ImportError as exc:
        raise RuntimeError("nvidia-pytriton is not installed: pip install -e '.[serve]'") from exc
    package = Path(pytriton.__file__).resolve().parent
    source = package / "tritonserver"
    libs = package.parent / "nvidia_pytriton.libs"
    version = f"{sys.version_info[0]}.{sys.version_info[1]}"
    stub = source / "python_backend_stubs" / version / "triton_python_backend_stub"
    if not stub.exists():
        raise RuntimeError(f"nvidia-pytriton has no Python backend stub for Python {version} ({stub})")
    root = (dest or cache_dir()) / f"tritonserver-py{version}"
    stamp = root / ".complete"
    if not stamp.exists():
        if root.exists():
            shutil.rmtree(root)
        partial = root.with_name(root.name + f".partial-{os.getpid()}")
        shutil.copytree(source, partial, ignore=shutil.ignore_patterns("python_backend_stubs", "__pycache__"))
        shutil.copy2(stub, partial / "backends" / "python" / "triton_python_backend_stub")
        (partial / ".complete").write_text(str(source) + "\n")
        try:
            partial.rename(root)
        except OSError:  # another process finished first: use theirs
            shutil.rmtree(partial)
    return TritonInstall(root=root, libs=libs)


_PARAMETER_LINE = re.compile(r'^(parameters \{ key: "(\w+)" value: \{ string_value: ")([^"]*)(" \} \})$', re.M)


def render_config(template: str, overrides: dict[str, str]) -> str:
    """Set the string value of existing ``parameters`` lines of config.pbtxt; unknown names are errors."""
    known = {m.group(2) for m in _PARAMETER_LINE.finditer(template)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ValueError(f"unknown model parameter {unknown[0]!r} (allowed: {', '.join(sorted(known))})")
    for name, value in overrides.items():
        if '"' in value or "\\" in value or "\n" in value:
            raise ValueError(f"model parameter {name} must not contain quotes, backslashes or newlines: {value!r}")

    def replace(match: re.Match) -> str:
        name = match.group(2)
        return match.group(1) + overrides.get(name, match.group(3)) + match.group(4)

    return _PARAMETER_LINE.sub(replace, template)


def write_model_repository(dest: Path, overrides: dict[str, str]) -> Path:
    """A model repository at ``dest`` with our model and config.pbtxt carrying ``overrides``."""
    model_dir = dest / MODEL_NAME
    (model_dir / "1").mkdir(parents=True, exist_ok=True)
    shutil.copy2(MODEL_SOURCE / "1" / "model.py", model_dir / "1" / "model.py")
    config = render_config((MODEL_SOURCE / "config.pbtxt").read_text(), overrides)
    (model_dir / "config.pbtxt").write_text(config)
    return dest


def server_env(install: TritonInstall, base: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    python_lib = sysconfig.get_config_var("LIBDIR") or ""
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (str(install.libs), python_lib,
                                                         env.get("LD_LIBRARY_PATH", "")) if p)
    # The stub's Python runs isolated (no PYTHONPATH); model.py adds these itself, ahead of its own site-packages.
    site = [str(PROJECT_ROOT), sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]
    env["DEEPINFER_SITE_DIRS"] = os.pathsep.join(dict.fromkeys(site))
    # Worker ranks (tensor parallelism) are started from the stub, whose sys.executable is not a Python.
    env["DEEPINFER_PYTHON"] = sys.executable
    return env


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class TritonServer:
    """One tritonserver process serving our model; ``start`` waits until the model is READY."""

    http_port: int = 8000
    grpc_port: int = 8001
    metrics_port: int = 8002
    overrides: dict[str, str] = field(default_factory=dict)
    workdir: Path | None = None  # model repository + log; a temporary dir when None
    log_verbose: int = 0
    exit_timeout_s: int = 30  # how long Triton lets in-flight requests finish on shutdown before unloading
    process: subprocess.Popen | None = None
    log_path: Path | None = None
    stop_file: Path | None = None  # created on stop(): the model then aborts in-flight requests
    openai_port: int | None = None  # the OpenAI-compatible front (backend_lib/openai_api) listens here when set
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

    def start(self, timeout_s: float = 600.0) -> "TritonServer":
        install = prepare_tritonserver()
        work = self.workdir or Path(tempfile.mkdtemp(prefix="deepinfer-serve-"))
        repo = write_model_repository(work / "models", self.overrides)
        self.log_path = work / "tritonserver.log"
        command = [str(install.binary), f"--model-repository={repo}", f"--backend-directory={install.backends}",
                   f"--http-port={self.http_port}", f"--grpc-port={self.grpc_port}",
                   f"--metrics-port={self.metrics_port}", "--allow-metrics=true", "--allow-cpu-metrics=true",
                   f"--log-verbose={self.log_verbose}", f"--exit-timeout-secs={self.exit_timeout_s}",
                   "--exit-on-error=true", "--strict-readiness=true"]
        self.stop_file = work / "stopping"
        self.stop_file.unlink(missing_ok=True)
        env = server_env(install)
        env["DEEPINFER_STOP_FILE"] = str(self.stop_file)
        with open(self.log_path, "ab") as log:
            # Own process group: stop() signals tritonserver and its Python stub together.
            self.process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            self._wait_ready(timeout_s)
            if self.openai_port is not None:
                self._start_openai_front(work)
        except BaseException:
            self.stop()
            raise
        return self

    def _start_openai_front(self, work: Path) -> None:
        """The OpenAI front as a child that dies with this process (parent-death signal), once Triton is ready."""
        command = [sys.executable, "-m", "backend_lib.openai_api", f"--port={self.openai_port}",
                   f"--grpc-url={self.grpc_url}", f"--triton-model={MODEL_NAME}", f"--parent-pid={os.getpid()}"]
        # Not tritonserver's environment: its LD_LIBRARY_PATH holds the wheel's bundled libraries.
        front_env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            p for p in (str(PROJECT_ROOT), os.environ.get("PYTHONPATH", "")) if p))
        with open(work / "openai.log", "ab") as log:
            self.openai_process = subprocess.Popen(command, env=front_env, stdout=log, stderr=subprocess.STDOUT,
                                                   stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.openai_process.poll() is not None:
                raise RuntimeError(f"the OpenAI front exited with code {self.openai_process.returncode}; log "
                                   f"{work / 'openai.log'}:\n{(work / 'openai.log').read_text(errors='replace')[-4000:]}")
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

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"tritonserver exited with code {self.process.returncode} before the model "
                                   f"was ready; log {self.log_path}:\n{self.log_tail()}")
            if self.is_ready():
                return
            time.sleep(0.5)
        raise TimeoutError(f"model {MODEL_NAME} not ready within {timeout_s:.0f} s; log {self.log_path}:\n"
                           f"{self.log_tail()}")

    def stop(self, timeout_s: float = 60.0) -> int | None:
        """Stop file (the model aborts in-flight requests), SIGINT (Triton unloads the model), SIGKILL after
        ``timeout_s``."""
        self._stop_openai_front()  # first: its clients' requests end before Triton goes
        process = self.process
        if process is None:
            return None
        if process.poll() is None:
            if self.stop_file is not None:
                # Triton unloads a decoupled model only after its streams end: let the model end them first.
                self.stop_file.touch()
                time.sleep(_STOP_FILE_GRACE_S)
            self._signal_group(process, signal.SIGINT)
            try:
                process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self._signal_group(process, signal.SIGKILL)
                process.wait(timeout=30)
        # The stub may outlive a killed server: end what is left of the group we started.
        self._signal_group(process, signal.SIGKILL)
        self.process = None
        return process.returncode

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
        *([f"  OpenAI   {server.openai_url}   (/models, /completions, /chat/completions)"] if server.openai_url else []),
        "Try:",
        f"  curl -s http://{server.http_url}/v2/models/{MODEL_NAME}/generate -d '{chat}'",
        f"  curl -sN http://{server.http_url}/v2/models/{MODEL_NAME}/generate_stream -d '{stream}'",
        *([f"  curl -s {server.openai_url}/chat/completions -H 'Content-Type: application/json' -d "
           f"'{openai_chat}'"] if server.openai_url else []),
        f"Log: {server.log_path}   Stop: Ctrl-C",
    ])


def main(argv: list[str] | None = None) -> int:
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
    parser.add_argument("--log-verbose", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds to wait for the model to load")
    args = parser.parse_args(argv)

    overrides = _parse_overrides(args.param)
    if args.model is not None:
        overrides["model"] = str(Path(args.model).expanduser().resolve())
    server = TritonServer(http_port=args.http_port, grpc_port=args.grpc_port, metrics_port=args.metrics_port,
                          openai_port=args.openai_port, overrides=overrides, workdir=args.workdir, log_verbose=args.log_verbose)
    print("Starting tritonserver (loading the model takes a while) ...", flush=True)
    try:
        server.start(timeout_s=args.timeout)
        print(banner(server), flush=True)
        while server.process is not None and server.process.poll() is None:
            if server.openai_process is not None and server.openai_process.poll() is not None:
                print(f"the OpenAI front exited with code {server.openai_process.returncode}", file=sys.stderr)
                return 1
            time.sleep(0.5)
        print(f"tritonserver exited with code {server.process.returncode if server.process else None}:\n"
              f"{server.log_tail()}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\nStopping tritonserver ...", flush=True)
        return 0
    finally:
        server.stop()
