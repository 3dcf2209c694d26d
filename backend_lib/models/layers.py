"""Building blocks shared by the model files: parameters are allocated empty (no random init) and filled by
``load_weights``; every forward is plain torch that a compiled region can trace."""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F
from torch import nn

from kernels.fused_layer_ops import silu_and_mul as fused_silu_and_mul
from kernels.gemv import TILE, GemvPolicy, block_weight, blocked_linear, blocked_linear_add, blocked_linear_silu_mul
from kernels.norm import rms_norm
from kernels.onednn_gemm import PackedWeight, packed_linear
from kernels.packed_embedding import packed_embedding
from kernels.packed_gemm import packed_kernels_available, packed_linear_buffers
from kernels.packed_weights import PackedWeight as QuantizedWeight
from kernels.rope import RopeScaling, apply_rope, rope_cos_sin_cache, rope_inv_freq


def _empty_param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


@dataclass(frozen=True)
class HostGemmPlan:
    """Which host GEMM layouts ``pack_for_cpu`` builds (backend_lib/worker/executor/rank.py picks from
    ``ModelConfig.host_gemm``). ``policy`` sends few-row calls to the blocked kernel, the rest to oneDNN where
    it is packed, else to ``F.linear``."""

    onednn: bool = True  # oneDNN's packed layout (kernels/onednn_gemm.py): fp32
    blocked: bool = True  # the few-row kernel's blocked layout (kernels/gemv.py): fp32 or bf16
    policy: GemvPolicy = field(default_factory=GemvPolicy)
    screen_head: bool = True  # greedy steps via a screened head (kernels/int8_head_screen.py, head_screen.py)


@dataclass(frozen=True)
class PackedExpertsSummary:
    """One MoE layer's routed experts held packed (weight_format=packed; DeepSeek-V3's fp8 tiles, V4's fp4 tiles),
    for the load log (``describe_weight_formats``)."""

    fmt: str  # kernels/packed_weights.py's format name: fp8_e4m3, fp4_e2m1
    num_experts: int  # this rank's
    weights: int
    nbytes: int  # codes and scales resident


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed: PackedWeight | None,
           blocked: torch.Tensor | None = None,
           policy: GemvPolicy = GemvPolicy()) -> torch.Tensor:  # x [T, in], weight [out, in] -> [T, out]
    """``blocked``: the weight in kernels.gemv's layout, a module buffer (compiled regions lift it as a graph
    input; the row count is static inside a graph, so the choice below is made once per graph)."""
    if blocked is not None and policy.use_blocked(x.shape[0]):
        return blocked_linear(x, blocked, bias, weight.shape[0])
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
        self.register_buffer("blocked", None, persistent=False)
        self.gemv_policy = GemvPolicy()
        # weight_format=packed: the checkpoint's quantized blocks (kernels/packed_weights.py); their tensors are
        # buffers so compiled regions take them as graph inputs
        self.quantized: QuantizedWeight | None = None
        self.register_buffer("quantized_data", None, persistent=False)
        self.register_buffer("quantized_scales", None, persistent=False)

    def set_quantized(self, weight: QuantizedWeight, path: str = "auto") -> None:
        """Keep ``weight`` (packed at load) as this projection's only copy: ``weight`` becomes an empty [0, in]
        placeholder, and every forward runs the packed GEMM on these bytes (its epilogues as separate ops)."""
        if (weight.out_features, weight.in_features) != (self.out_features, self.in_features):
            raise ValueError(f"packed weight [{weight.out_features}, {weight.in_features}] does not match the "
                             f"projection [{self.out_features}, {self.in_features}]")
        self.quantized = weight
        self.quantized_data, self.quantized_scales = weight.data, weight.scales
        self.quantized_kernel = packed_kernels_available()  # built and logged (instruction sets) at load
        self.quantized_path = path  # kernels/packed_gemm.py's path: auto, fp32 or int8
        self.weight = _empty_param(0, self.in_features, dtype=self.weight.dtype)

    def rebind_quantized(self) -> None:
        """After ``quantized_data`` moved (kernels/host_memory.py), the container holds the moved bytes, so the old
        copy is freed."""
        self.quantized = replace(self.quantized, data=self.quantized_data)

    def pack_for_cpu(self, plan: HostGemmPlan = HostGemmPlan()) -> None:
        """Host GEMMs on pre-packed weights, eagerly and in compiled regions: the blocked few-row kernel streams
        the weights near memory bandwidth at decode row counts; oneDNN's packed GEMM is about 2x MKL's sgemm at
        larger ones (same products, other summation orders). Keeps ``weight`` for state dicts and tied heads, so
        each layout is one more copy of the weight. A quantized projection keeps its packed GEMM alone."""
        if self.quantized is not None:
            return
        self.packed = PackedWeight(self.weight) if plan.onednn else None
        if plan.blocked:
            self.register_buffer("blocked", block_weight(self.weight), persistent=False)
        self.gemv_policy = plan.policy

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [T, in] -> [T, out]
        if self.quantized is not None:
            return packed_linear_buffers(x, self.quantized_data, self.quantized_scales, self.bias, self.quantized,
                                         self.quantized_kernel, self.quantized_path)
        return linear(x, self.weight, self.bias, self.packed, self.blocked, self.gemv_policy)

    def forward_add(self, x: torch.Tensor,  # [T, in]
                    residual: torch.Tensor) -> torch.Tensor:  # [T, out] -> [T, out]
        """``forward(x) + residual``; on the blocked kernel in one pass (the sum's output is written once)."""
        if self.blocked is not None and self.gemv_policy.use_blocked(x.shape[0]):
            return blocked_linear_add(x, self.blocked, self.bias, self.out_features, residual)
        return self.forward(x) + residual

    def forward_silu_mul(self, x: torch.Tensor) -> torch.Tensor:  # x [T, in] -> [T, out / 2]
        """``silu_and_mul(forward(x))`` for a [gate; up] projection; on the blocked kernel without storing the
        [T, out] product (needs no bias and out / 2 a multiple of its 16-row tiles), else the two steps."""
        half = self.out_features // 2
        if (self.blocked is not None and self.bias is None and half % TILE == 0
                and self.gemv_policy.use_blocked(x.shape[0])):
            return blocked_linear_silu_mul(x, self.blocked, half)
        return fused_silu_and_mul(self.forward(x))


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
        self.num_embeddings, self.embedding_dim = vocab_size, hidden_size
        self.weight = _empty_param(vocab_size, hidden_size, dtype=dtype)
        self.quantized: QuantizedWeight | None = None  # weight_format=packed: GGUF blocks (Linear.set_quantized)
        self.register_buffer("quantized_data", None, persistent=False)
        self.register_buffer("quantized_scales", None, persistent=False)  # a tied head's GEMM takes them

    def set_quantized(self, weight: QuantizedWeight, path: str = "auto") -> None:
        if (weight.out_features, weight.in_features) != (self.num_embeddings, self.embedding_dim):
            raise ValueError(f"packed embedding [{weight.out_features}, {weight.in_features}] does not match "
                             f"[{self.num_embeddings}, {self.embedding_dim}]")
        self.quantized = weight
        self.quantized_data, self.quantized_scales = weight.data, weight.scales
        self.quantized_kernel = packed_kernels_available()  # for a tied head's GEMM
        self.quantized_path = path
        self.weight = _empty_param(0, self.embedding_dim, dtype=self.weight.dtype)

    def rebind_quantized(self) -> None:  # as Linear.rebind_quantized
        self.quantized = replace(self.quantized, data=self.quantized_data)

    def lookup(self, input_ids: torch.Tensor) -> torch.Tensor:  # input_ids [T] int64 (local rows) -> [T, hidden]
        if self.quantized is not None:
            return packed_embedding(input_ids, self.quantized_data, self.quantized).to(self.weight.dtype)
        return F.embedding(input_ids, self.weight)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # input_ids [T] int64 -> [T, hidden]
        return self.lookup(input_ids)


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


