"""Where the C++ host kernels' libraries live, and how they are built: once at install (``python -m kernels.build``,
which ``make install`` and the Dockerfile run) or, where that step was skipped, on first use.

Why torch's extension cache, warmed by the install, and not an ahead-of-time setuptools ``CppExtension``:
- one build path: the install and a first use build the same library with the same flags under the same name, so
  the engine never meets two builds of one source;
- a library's name is a digest of what went into it (sources, headers, compiler flags, torch and Python versions),
  so editing a source (in an editable checkout) names a new library and rebuilds it: a stale library cannot load,
  where an in-place ``build_ext`` .so stays until someone reruns pip;
- each CPU builds for its own instruction set (the flags follow ``torch.backends.cpu.get_cpu_capability()``), where
  a wheel built ahead of time carries the build machine's.
A library that exists is loaded with ``torch.ops.load_library`` alone: run time needs neither a compiler nor ninja
(torch's own ``cpp_extension.load`` re-runs ninja and probes the compiler on every load). Its cost: the cache lives
under ``TORCH_EXTENSIONS_DIR`` (default ``~/.cache/torch_extensions``), so another user, a cleared cache or another
CPU builds again on first use, which then needs the compiler.
"""
from __future__ import annotations

import hashlib
import logging
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

# torch.backends.cpu.get_cpu_capability() -> compiler flags (x86-64; anything else builds for the baseline). Not
# -march=native: a cache on a shared volume never meets a CPU that lacks the instructions its name promises.
_ISA_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512dq", "-mavx512bw", "-mavx512vl", "-mavx2", "-mfma"],
    "AVX2": ["-mavx2", "-mfma"],
}


@dataclass(frozen=True)
class ExtensionSpec:
    """One C++ extension: its sources and the headers they include (both in its digest)."""

    stem: str  # the library's name before its capability and digest
    sources: tuple[Path, ...]
    headers: tuple[Path, ...]

    @property
    def cflags(self) -> list[str]:
        # -fopenmp: at::parallel_for's OpenMP body lives in the headers; the process's libgomp (torch's) serves it.
        return ["-O3", "-fopenmp", *_ISA_FLAGS.get(torch.backends.cpu.get_cpu_capability(), [])]

    @property
    def name(self) -> str:
        """``stem_capability_digest``: a change to any input names another library."""
        inputs = [torch.__version__, f"{sys.version_info.major}.{sys.version_info.minor}", *self.cflags]
        digest = hashlib.sha1("\0".join(inputs).encode()
                              + b"".join(path.read_bytes() for path in [*self.sources, *self.headers]))
        return f"{self.stem}_{torch.backends.cpu.get_cpu_capability().lower()}_{digest.hexdigest()[:10]}"


def build_directory(spec: ExtensionSpec) -> Path:
    from torch.utils import cpp_extension

    return Path(cpp_extension._get_build_directory(spec.name, verbose=False))


def library_path(spec: ExtensionSpec) -> Path:
    return build_directory(spec) / f"{spec.name}.so"


def missing_build_tools() -> list[str]:
    """What a build needs and this machine lacks, each with how to get it; [] when a build can start."""
    from torch.utils import cpp_extension

    missing = []
    compiler = cpp_extension.get_cxx_compiler()  # torch's own choice (CXX, else c++): the one its build calls
    if shutil.which(compiler) is None:
        missing.append(f"a C++ compiler ({compiler!r} is not on PATH; set CXX, or e.g. `apt-get install g++`)")
    if not cpp_extension.is_ninja_available():
        missing.append("ninja (the `ninja` Python package, a dependency of deepinfer: `pip install ninja`)")
    return missing


def load_extension(spec: ExtensionSpec) -> Path:
    """Loads the extension's ops into ``torch.ops``, building the library first when this machine has none for
    these inputs; raises what the build or the load raised."""
    path = library_path(spec)
    if path.is_file():
        try:
            torch.ops.load_library(str(path))
            return path
        except OSError as exc:  # half written by a build running beside us: torch's build below waits on its lock
            logger.warning("deepinfer: could not load %s (%s); building it", path, exc)
    from torch.utils import cpp_extension

    _remove_stale_build_lock(path.parent)
    started = time.perf_counter()
    logger.warning("deepinfer: building the C++ kernels %s (run `python -m kernels.build` at install to do this "
                   "once); this takes a minute or two", spec.name)
    cpp_extension.load(name=spec.name, sources=[str(source) for source in spec.sources], is_python_module=False,
                       verbose=False, extra_cflags=spec.cflags, extra_ldflags=["-fopenmp"])
    logger.info("deepinfer: built %s in %.0f s", path, time.perf_counter() - started)
    return path


def _build_running_in(directory: Path) -> bool:
    """Whether a process works in ``directory`` (ninja and the compilers run there). Linux's /proc only; elsewhere
    False, and the age rule alone decides."""
    for cwd in Path("/proc").glob("[0-9]*/cwd"):
        try:
            if cwd.readlink() == directory:
                return True
        except OSError:  # the process ended, or is another user's
            continue
    return False


def _remove_stale_build_lock(directory: Path, stale_after_s: float = 600.0) -> None:
    """torch's build lock has no owner: a build killed midway leaves it, and every later load waits on it forever.
    A build takes seconds to a minute; a lock older than ``stale_after_s`` is such a leftover, unless a compiler
    still runs there (on a loaded 2-core machine a build took 15 minutes, and a second build started beside it
    clobbered its objects)."""
    lock = directory / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return
    if age > stale_after_s and not _build_running_in(directory.resolve()):
        logger.warning("deepinfer: removing a stale C++ build lock (%.0f s old): %s", age, lock)
        lock.unlink(missing_ok=True)
