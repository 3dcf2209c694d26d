"""Where `deepinfer serve` gets tritonserver and the model repository it serves.

tritonserver: by default the nvidia-pytriton wheel's (tritonserver 2.51, libtritonserver and the Python backend).
We copy its ``tritonserver/`` folder once into a cache dir, put the stub for this interpreter's Python version into
``backends/python/``, and tritonserver runs with LD_LIBRARY_PATH holding the wheel's bundled libraries and this
interpreter's lib dir (the stub links libpython). Or an installed Triton (``--tritonserver /opt/tritonserver`` in
NVIDIA's images, whose libraries are on the loader's path already), which must hold the Python backend and a stub
built for this interpreter's Python.

The model repository: written from model_repository/ with ``--param`` overrides in config.pbtxt, or the user's own
(``--model-repository``: the Docker image's /models). Either way DEEPINFER_SITE_DIRS holds the project and this
environment's site-packages, which model.py puts on sys.path (the stub's Python runs isolated and does not know
our venv).
"""
from __future__ import annotations

import os
import re
import shutil
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from backend_lib.core import envs
from backend_lib.core.processes import PROJECT_ROOT

MODEL_NAME = "deepinfer"
MODEL_SOURCE = PROJECT_ROOT / "model_repository" / MODEL_NAME
STUB = Path("backends") / "python" / "triton_python_backend_stub"


def cache_dir() -> Path:
    base = envs.read("DEEPINFER_CACHE") or os.path.join(
        envs.read("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "deepinfer")
    return Path(base)


@dataclass(frozen=True)
class TritonInstall:
    root: Path
    libs: Path | None  # the wheel's bundled shared libraries (nvidia_pytriton.libs); None: on the loader's path

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
        raise RuntimeError("nvidia-pytriton is not installed: pip install -e '.[serve]' (or pass --tritonserver "
                           "with an installed Triton)") from exc
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
        shutil.copy2(stub, partial / STUB)
        (partial / ".complete").write_text(str(source) + "\n")
        try:
            partial.rename(root)
        except OSError:  # another process finished first: use theirs
            shutil.rmtree(partial)
    return TritonInstall(root=root, libs=libs)


def installed_tritonserver(root: Path) -> TritonInstall:
    """An installed Triton at ``root`` (bin/tritonserver, backends/python with its stub)."""
    install = TritonInstall(root=root, libs=root / "lib" if (root / "lib").is_dir() else None)
    for needed in (install.binary, root / STUB):
        if not needed.is_file():
            raise ValueError(f"--tritonserver {root}: no {needed.relative_to(root)} there (a Triton install holds "
                             f"bin/tritonserver and the Python backend in backends/python)")
    return install


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


def checked_model_repository(repository: Path) -> Path:
    """The user's repository, once it holds our model (Triton would only say it failed to load it)."""
    for needed in (Path(MODEL_NAME) / "config.pbtxt", Path(MODEL_NAME) / "1" / "model.py"):
        if not (repository / needed).is_file():
            raise ValueError(f"--model-repository {repository}: no {needed} there (the model is served as "
                             f"'{MODEL_NAME}'; model_repository/ in the project is the template)")
    return repository.resolve()


def server_env(install: TritonInstall, base: dict[str, str] | None = None) -> dict[str, str]:
    env = envs.child_env(base)
    python_lib = sysconfig.get_config_var("LIBDIR") or ""
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (str(install.libs or ""), python_lib,
                                                         env.get("LD_LIBRARY_PATH", "")) if p)
    # The stub's Python runs isolated (no PYTHONPATH); model.py adds these itself, ahead of its own site-packages.
    site = [str(PROJECT_ROOT), sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]
    env["DEEPINFER_SITE_DIRS"] = os.pathsep.join(dict.fromkeys(site))
    # Worker ranks (tensor parallelism) are started from the stub, whose sys.executable is not a Python.
    env["DEEPINFER_PYTHON"] = sys.executable
    return env
