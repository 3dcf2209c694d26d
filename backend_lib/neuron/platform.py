"""Which device the engine runs on and how its regions compile: the one place that knows about Neuron.

Device choice, first that applies: ``DEEPINFER_DEVICE=cpu|neuron|cuda`` (a deployment's override); the ``device``
setting (``ModelConfig.device``, which the engine always passes); without either (tools), ``neuron`` when
torch_neuronx imports and a NeuronCore is visible (``NEURON_RT_VISIBLE_CORES`` or a ``/dev/neuron*`` node), else
host mode (``cpu``). The rank's tensors live on that device.
Compile backend: ``DEEPINFER_COMPILE_BACKEND`` wins; otherwise ``neuron`` on Trainium and ``inductor`` on the
host. ``DEEPINFER_ENFORCE_EAGER=1`` keeps every region eager (debugging).
fp8 limits, two: the largest activation magnitude the device represents (``fp8_max``: 240 on Neuron, where trn2
reads e4m3 as IEEE e4m3; 448, float8_e4m3fn, elsewhere) and the bound KV records and quantized activations are
saturated at (``kv_fp8_max``: 224 on Neuron, as the port quantizes; 448 elsewhere). ``DEEPINFER_NEURON_FP8_MAX``
sets both.

Built once per rank (worker/executor/rank.py) and passed down: environment variables are read here, before
anything is traced; a region never reads them.
"""
from __future__ import annotations

import glob
import importlib
import importlib.util
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from backend_lib.core import envs
from kernels.quant import FP8_MAX

DEVICES = ("cpu", "neuron", "cuda")
COMPILE_BACKENDS = ("eager", "aot_eager", "inductor", "neuron")
HOST_BACKENDS = ("eager", "aot_eager", "inductor")
FP8_MAX_NEURON = 240.0  # IEEE e4m3 on trn2 (exponent 15 is inf / nan)
KV_FP8_MAX_NEURON = 224.0  # the port's quantization bound on trn2, one e4m3 step below 240


@dataclass(frozen=True)
class Platform:
    device_type: str  # one of DEVICES
    compile_backend: str  # one of COMPILE_BACKENDS; "eager" = no compile
    enforce_eager: bool  # DEEPINFER_ENFORCE_EAGER=1
    visible_cores: tuple[int, ...]  # NeuronCores this process may use (empty off Neuron)
    fp8_max: float  # the largest fp8 activation magnitude
    kv_fp8_max: float  # KV records and quantized activations saturate here
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


def _visible_cores(env: Mapping[str, str] | None) -> tuple[int, ...]:
    spec = envs.read("NEURON_RT_VISIBLE_CORES", env)
    if spec:
        return parse_core_list(spec)
    # No explicit binding: every device node the driver exposes (core count per device is not known here).
    return tuple(range(len(glob.glob("/dev/neuron[0-9]*"))))


def _device_type(env: Mapping[str, str] | None, setting: str, neuron_importable: bool,
                 cores: tuple[int, ...]) -> str:
    forced = envs.read("DEEPINFER_DEVICE", env).lower()
    chosen, source = (forced, "DEEPINFER_DEVICE") if forced else (setting.strip().lower(), "device")
    if not chosen:
        return "neuron" if neuron_importable and cores else "cpu"
    if chosen not in DEVICES:
        raise ValueError(f"{source} must be one of {DEVICES}, got {chosen!r}")
    if chosen == "neuron" and not neuron_importable:
        raise ValueError(f"{source}=neuron but torch_neuronx is not installed (see docs/NEURON.md)")
    if chosen == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{source}=cuda but torch sees no CUDA device")
    return chosen


def detect_platform(env: Mapping[str, str] | None = None, neuron_importable: bool | None = None,
                    device: str = "") -> Platform:
    """Resolve the platform from ``env`` (default: this process's environment) and the ``device`` setting ("" =
    none); ``neuron_importable`` overrides the import probe."""
    if neuron_importable is None:
        neuron_importable = torch_neuronx_available()
    cores = _visible_cores(env) if neuron_importable else ()
    device = _device_type(env, device, neuron_importable, cores)
    backend_env = envs.read("DEEPINFER_COMPILE_BACKEND", env).lower()
    backend = backend_env or ("neuron" if device == "neuron"
                                                                             else "inductor")
    if backend not in COMPILE_BACKENDS:
        raise ValueError(f"DEEPINFER_COMPILE_BACKEND must be one of {COMPILE_BACKENDS}, got {backend!r}")
    if backend == "neuron" and device != "neuron":
        raise ValueError(f"DEEPINFER_COMPILE_BACKEND=neuron needs the neuron device, the platform is {device!r}")
    fp8_override = envs.read("DEEPINFER_NEURON_FP8_MAX", env)
    if fp8_override is not None and not 0.0 < fp8_override <= FP8_MAX:
        raise ValueError(f"DEEPINFER_NEURON_FP8_MAX must be in (0, {FP8_MAX:g}], got {fp8_override:g}")
    neuron = device == "neuron"
    return Platform(
        device_type=device,
        compile_backend=backend,
        enforce_eager=envs.read("DEEPINFER_ENFORCE_EAGER", env),
        visible_cores=cores if device == "neuron" else (),
        fp8_max=fp8_override or (FP8_MAX_NEURON if neuron else FP8_MAX),
        kv_fp8_max=fp8_override or (KV_FP8_MAX_NEURON if neuron else FP8_MAX),
        backend_from_env=bool(backend_env),
    )
