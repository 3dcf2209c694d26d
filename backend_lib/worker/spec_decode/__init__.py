"""Speculative decoding: proposers (n-gram prompt lookup, DeepSeek MTP, DSpark / DFlash block drafters) and the
rejection sampler that verifies their drafts losslessly (rejection.py)."""
from __future__ import annotations

import torch

from backend_lib.core.config import SpecConfig
from backend_lib.models.interfaces import capabilities_of
from backend_lib.worker.spec_decode.dspark import BlockDraftProposer
from backend_lib.worker.spec_decode.dspark_v41 import V41BlockDraftProposer
from backend_lib.worker.spec_decode.mtp import MTPProposer
from backend_lib.worker.spec_decode.mtp_v4 import V4MTPProposer


def make_mtp_proposer(model: torch.nn.Module, kv_caches: list[torch.Tensor], num_slots: int,
                      num_speculative_tokens: int, device: torch.device,
                      dtype: torch.dtype, share=None) -> MTPProposer | V4MTPProposer:
    """V4 (its MTP ring is part of the hybrid cache) or V3 (the proposer owns a latent cache of ``num_slots``)."""
    kind = capabilities_of(model).mtp
    if not kind:
        raise ValueError(f"spec_method 'mtp' needs a model that drafts with MTP layers (DeepSeek-V3 / V4 "
                         f"checkpoints); {type(model).__name__} has none: use spec_method 'ngram' or 'none'")
    if kind == "ring":
        return V4MTPProposer(model, kv_caches, num_speculative_tokens)
    return MTPProposer(model, num_slots, num_speculative_tokens, device, dtype, share)


def make_block_drafter(model: torch.nn.Module, spec: SpecConfig, num_slots: int, max_model_len: int,
                       device: torch.device, dtype: torch.dtype) -> BlockDraftProposer:
    """DeepSeek-V4.1 drafts with its checkpoint's mtp.* drafter; Llama-family targets with a DeepSpec directory."""
    if capabilities_of(model).checkpoint_drafter:
        return V41BlockDraftProposer(model, spec, num_slots, device, dtype)
    return BlockDraftProposer(model, spec, num_slots, max_model_len, device, dtype)
