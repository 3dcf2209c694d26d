"""RMSNorm, computed in float32 and cast back (the transformers Llama convention, so fp32 runs match bit for bit)."""
from __future__ import annotations

import torch


def rms_norm(
    x: torch.Tensor,  # [..., hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
) -> torch.Tensor:  # [..., hidden], dtype of x
    input_dtype = x.dtype
    # Same operation order as transformers' LlamaRMSNorm: the variance in fp32, the weight applied after the cast.
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return weight * h.to(input_dtype)


def rms_norm_reference(
    x: torch.Tensor,  # [..., hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
) -> torch.Tensor:  # [..., hidden], dtype of x
    """The textbook formula in float64: x / sqrt(mean(x^2) + eps) * weight."""
    h = x.to(torch.float64)
    rms = torch.sqrt((h * h).sum(-1, keepdim=True) / h.shape[-1] + eps)
    return ((h / rms) * weight.to(torch.float64)).to(x.dtype)
