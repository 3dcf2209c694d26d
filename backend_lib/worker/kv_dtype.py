"""``kv_cache_dtype`` -> the element type the KV cache is allocated with, and the model switched to it.

"auto" keeps the model dtype. "fp8_e4m3" stores e4m3 codes as uint8 (kernels/kv_fp8.py) on the models that can
(``use_fp8_kv``: the Llama family's K/V, DeepSeek-V3's latent records, DeepSeek-V4's compressed entries and indexer
keys); every other model is refused at load with an error naming the setting, rather
than silently keeping a full-width cache the memory plan did not count. The largest stored magnitude is the
platform's ``kv_fp8_max`` (backend_lib/neuron/platform.py: 448 on the host, 224 on Neuron).
"""
from __future__ import annotations

import logging

import torch

from backend_lib.core.config import EngineConfig
from backend_lib.models.interfaces import capabilities_of
from backend_lib.neuron.platform import Platform

logger = logging.getLogger(__name__)


def kv_storage_dtype(config: EngineConfig, model: torch.nn.Module, dtype: torch.dtype,
                     platform: Platform) -> torch.dtype:
    """The KV cache's element type; with fp8 the model is switched to e4m3 K/V (and the choice logged)."""
    setting = config.cache.kv_cache_dtype
    if setting == "auto":
        return dtype
    if not capabilities_of(model).fp8_kv:
        raise ValueError(f"kv_cache_dtype={setting!r} is not supported for {type(model).__name__} yet (supported: "
                         f"Llama-family models, DeepSeek-V3 and V4); set kv_cache_dtype='auto'")
    source = model.use_fp8_kv(platform.kv_fp8_max)
    logger.info("KV cache dtype: %s (e4m3 codes, 1 B a value, saturated at +-%g); %s", setting,
                platform.kv_fp8_max, source)
    return torch.uint8
