"""Building blocks shared by the model files: parameters are allocated empty (no random init) and filled by
``load_weights``; every forward is plain torch that a compiled region can trace."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels.norm import rms_norm
from kernels.onednn_gemm import PackedWeight, packed_linear
from kernels.rope import RopeScaling, apply_rope, rope_cos_sin_cache, rope_inv_freq


def _empty_param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           packed: PackedWeight | None) -> torch.Tensor:  # x [T, in], weight [out, in] -> [T, out]
    if packed is None:
        return F.linear(x, weight, bias)
    return packed_linear(x, weight, bias, packed)


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = _empty_param(out_features, in_features, dtype=dtype)
        self.bias = _empty_param(out_features, dtype=dtype) if bias else None
        self.packed: PackedWeight | None = None

    def pack_for_cpu(self) -> None:
        """Use oneDNN's packed-weight GEMM on the host: about 2x MKL's sgemm at decode batch sizes on this
        machine (same products, another summation order), eagerly and in compiled regions. Keeps ``weight``
        for state dicts and tied heads."""
        self.packed = PackedWeight(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [T, in] -> [T, out]
        return linear(x, self.weight, self.bias, self.packed)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = _empty_param(hidden_size, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [T, hidden]
        return rms_norm(x, self.weight, self.eps)


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = _empty_param(vocab_size, hidden_size, dtype=dtype)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # input_ids [T] int64 -> [T, hidden]
        return F.embedding(input_ids, self.weight)


class RotaryEmbedding(nn.Module):
    """Holds the cos/sin table (fp32, not saved in state dicts); applies RoPE to q and k by position."""

    def __init__(self, head_dim: int, theta: float, scaling: RopeScaling | None, max_positions: int) -> None:
        super().__init__()
        cos, sin = rope_cos_sin_cache(rope_inv_freq(head_dim, theta, scaling), max_positions)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(
        self,
        positions: torch.Tensor,  # [T] int64
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, Hkv, D]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return apply_rope(q, self.cos, self.sin, positions), apply_rope(k, self.cos, self.sin, positions)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:  # x [T, 2 * I] = [gate | up] -> [T, I]
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def copy_into(param: torch.Tensor, tensor: torch.Tensor, name: str) -> None:
    """Copy a checkpoint tensor into a parameter (or a row slice of one), converting dtype; shapes must match."""
    if tuple(param.shape) != tuple(tensor.shape):
        raise ValueError(f"weight {name!r}: checkpoint shape {tuple(tensor.shape)} does not match the model's "
                         f"{tuple(param.shape)}")
    with torch.no_grad():
        param.copy_(tensor.to(param.dtype))
