"""``kv_cache_dtype`` -> the element type the KV cache is allocated with, and the model switched to it.

"auto" keeps the model dtype. "fp8_e4m3" stores e4m3 codes as uint8 (kernels/kv_fp8.py) on the models that can
(``use_fp8_kv``: the Llama family's K/V, DeepSeek-V3's latent records, DeepSeek-V4's compressed entries and indexer
keys); every other model is refused at load with an error naming the setting, rather
than silently keeping a full-width cache the memory plan did not count. The largest stored magnitude is the
device's: 448 (float8_e4m3fn) on the host, 224 on Neuron (trn2's e4m3 tops out at 240, and the port quantizes KV
and activations to 224); ``DEEPINFER_NEURON_FP8_MAX`` overrides it on either.
"""
from __future__ import annotations

import logging
from collections.abc import Mapping

import torch

from backend_lib.core import envs
from backend_lib.core.config import EngineConfig
from kernels.kv_fp8 import FP8_E4M3_MAX

logger = logging.getLogger(__name__)

KV_FP8_MAX_NEURON = 224.0


def kv_fp8_max(device_type: str, env: Mapping[str, str] | None = None) -> float:
    """The e4m3 saturation bound for this device (see the module docstring)."""
    value = envs.read("DEEPINFER_NEURON_FP8_MAX", env)
    if value is not None:
        if not 0.0 < value <= FP8_E4M3_MAX:
            raise ValueError(f"DEEPINFER_NEURON_FP8_MAX must be in (0, {FP8_E4M3_MAX}], got {value:g}")
        return value
    return KV_FP8_MAX_NEURON if device_type == "neuron" else FP8_E4M3_MAX


def kv_storage_dtype(config: EngineConfig, model: torch.nn.Module, dtype: torch.dtype) -> torch.dtype:
    """The KV cache's element type; with fp8 the model is switched to e4m3 K/V (and the choice logged)."""
    setting = config.cache.kv_cache_dtype
    if setting == "auto":
        return dtype
    if not hasattr(model, "use_fp8_kv"):
        raise ValueError(f"kv_cache_dtype={setting!r} is not supported for {type(model).__name__} yet (supported: "
                         f"Llama-family models, DeepSeek-V3 and V4); set kv_cache_dtype='auto'")
    fp8_max = kv_fp8_max(torch.device(config.model.device).type)
    source = model.use_fp8_kv(fp8_max)
    logger.info("KV cache dtype: %s (e4m3 codes, 1 B a value, saturated at +-%g); %s", setting, fp8_max, source)
    return torch.uint8
