"""Which device the engine runs on and how its regions compile: the one place that knows about Neuron.

Device choice: ``DEEPINFER_DEVICE=cpu|neuron|cuda`` wins; otherwise ``neuron`` when torch_neuronx imports and a
NeuronCore is visible (``NEURON_RT_VISIBLE_CORES`` or a ``/dev/neuron*`` node), else host mode (``cpu``).
Compile backend: ``DEEPINFER_COMPILE_BACKEND`` wins; otherwise ``neuron`` on Trainium and ``inductor`` on the
host. ``DEEPINFER_ENFORCE_EAGER=1`` keeps every region eager (debugging). ``DEEPINFER_NEURON_FP8_MAX`` is the
largest fp8 activation magnitude: 240 on Neuron (trn2 reads e4m3 as IEEE e4m3), 448 (float8_e4m3fn) elsewhere.

Environment variables are read once, here, before anything is traced: a region never reads them.
"""
from __future__ import annotations

import glob
import importlib
import importlib.util
import os
from collections.abc import Mapping
from dataclasses import dataclass

import torch

DEVICES = ("cpu", "neuron", "cuda")
COMPILE_BACKENDS = ("eager", "aot_eager", "inductor", "neuron")
HOST_BACKENDS = ("eager", "aot_eager", "inductor")
FP8_MAX_NEURON = 240.0  # IEEE e4m3 on trn2 (exponent 15 is inf / nan)
FP8_MAX_E4M3FN = 448.0  # float8_e4m3fn (OCP)


@dataclass(frozen=True)
class Platform:
    device_type: str  # one of DEVICES
    compile_backend: str  # one of COMPILE_BACKENDS; "eager" = no compile
    enforce_eager: bool  # DEEPINFER_ENFORCE_EAGER=1
    visible_cores: tuple[int, ...]  # NeuronCores this process may use (empty off Neuron)
    fp8_max: float  # activation quantization range
    backend_from_env: bool = False  # DEEPINFER_COMPILE_BACKEND was set: compiled regions were asked for

    @property
    def is_neuron(self) -> bool:
        return self.device_type == "neuron"

    @property
    def compiles(self) -> bool:
        """True when regions run as torch.compile graphs (not enforce-eager, backend not "eager")."""
        return not self.enforce_eager and self.compile_backend != "eager"

    @property
    def torch_device(self) -> torch.device:
        return torch.device("neuron", 0) if self.is_neuron else torch.device(self.device_type)


def _truthy(value: str | None, name: str) -> bool:
    if value is None or value == "":
        return False
    lowered = value.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{name} must be 0/1 (or true/false), got {value!r}")


def parse_core_list(spec: str) -> tuple[int, ...]:
    """``NEURON_RT_VISIBLE_CORES`` syntax: ``"0"``, ``"0-3"``, ``"0,2,5-6"`` -> sorted core ids."""
    cores: set[int] = set()
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        lo, sep, hi = part.partition("-")
        try:
            first, last = int(lo), int(hi) if sep else int(lo)
        except ValueError:
            raise ValueError(f"NEURON_RT_VISIBLE_CORES entry {part!r} must be an int or a range 'a-b'") from None
        if first < 0 or last < first:
            raise ValueError(f"NEURON_RT_VISIBLE_CORES range {part!r} must satisfy 0 <= a <= b")
        cores.update(range(first, last + 1))
    return tuple(sorted(cores))


def torch_neuronx_available() -> bool:
    """True when torch_neuronx is installed and imports (it registers the ``neuron`` device with torch)."""
    if importlib.util.find_spec("torch_neuronx") is None:
        return False
    importlib.import_module("torch_neuronx")
    return True


def _visible_cores(env: Mapping[str, str]) -> tuple[int, ...]:
    spec = env.get("NEURON_RT_VISIBLE_CORES", "")
    if spec.strip():
        return parse_core_list(spec)
    # No explicit binding: every device node the driver exposes (core count per device is not known here).
    return tuple(range(len(glob.glob("/dev/neuron[0-9]*"))))


def _device_type(env: Mapping[str, str], neuron_importable: bool, cores: tuple[int, ...]) -> str:
    forced = env.get("DEEPINFER_DEVICE", "").strip().lower()
    if forced:
        if forced not in DEVICES:
            raise ValueError(f"DEEPINFER_DEVICE must be one of {DEVICES}, got {forced!r}")
        if forced == "neuron" and not neuron_importable:
            raise ValueError("DEEPINFER_DEVICE=neuron but torch_neuronx is not installed (see docs/NEURON.md)")
        if forced == "cuda" and not torch.cuda.is_available():
            raise ValueError("DEEPINFER_DEVICE=cuda but torch sees no CUDA device")
        return forced
    return "neuron" if neuron_importable and cores else "cpu"


def detect_platform(env: Mapping[str, str] | None = None, neuron_importable: bool | None = None) -> Platform:
    """Resolve the platform from ``env`` (default: ``os.environ``); ``neuron_importable`` overrides the import probe."""
    env = os.environ if env is None else env
    if neuron_importable is None:
        neuron_importable = torch_neuronx_available()
    cores = _visible_cores(env) if neuron_importable else ()
    device = _device_type(env, neuron_importable, cores)
    backend_env = env.get("DEEPINFER_COMPILE_BACKEND", "").strip().lower()
    backend = backend_env or ("neuron" if device == "neuron"
                                                                             else "inductor")
    if backend not in COMPILE_BACKENDS:
        raise ValueError(f"DEEPINFER_COMPILE_BACKEND must be one of {COMPILE_BACKENDS}, got {backend!r}")
    if backend == "neuron" and device != "neuron":
        raise ValueError(f"DEEPINFER_COMPILE_BACKEND=neuron needs the neuron device, the platform is {device!r}")
    fp8_default = FP8_MAX_NEURON if device == "neuron" else FP8_MAX_E4M3FN
    fp8_text = env.get("DEEPINFER_NEURON_FP8_MAX", "").strip()
    fp8_max = float(fp8_text) if fp8_text else fp8_default
    if not 0.0 < fp8_max <= FP8_MAX_E4M3FN:
        raise ValueError(f"DEEPINFER_NEURON_FP8_MAX must be in (0, {FP8_MAX_E4M3FN}], got {fp8_text!r}")
    return Platform(
        device_type=device,
        compile_backend=backend,
        enforce_eager=_truthy(env.get("DEEPINFER_ENFORCE_EAGER"), "DEEPINFER_ENFORCE_EAGER"),
        visible_cores=cores if device == "neuron" else (),
        fp8_max=fp8_max,
        backend_from_env=bool(backend_env),
    )
