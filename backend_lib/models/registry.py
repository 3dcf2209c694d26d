"""Architecture name -> model class. Classes are imported on first use so one model's imports never load another's.

To add a model: one line in ``_ARCHITECTURES`` (module, class name). GGUF files name their architecture with
llama.cpp's ``general.architecture``; ``_GGUF_ARCHITECTURES`` maps it to the Hugging Face name.
"""
from __future__ import annotations

import importlib
from types import MappingProxyType

_ARCHITECTURES = MappingProxyType({
    "LlamaForCausalLM": ("backend_lib.models.llama.model", "LlamaForCausalLM"),
    "MistralForCausalLM": ("backend_lib.models.llama.model", "LlamaForCausalLM"),
    "DeepseekV3ForCausalLM": ("backend_lib.models.deepseek_v3.model", "DeepseekV3ForCausalLM"),
    "DeepseekV4ForCausalLM": ("backend_lib.models.deepseek_v4.model", "DeepseekV4ForCausalLM"),
    "DeepseekV41ForCausalLM": ("backend_lib.models.deepseek_v41.model", "DeepseekV41ForCausalLM"),
})

_GGUF_ARCHITECTURES = MappingProxyType({
    "llama": "LlamaForCausalLM",
})


def supported_architectures() -> list[str]:
    return sorted(_ARCHITECTURES)


def get_model_class(architecture: str) -> type:
    if architecture not in _ARCHITECTURES:
        raise ValueError(f"unsupported model architecture {architecture!r}; supported: {supported_architectures()}")
    module_name, class_name = _ARCHITECTURES[architecture]
    return getattr(importlib.import_module(module_name), class_name)


def architecture_for_gguf(gguf_arch: str) -> str:
    if gguf_arch not in _GGUF_ARCHITECTURES:
        raise ValueError(f"unsupported GGUF architecture {gguf_arch!r}; supported: {sorted(_GGUF_ARCHITECTURES)}")
    return _GGUF_ARCHITECTURES[gguf_arch]