def resident_weight_bytes(model: nn.Module) -> tuple[int, int]:
    """(weights, resident bytes) of a model's parameters and persistent buffers (DeepSeek's weights are buffers;
    a ``*scale*`` buffer adds bytes, no weights), quantized projections and embeddings at their packed size (the
    load log's bytes per weight; the host GEMMs' extra layouts, non-persistent buffers, are not counted)."""
    weights = resident = 0
    for module in model.modules():
        quantized = getattr(module, "quantized", None)
        if isinstance(quantized, QuantizedWeight):
            weights += quantized.out_features * quantized.in_features
            resident += quantized.nbytes
        if hasattr(module, "packed_experts_bytes"):  # packed routed experts: V3's fp8 tiles, V4's fp4 tiles
            more_weights, more_bytes = module.packed_experts_bytes()
            weights, resident = weights + more_weights, resident + more_bytes
        tensors = [(name, t) for name, t in module.named_parameters(recurse=False)]
        tensors += [(name, t) for name, t in module.named_buffers(recurse=False)
                    if t is not None and name not in module._non_persistent_buffers_set]
        for name, t in tensors:
            weights += 0 if "scale" in name else t.numel()
            resident += t.numel() * t.element_size()
    return weights, resident


def describe_weight_formats(model: nn.Module) -> str:
    """Every packed tensor group a model holds, its resident bytes and bytes per weight: 'q4_1 210 projections
    80.1 MB 0.625 B/w, fp8_e4m3 routed experts 2 layers x 16 experts 25.2 MB 1.004 B/w'."""
    projections: dict[str, list[QuantizedWeight]] = {}
    experts: dict[str, list[PackedExpertsSummary]] = {}
    for module in model.modules():
        quantized = getattr(module, "quantized", None)
        if isinstance(quantized, QuantizedWeight):
            projections.setdefault(quantized.fmt, []).append(quantized)
        summary = module.packed_experts_summary() if hasattr(module, "packed_experts_summary") else None
        if summary is not None:
            experts.setdefault(summary.fmt, []).append(summary)
    parts = []
    for fmt, weights in sorted(projections.items()):
        total, nbytes = sum(w.out_features * w.in_features for w in weights), sum(w.nbytes for w in weights)
        parts.append(f"{fmt} {len(weights)} projections {nbytes / 1e6:.1f} MB {nbytes / total:.3f} B/w")
    for fmt, layers in sorted(experts.items()):
        counts = sorted({layer.num_experts for layer in layers})
        per_layer = "/".join(str(n) for n in counts)  # MTP's or a rank's share may differ
        total, nbytes = sum(layer.weights for layer in layers), sum(layer.nbytes for layer in layers)
        parts.append(f"{fmt} routed experts {len(layers)} layers x {per_layer} experts {nbytes / 1e6:.1f} MB "
                     f"{nbytes / total:.3f} B/w")
    return ", ".join(parts) or "no quantized weights"


def copy_into(param: torch.Tensor, tensor: torch.Tensor, name: str) -> None:
    """Copy a checkpoint tensor into a parameter (or a row slice of one), converting dtype; shapes must match."""
    if tuple(param.shape) != tuple(tensor.shape):
        raise ValueError(f"weight {name!r}: checkpoint shape {tuple(tensor.shape)} does not match the model's "
                         f"{tuple(param.shape)}")
    with torch.no_grad():
        param.copy_(tensor.to(param.dtype))
