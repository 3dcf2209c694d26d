"""``LoadOptions``: the loader's knobs a model class reads in ``from_hf_config(..., options=)``.

Its own module so that the model classes and the loader both import it downward: the loader picks a class through
the registry, and the classes never import the loader.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from backend_lib.models.parallel import ParallelContext

_LOAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class LoadOptions:
    """Loader-level knobs, handed to ``from_hf_config(..., options=)`` so a model class can read them."""

    dtype: torch.dtype = torch.float32
    progress: bool = True
    dequantize_fp8_at_load: bool = False  # float8 checkpoints: dequantize to ``dtype`` instead of keeping fp8
    # The steps run on the host (not in Neuron graphs): DeepSeek-V3's fp8 routed experts are then widened once at
    # load under weight_format=dequantize; on the device they stay fp8 (a TP=64 rank's memory plan counts 1 byte a
    # weight, and the static MoE widens inside the graph)
    host_steps: bool = True
    par: ParallelContext = field(default_factory=ParallelContext)  # which shard this rank loads
    # "packed": quantized checkpoint tensors stay in their blocks (ModelConfig.weight_format); "auto" is resolved
    # by the loader (weight_format.py) before a model class sees the options
    weight_format: str = "auto"
    packed_gemm_path: str = "auto"  # ModelConfig.packed_gemm_path: auto, fp32 or int8
    checkpoint_dir: str = ""  # set by the loader: files beside the weights a model may read (Engram's tokenizer)

    def __post_init__(self) -> None:
        if self.dtype not in _LOAD_DTYPES:
            raise ValueError(f"load dtype must be one of {_LOAD_DTYPES}, got {self.dtype}")
        if self.weight_format not in ("auto", "dequantize", "packed"):
            raise ValueError(f"weight_format must be 'auto', 'dequantize' or 'packed', got {self.weight_format!r}")

    @property
    def packed(self) -> bool:
        return self.weight_format == "packed"
