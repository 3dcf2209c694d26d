"""Load a model from a GGUF file or a Hugging Face directory (config.json + safetensors).

Both paths end the same way: the registry picks the class, ``from_hf_config`` builds it without weights, and
``load_weights`` consumes (Hugging Face name, tensor) pairs streamed under a progress bar.
"""
from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import torch
from safetensors import safe_open
from torch import nn
from tqdm import tqdm

from backend_lib.core.model_path import resolve_model_path
from backend_lib.models.loading.gguf_loader import open_gguf
from backend_lib.models.layers import describe_weight_formats, resident_weight_bytes
from backend_lib.models.interfaces import capabilities_of
from backend_lib.models.loading.options import LoadOptions
from backend_lib.models.loading.weight_format import WeightFormatChoice, choose_for_gguf, choose_for_hf
from backend_lib.models.parallel import ParallelContext
from backend_lib.models.registry import get_model_class

logger = logging.getLogger(__name__)

def _is_gguf(path: str) -> bool:
    if not os.path.isfile(path):
        return False
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def safetensors_files(directory: str) -> list[str]:
    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(directory, shard) for shard in shards]
    single = os.path.join(directory, "model.safetensors")
    if os.path.isfile(single):
        return [single]
    found = sorted(f for f in os.listdir(directory) if f.endswith(".safetensors"))
    if not found:
        raise ValueError(f"{directory}: no safetensors weights (model.safetensors or a sharded index); other "
                         "formats are not supported")
    return [os.path.join(directory, f) for f in found]


_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
                       "F8_E4M3": torch.float8_e4m3fn, "F8_E8M0": torch.float8_e8m0fnu, "I64": torch.int64,
                       "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                       "BOOL": torch.bool}


class LazyTensor:
    """A safetensors entry read on demand: ``narrow`` reads only the slice a tensor-parallel rank keeps, so no
    rank materialises the whole model; ``load`` reads it all. Same ``shape`` / ``dtype`` / ``narrow`` / ``to``
    surface as a torch tensor, so model loaders treat both alike."""

    def __init__(self, handle: Any, name: str) -> None:
        self._slice = handle.get_slice(name)
        self.name = name

    @property
    def shape(self) -> torch.Size:
        return torch.Size(self._slice.get_shape())

    @property
    def dtype(self) -> torch.dtype:
        stored = self._slice.get_dtype()
        if stored not in _SAFETENSORS_DTYPES:
            raise ValueError(f"checkpoint tensor {self.name!r} has unsupported dtype {stored}")
        return _SAFETENSORS_DTYPES[stored]

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        index = (slice(None),) * dim + (slice(start, start + length),)
        return self._slice[index]

    def load(self) -> torch.Tensor:
        # A 0-dim entry (a per-tensor scale such as llm-compressor's k_scale) takes no slice: an empty index reads it.
        return self._slice[()] if not self._slice.get_shape() else self._slice[:]

    def to(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.load().to(*args, **kwargs)


def iter_safetensors(files: list[str], progress: bool) -> Iterator[tuple[str, LazyTensor]]:
    """(name, lazy tensor) from every file: a model reads what its rank keeps (whole, or one shard)."""
    handles = [safe_open(f, framework="pt") for f in files]
    total = sum(len(h.keys()) for h in handles)
    with tqdm(total=total, desc="loading weights", unit="tensor", disable=not progress) as bar:
        for handle in handles:
            for name in handle.keys():
                yield name, LazyTensor(handle, name)
                bar.update(1)


def _log_choice(path: str, choice: WeightFormatChoice) -> None:
    logger.info("deepinfer: %s: %s weights (%s)", os.path.basename(path), choice.weight_format, choice.reason)


def _load_hf_directory(directory: str, options: LoadOptions, device: str) -> nn.Module:
    config_path = os.path.join(directory, "config.json")
    if not os.path.isfile(config_path):
        raise ValueError(f"{directory}: not a Hugging Face model directory (no config.json)")
    with open(config_path) as f:
        config = json.load(f)
    architectures = config.get("architectures") or []
    if not architectures:
        raise ValueError(f"{config_path}: 'architectures' is missing or empty")
    cls = get_model_class(architectures[0])
    packable = capabilities_of(cls).packed_weights
    choice = choose_for_hf(options, device, config, packable)
    _log_choice(directory, choice)
    options = replace(options, weight_format=choice.weight_format)
    if options.packed and not packable:
        raise ValueError(f"weight_format=packed: {directory} is a {architectures[0]} Hugging Face directory; packed "
                         "weights are wired for GGUF checkpoints (Q8_0 / Q4_0 / Q4_1 / Q4_K) and DeepSeek-V3 / V4 fp8 "
                         "projections only so far: use weight_format=dequantize")
    options = replace(options, checkpoint_dir=directory)
    model = cls.from_hf_config(config, options.dtype, options=options)
    model.load_weights(iter_safetensors(safetensors_files(directory), options.progress))
    if options.packed:
        _log_resident_bytes(model)
    return model


def _load_gguf(path: str, options: LoadOptions, device: str) -> nn.Module:
    checkpoint = open_gguf(path)
    choice = choose_for_gguf(options, device, checkpoint.reader.tensors)
    _log_choice(path, choice)
    options = replace(options, weight_format=choice.weight_format)
    model = get_model_class(checkpoint.architecture).from_hf_config(checkpoint.config, options.dtype, options=options)
    with tqdm(checkpoint.tensors(keep_blocks=options.packed), total=checkpoint.num_tensors, desc="loading GGUF",
              unit="tensor", disable=not options.progress) as tensors:
        model.load_weights(tensors)
    if options.packed:
        _log_resident_bytes(model)
    return model


def _log_resident_bytes(model: nn.Module) -> None:
    params, resident = resident_weight_bytes(model)
    logger.info("deepinfer: weight_format=packed: %d weights in %.1f MB resident, %.3f bytes per weight (%s)",
                params, resident / 1e6, resident / max(params, 1), describe_weight_formats(model))


def load_model(path: str, dtype: torch.dtype = torch.float32, progress: bool = True, *,
               dequantize_fp8_at_load: bool = False, par: ParallelContext | None = None,
               weight_format: str = "auto", packed_gemm_path: str = "auto",
               host_steps: bool = True, device: str = "cpu") -> nn.Module:
    """A ready model (eval mode) from a .gguf file or a Hugging Face directory; "" loads the bundled default.
    With ``par`` the model holds only that rank's shard; ``weight_format="packed"`` keeps GGUF blocks in memory,
    ``"auto"`` does for quantized checkpoints where the packed GEMMs run on ``device`` (weight_format.py)."""
    options = LoadOptions(dtype=dtype, progress=progress, dequantize_fp8_at_load=dequantize_fp8_at_load,
                          par=par or ParallelContext(), weight_format=weight_format,
                          packed_gemm_path=packed_gemm_path, host_steps=host_steps)
    resolved = resolve_model_path(path)
    if os.path.isdir(resolved):
        model = _load_hf_directory(resolved, options, device)
    elif _is_gguf(resolved):
        model = _load_gguf(resolved, options, device)
    else:
        raise ValueError(f"model path {resolved!r} is neither a GGUF file nor a directory with config.json")
    return model.eval()
