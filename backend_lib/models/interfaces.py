"""What a model offers the worker, declared by each model class (vLLM's models/interfaces.py in spirit): the worker
reads ``capabilities_of(model)`` instead of probing the model object for attributes.

A capability names the methods and attributes the model then brings. Some also depend on the checkpoint, which the
instance says: ``has_mtp_weights`` (the nextn depths are there), ``token_history`` (> 0 with Engram layers),
``has_hybrid_state`` and ``supports_context_parallel`` (DeepSeek-V3: hybrid only with Engram, and then no CP). A
setting that asks for a capability a model lacks is refused where the setting is applied, naming the setting
(kv_dtype.py, model_runner.py, spec_decode, loader.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

MTP_KINDS = ("", "latent", "ring")


@dataclass(frozen=True)
class ModelCapabilities:
    fp8_kv: bool = False  # use_fp8_kv(fp8_max) -> str: KV stored as e4m3 records (kv_cache_dtype=fp8_e4m3)
    hybrid_cache: bool = False  # hybrid_cache_shapes(...): fixed per-request state next to the paged blocks
    # spec_method=mtp: "latent" (DeepSeek-V3: the proposer keeps its own latent cache), "ring" (DeepSeek-V4:
    # mtp_window(caches), and keep_streams makes forward keep the pre-hc_head streams); "" = none.
    mtp: str = ""
    # token_history > 0 (Engram): the runner hands the model each token's preceding ids (meta.token_history); a
    # model that also compiles (static_moe) brings engram_gather(input_ids, token_history), the host-side gather
    engram: bool = False
    packed_weights: bool = False  # weight_format=packed from a Hugging Face directory (loader.py)
    context_parallel: bool = False  # attention over held blocks merged by log-sum-exp (models/context_parallel.py)
    splits_context_rows: bool = True  # False: every layer needs every row (V4's compressors), CP splits only the KV
    static_moe: bool = False  # set_moe_impl("static"): the fixed-shape MoE compiled regions need
    host_packing: bool = False  # pack_for_cpu(plan): the host GEMM layouts packed at load
    cpu_attention: bool = False  # use_cpu_attention(); host_fused then says whether eager steps run the C++ ops
    greedy_head_screen: bool = False  # greedy_token_ids(hidden[, bitmask]): greedy tokens without the logits
    rope_extension: bool = False  # cover_positions(max_model_len) -> bool: RoPE extended past the checkpoint's
    # spec_method=dspark / dflash: capture_layer_ids (set by the proposer) makes forward keep those layers' outputs
    # in captured_hidden [T, len(ids) * hidden] for a block drafter
    captures_hidden: bool = False
    # spec_method=dspark / dflash drafts with the checkpoint's own drafter (DeepSeek-V4.1's mtp.*, read from
    # speculative_model) instead of a DeepSpec drafter directory (worker/spec_decode/dspark_v41.py)
    checkpoint_drafter: bool = False
    # images in, text out: image_encoder (None when the checkpoint has no tower) turns a preprocessed image into its
    # span's input embeddings, and forward(..., embed_rows=InputEmbeddingRows) takes them in place of the ids' rows
    images: bool = False

    def __post_init__(self) -> None:
        if self.mtp not in MTP_KINDS:
            raise ValueError(f"ModelCapabilities.mtp must be one of {MTP_KINDS}, got {self.mtp!r}")


@dataclass(frozen=True)
class InputEmbeddingRows:
    """A step's rows whose input embedding is given (an image span's), not looked up from their ids."""

    rows: torch.Tensor  # [K] int64 row indices into the step's tokens
    embeddings: torch.Tensor  # [K, hidden]


class ServedModel(nn.Module):
    """The base of every model class the registry serves: its capabilities, and the per-instance answers' defaults
    for a model without them."""

    capabilities: ClassVar[ModelCapabilities] = ModelCapabilities()
    token_history: int = 0  # ids before each token the model reads (Engram)
    host_fused: bool = False
    has_mtp_weights: bool = False

    @property
    def has_hybrid_state(self) -> bool:
        return self.capabilities.hybrid_cache

    @property
    def supports_context_parallel(self) -> bool:
        return self.capabilities.context_parallel


def capabilities_of(model: nn.Module | type) -> ModelCapabilities:
    """A model's (or model class's) declared capabilities; none for a module that is not a ServedModel."""
    cls = model if isinstance(model, type) else type(model)
    return cls.capabilities if issubclass(cls, ServedModel) else ModelCapabilities()


def keeps_hybrid_state(model: nn.Module) -> bool:
    """Whether this model (instance: the checkpoint decides for DeepSeek-V3) keeps fixed per-request state next to
    its paged blocks (backend_lib/core/hybrid_kv.py)."""
    return capabilities_of(model).hybrid_cache and model.has_hybrid_state
