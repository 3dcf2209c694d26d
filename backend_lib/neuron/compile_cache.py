"""The compiled engine's persistent compile cache: one directory the engine owns, so that a second start loads its
graphs from disk instead of compiling them again.

Where: ``compile_cache_dir`` when set; else the environment's own cache variable when the user set it
(``TORCHINDUCTOR_CACHE_DIR`` on the host, ``NEURON_COMPILE_CACHE_URL`` on Neuron); else a per-user directory,
``$XDG_CACHE_HOME/deepinfer/compile`` (``~/.cache/deepinfer/compile``), not /tmp, which is cleaned at reboot and
shared between users.

Host (inductor): inductor's FX-graph cache and AOTAutograd cache (both on by default in torch >= 2.5) write under
``<dir>/inductor``. ``TORCHINDUCTOR_CACHE_DIR`` points there only while the regions compile (torch's own
``temporary_cache_dir``), then the process's previous value comes back: other torch.compile users in the same
process keep their cache. Keys: both caches hash the graph itself (the traced FX code, every input's shape, dtype
and stride, inductor's and functorch's config, the torch version and the host's ISA), so model, dtype, buckets, KV
pool size and torch version are in the key already; a changed setting compiles next to the old entries and never
loads a wrong graph. What stays on the warm path: dynamo tracing every region (the caches start below it), loading
each cached graph's module, and running it once.

Neuron: the NEFF cache of neuronx-cc under ``<dir>/neuron`` (``NEURON_COMPILE_CACHE_URL``), keyed by neuronx-cc on
the HLO module and the compiler flags and version. Set for the whole process, not scoped: torch-neuronx may read it
when it is imported or when it first compiles, and every neuronx-cc compile in an engine process is the engine's.
A ``--cache_dir`` in ``NEURON_CC_FLAGS`` is the user's choice and is left alone.
"""
from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from backend_lib.core import envs
from backend_lib.neuron.platform import Platform

INDUCTOR_ENV = "TORCHINDUCTOR_CACHE_DIR"
NEURON_ENV = "NEURON_COMPILE_CACHE_URL"
NEURON_CC_FLAGS_ENV = "NEURON_CC_FLAGS"
_CACHE_DIR_FLAG = re.compile(r"(?:^|\s)--cache_dir(=|\s+)(\S+)")


@dataclass(frozen=True)
class CompileCacheDir:
    """Where this engine's compiled graphs persist, and which setting chose it (for the start-up log)."""

    path: str  # the inductor or NEFF cache directory (a NEURON_COMPILE_CACHE_URL may also be an s3:// URL)
    source: str  # "compile_cache_dir", "default", or the environment variable that named it
    owned: bool  # the engine chose it (create it, point the compiler at it), rather than the user's environment

    def describe(self) -> str:
        return f"compile cache {self.path} ({self.source})"


def default_root(env: Mapping[str, str] | None = None) -> Path:
    """``$XDG_CACHE_HOME/deepinfer/compile``, ``~/.cache/deepinfer/compile`` without it."""
    base = envs.read("XDG_CACHE_HOME", env) or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "deepinfer" / "compile"


def _neuron_cc_cache_dir(env: Mapping[str, str] | None) -> str | None:
    match = _CACHE_DIR_FLAG.search(envs.read(NEURON_CC_FLAGS_ENV, env))
    return match.group(2) if match else None


def resolve_cache_dir(configured: str, platform: Platform, env: Mapping[str, str] | None = None) -> CompileCacheDir:
    """The cache directory of ``platform``'s compiler: ``<root>/neuron`` or ``<root>/inductor``, where the root is
    ``configured``, else the default; a cache the user's environment names wins over the default only."""
    configured = configured.strip()
    flag_dir = _neuron_cc_cache_dir(env) if platform.is_neuron else None
    if configured and flag_dir:
        raise ValueError(f"compile_cache_dir={configured!r} conflicts with --cache_dir={flag_dir} in "
                         f"{NEURON_CC_FLAGS_ENV}: set one of them")
    sub = "neuron" if platform.is_neuron else "inductor"
    if configured:
        return CompileCacheDir(str(Path(configured).expanduser().absolute() / sub), "compile_cache_dir", True)
    if flag_dir:
        return CompileCacheDir(flag_dir, NEURON_CC_FLAGS_ENV, False)
    name = NEURON_ENV if platform.is_neuron else INDUCTOR_ENV
    if envs.read(name, env):
        return CompileCacheDir(envs.read(name, env), name, False)
    return CompileCacheDir(str(default_root(env) / sub), "default", True)


def _prepare(path: str) -> None:
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise ValueError(f"compile_cache_dir: cannot create {path}: {e.strerror}") from e
    if not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(f"compile_cache_dir: {path} is not writable by this user")


@contextlib.contextmanager
def compile_cache_scope(configured: str, platform: Platform, backend: str) -> Iterator[CompileCacheDir | None]:
    """While the regions compile: the backend's persistent cache in the engine's directory (None for backends
    that cache nothing on disk: aot_eager, eager)."""
    if backend not in ("inductor", "neuron"):
        yield None
        return
    cache = resolve_cache_dir(configured, platform)
    if cache.owned:
        _prepare(cache.path)
    if backend == "neuron":
        if cache.owned:
            envs.export(NEURON_ENV, cache.path)
        yield cache
        return
    from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir

    with temporary_cache_dir(cache.path):
        yield cache


@dataclass(frozen=True)
class CacheUse:
    """What inductor's AOTAutograd cache did for one engine's graphs (a graph it bypasses is compiled at every
    start: the FX-graph cache under it then bypasses too)."""

    hits: int
    misses: int
    bypasses: int

    def describe(self) -> str:
        return f"{self.hits} cached, {self.misses} compiled and saved, {self.bypasses} not cacheable"


def _autograd_cache_counts() -> tuple[int, int, int]:
    from torch._dynamo.utils import counters

    aot = counters["aot_autograd"]
    return aot["autograd_cache_hit"], aot["autograd_cache_miss"], aot["autograd_cache_bypass"]


@contextlib.contextmanager
def count_cache_use() -> Iterator[list[CacheUse]]:
    """Yields a list that holds the block's CacheUse once it exits (torch's process-wide counters, as deltas)."""
    before = _autograd_cache_counts()
    out: list[CacheUse] = []
    yield out
    out.append(CacheUse(*(after - b for after, b in zip(_autograd_cache_counts(), before))))
