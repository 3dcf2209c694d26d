"""``weight_format=auto`` (the default) resolved against the checkpoint: quantized files run ``packed``, float files
``dequantize`` (which for them is a plain load).

Packed is the default where it applies because it is both smaller and faster on the host (benchmarks/results/
quantized.md: SmolLM2 Q4_1 0.72 bytes a weight, not 4, and 1.4x / 3x dequantize's tokens/s at 32 / 1 streams with
``packed_gemm_path`` auto, which is int8 activations for GGUF, the fastest path measured, and fp32 widening for
DeepSeek's fp8 / fp4, the only one they have). It applies only where the packed GEMMs run: the host (device cpu,
not Neuron graphs), float32 / bfloat16 activations, a GGUF file with 2-D tensors in a type they read, or a
DeepSeek-V3 / V4 fp8 directory kept fp8 (not ``dequantize_fp8_at_load``).
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from backend_lib.models.loading.gguf_file import GGUFTensor
from backend_lib.models.loading.options import LoadOptions
from backend_lib.models.loading.quantized_blocks import PACKABLE_GGUF_TYPES

_PACKED_DTYPES = (torch.float32, torch.bfloat16)


@dataclass(frozen=True)
class WeightFormatChoice:
    weight_format: str  # "dequantize" or "packed": what the model classes get
    reason: str  # for the load log (no "weight_format=...": that line is the packed bytes' own, see loader.py)


def _auto(weight_format: str, why: str) -> WeightFormatChoice:
    return WeightFormatChoice(weight_format, f"weight_format auto: {why}")


def _host_refusal(options: LoadOptions, device: str) -> str | None:
    """Why this load cannot run packed GEMMs whatever the checkpoint; None when it can."""
    if device != "cpu":
        return f"device {device!r}: the packed GEMMs are host C++ kernels"
    if not options.host_steps:
        return "compile_backend=neuron: the packed GEMMs are host C++ kernels"
    if options.dtype not in _PACKED_DTYPES:
        return f"dtype {options.dtype}: the packed GEMMs take float32 or bfloat16 activations"
    return None


def choose_for_gguf(options: LoadOptions, device: str, tensors: Iterable[GGUFTensor]) -> WeightFormatChoice:
    if options.weight_format != "auto":
        return WeightFormatChoice(options.weight_format, "as set")
    packable = sorted({t.tensor_type.name for t in tensors if t.tensor_type in PACKABLE_GGUF_TYPES
                       and len(t.shape) == 2})
    if not packable:
        return _auto("dequantize", "no GGUF tensor in a type the packed GEMMs read")
    refusal = _host_refusal(options, device)
    if refusal:
        return _auto("dequantize", f"GGUF {'/'.join(packable)} but {refusal}")
    return _auto("packed", f"GGUF {'/'.join(packable)} tensors, packed_gemm_path={options.packed_gemm_path}")


def choose_for_hf(options: LoadOptions, device: str, config: dict[str, Any],
                  accepts_packed: bool) -> WeightFormatChoice:
    if options.weight_format != "auto":
        return WeightFormatChoice(options.weight_format, "as set")
    quant = config.get("quantization_config") or {}
    if quant.get("quant_method") != "fp8":
        return _auto("dequantize", "float checkpoint")
    if not accepts_packed:
        return _auto("dequantize", f"fp8 checkpoint of {config['architectures'][0]}, which has no packed weights")
    if options.dequantize_fp8_at_load:
        return _auto("dequantize", "fp8 checkpoint dequantized at load (dequantize_fp8_at_load)")
    refusal = _host_refusal(options, device)
    if refusal:
        return _auto("dequantize", f"fp8 checkpoint but {refusal}")
    return _auto("packed", f"fp8 checkpoint, packed_gemm_path={options.packed_gemm_path}")
