"""Every environment variable the engine reads, in one typed table, and the only module that touches
``os.environ`` (vLLM's ``envs.py`` in spirit; tests/core/test_envs.py fails on a read anywhere else in backend_lib/
or kernels/). docs/CONFIGURATION.md#environment-variables documents each one.

A value is read when asked for, not at import: a test or a launcher that sets a variable before building an engine
is seen, and each reader decides when to read (the platform once per rank, before anything is traced). Every reader
takes an optional mapping instead of the process environment, so tests pass a dict rather than patch the process.
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


@dataclass(frozen=True)
class EnvVar:
    name: str
    kind: type  # str, int, float or bool: what read() returns when the variable is set
    default: str | int | float | bool | None  # what read() returns when it is unset or empty
    meaning: str


VARIABLES: tuple[EnvVar, ...] = (
    EnvVar("DEEPINFER_DEVICE", str, "", "cpu | neuron | cuda: the device, over the `device` setting"),
    EnvVar("DEEPINFER_COMPILE_BACKEND", str, "",
           "inductor | aot_eager | neuron | eager; when set, turns compiled regions on without `compile_backend`"),
    EnvVar("DEEPINFER_ENFORCE_EAGER", bool, False, "1: every region stays eager (debugging)"),
    EnvVar("DEEPINFER_NEURON_FP8_MAX", float, None,
           "both fp8 limits at once: activations (default 240 Neuron, 448 host) and KV / quantization (224, 448)"),
    EnvVar("NEURON_RT_VISIBLE_CORES", str, "", "NeuronCores of this process (`0`, `0-3`, `0,2`)"),
    EnvVar("NEURON_CC_FLAGS", str, "", "neuronx-cc flags; a `--cache_dir` there is the NEFF cache"),
    EnvVar("NEURON_COMPILE_CACHE_URL", str, "", "the NEFF cache when `compile_cache_dir` is unset"),
    EnvVar("TORCHINDUCTOR_CACHE_DIR", str, "", "inductor's cache when `compile_cache_dir` is unset"),
    EnvVar("XDG_CACHE_HOME", str, "", "root of the per-user caches (default ~/.cache)"),
    EnvVar("DEEPINFER_CACHE", str, "", "where `deepinfer serve` installs Triton (default $XDG_CACHE_HOME/deepinfer)"),
    EnvVar("DEEPINFER_PYTHON", str, "",
           "the interpreter for child processes (set by `deepinfer serve`: the Triton stub is not a Python)"),
    EnvVar("DEEPINFER_FAULT_STEP", int, 0, "tests: the engine step whose model run raises (0 = off)"),
    EnvVar("DEEPINFER_FAULT_KIND", str, "fatal", "tests: fatal | transient, the injected fault"),
    EnvVar("LOCAL_RANK", int, None, "set by torchrun: a worker's rank on its node (multi-node workers)"),
    EnvVar("PYTHONPATH", str, "", "child processes get the project root first on it"),
    EnvVar("DEEPINFER_SITE_DIRS", str, "",
           "set by `deepinfer serve`, read by model.py: the site directories the stub's Python adds"),
    EnvVar("DEEPINFER_STOP_FILE", str, "", "read by model.py: a file whose appearance stops the engine (tests)"),
)


def variable(name: str) -> EnvVar:
    for var in VARIABLES:
        if var.name == name:
            return var
    raise KeyError(f"{name} is not in backend_lib/core/envs.py's VARIABLES: declare (and document) it first")


def _parse(var: EnvVar, text: str) -> str | int | float | bool:
    if var.kind is bool:
        if text.lower() in _TRUE:
            return True
        if text.lower() in _FALSE:
            return False
        raise ValueError(f"{var.name} must be 0/1 (or true/false), got {text!r}")
    if var.kind in (int, float):
        try:
            return var.kind(text)
        except ValueError:
            raise ValueError(f"{var.name} must be {'an integer' if var.kind is int else 'a number'}, "
                             f"got {text!r}") from None
    return text


def read(name: str, env: Mapping[str, str] | None = None) -> str | int | float | bool | None:
    """``name``'s value (stripped, parsed to its kind) from ``env`` (default: this process's environment); the
    table's default when unset or empty. A malformed value raises ValueError naming the variable."""
    var = variable(name)
    text = (os.environ if env is None else env).get(name, "").strip()
    return _parse(var, text) if text else var.default


def required(name: str, env: Mapping[str, str] | None = None) -> str | int | float | bool:
    """Like read(), for a variable whoever started this process must have set (torchrun's LOCAL_RANK)."""
    value = read(name, env)
    if value is None or value == "":
        raise ValueError(f"{name} is not set ({variable(name).meaning})")
    return value


def child_env(base: Mapping[str, str] | None = None, pythonpath_first: tuple[str, ...] = (),
              **overrides: str) -> dict[str, str]:
    """A copy of ``base`` (default: this process's environment) for a child process, with ``overrides`` and
    ``pythonpath_first`` ahead of the inherited PYTHONPATH (so the child imports this checkout)."""
    env = dict(os.environ if base is None else base)
    env.update(overrides)
    if pythonpath_first:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (*pythonpath_first, env.get("PYTHONPATH", "")) if p)
    return env


def export(name: str, value: str) -> None:
    """Set ``name`` for this process and its children (the NEFF cache: torch-neuronx reads it when it compiles)."""
    variable(name)
    os.environ[name] = value
