"""Few-row GEMM on weights blocked once at load (kernels/csrc/gemv.cpp): y [T, out] = x [T, in] @ W^T (+ bias).

A decode step with a few rows is a stream over the weights; the blocked layout makes each thread's share one
contiguous stream (no per-call packing), so the kernel reads the weights near the machine's read bandwidth where
MKL's and oneDNN's GEMMs stop at roughly half of it. The blocked weight is a plain dense tensor, so it is an
ordinary module buffer: compiled regions take it as a graph input and keep ``deepinfer::blocked_linear`` (a C++
dispatcher op with a fake kernel) as one opaque call, on any torch version. Weights: fp32, or bf16 with fp32 or
bf16 activations (output in the activations' dtype).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.cpu_kernels import load_cpu_kernels

TILE = 16  # output rows per tile (one 64-byte fp32 vector per k)


@dataclass(frozen=True)
class GemvPolicy:
    """Which row counts take the blocked kernel; the others take oneDNN's packed GEMM where it holds the weight,
    else ``F.linear`` (for bf16, torch's own bf16 GEMM, AMX or avx512_bf16 where the CPU has them).

    ``for_host`` picks ``max_rows`` from the crossovers measured over SmolLM2 shapes (quiet
    2-core Xeon, family 6 model 167, SmolLM2's 30 layers streamed from memory, 2 threads): fp32, the blocked
    kernel beat oneDNN's packed fp32 GEMM at every decode row count (1.43x at 1 row, 1.33x at 32, 1.14x at 128;
    its 16-wide register tiles keep the FMAs busy where oneDNN's fp32 kernel does not), so it takes up to 128
    rows and chunked prefills stay on oneDNN; bf16 on AMX, the kernel's own AMX passes (kernels/csrc/gemm_amx.cpp,
    from 2 rows) took 0.65-0.70x oneDNN's time from 1 to 32 rows, 0.82x at 64, 0.89x at 128, par at 256-512,
    so 128 there too. bf16 with ``vdpbf16ps`` but no AMX (quiet 2-core Zen 4, family 25 model 17,
    benchmarks/bf16_gemm.py): the kernel's vdpbf16ps passes took 0.61x oneDNN's bf16 time at 1 row, 0.81x at 16,
    0.89x at 32, 0.97x at 128-512, so 128 there as well; bf16 without either (weights widened by shifts), 16
    (not measured on such a CPU)."""

    max_rows: int | None = 16  # None: every row count (host_gemm "gemv")

    def __post_init__(self) -> None:
        if self.max_rows is not None and self.max_rows < 1:
            raise ValueError(f"GemvPolicy.max_rows must be >= 1 or None, got {self.max_rows}")

    @classmethod
    def for_host(cls, dtype: torch.dtype) -> "GemvPolicy":
        if dtype == torch.float32:
            return cls(max_rows=128)
        if dtype == torch.bfloat16 and not (torch.cpu._is_amx_tile_supported()
                                            or torch.cpu._is_avx512_bf16_supported()):
            return cls(max_rows=16)
        return cls(max_rows=128)

    def use_blocked(self, rows: int) -> bool:
        return self.max_rows is None or rows <= self.max_rows


def gemv_available(device: torch.device, dtype: torch.dtype) -> bool:
    """The kernel runs on the host CPU for fp32 and bf16 weights, once the C++ ops are built."""
    return device.type == "cpu" and dtype in (torch.float32, torch.bfloat16) and load_cpu_kernels()


def block_weight(weight: torch.Tensor) -> torch.Tensor:  # weight [out, in] -> blocked
    """fp32 -> [ceil(out/16), in, 16]: tile t, step k holds W[16t:16t+16, k], one vector per k.
    bf16 -> [ceil(out/16), ceil(in/2), 32]: lane r of step p holds (W[16t+r, 2p], W[16t+r, 2p+1]), the pair
    layout of vdpbf16ps. Rows past ``out`` and the column past an odd ``in`` are zeros."""
    if weight.dim() != 2:
        raise ValueError(f"block_weight: weight must be [out, in], got shape {tuple(weight.shape)}")
    if weight.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"block_weight: weight dtype must be float32 or bfloat16, got {weight.dtype}")
    out_features, in_features = weight.shape
    tiles = -(-out_features // TILE)
    pair = 2 if weight.dtype == torch.bfloat16 else 1
    padded_in = -(-in_features // pair) * pair
    padded = F.pad(weight.detach(), (0, padded_in - in_features, 0, tiles * TILE - out_features))
    # [tiles, 16, in / pair, pair] -> [tiles, in / pair, 16, pair]
    blocked = padded.reshape(tiles, TILE, padded_in // pair, pair).permute(0, 2, 1, 3)
    return blocked.reshape(tiles, padded_in // pair, TILE * pair).contiguous()


def unblock_weight(blocked: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:  # -> [out, in]
    """The inverse of ``block_weight`` (tests, and rebuilding a plain copy if one is ever needed)."""
    pair = blocked.shape[2] // TILE
    tiles, steps = blocked.shape[0], blocked.shape[1]
    plain = blocked.reshape(tiles, steps, TILE, pair).permute(0, 2, 1, 3).reshape(tiles * TILE, steps * pair)
    return plain[:out_features, :in_features].contiguous()


def blocked_linear(x: torch.Tensor,  # [T, in] float32 or bfloat16
                   blocked: torch.Tensor,  # from block_weight
                   bias: torch.Tensor | None,  # [out]
                   out_features: int,
                   isa: str = "auto") -> torch.Tensor:  # [T, out], x's dtype
    """``isa`` forces a code path ("amx_bf16", "avx512_bf16", "avx512", "avx2", "scalar"; tests); "auto" is the best
    the CPU has: for bf16 x bf16 from 2 rows, AMX tiles where the CPU has them and ``in`` is a multiple of 32."""
    return torch.ops.deepinfer.blocked_linear(x, blocked, bias, out_features, isa)


def blocked_linear_float(x: torch.Tensor,  # [T, in]
                         blocked: torch.Tensor,  # from block_weight
                         out_features: int,
                         isa: str = "auto") -> torch.Tensor:  # [T, out] float32
    """``blocked_linear(x, blocked, None, out_features).float()`` to the bit in one pass (a bf16 head's fp32
    logits)."""
    return torch.ops.deepinfer.blocked_linear_float(x, blocked, out_features, isa)


def blocked_linear_argmax(x: torch.Tensor,  # [T, in]
                          blocked: torch.Tensor,  # from block_weight
                          out_features: int,
                          isa: str = "auto") -> torch.Tensor:  # [T] int64
    """``row_argmax(blocked_linear_float(x, blocked, out_features))`` to the index, the logits never stored (a
    greedy step's head where no screen applies)."""
    return torch.ops.deepinfer.blocked_linear_argmax(x, blocked, out_features, isa)


def blocked_linear_add(x: torch.Tensor,  # [T, in]
                       blocked: torch.Tensor,  # from block_weight
                       bias: torch.Tensor | None,  # [out]
                       out_features: int,
                       residual: torch.Tensor,  # [T, out], x's dtype
                       isa: str = "auto") -> torch.Tensor:  # [T, out]
    """``blocked_linear(...) + residual`` in one pass over the output, to the bit (a layer's last projection and its
    residual add)."""
    return torch.ops.deepinfer.blocked_linear_add(x, blocked, bias, out_features, residual, isa)


def blocked_linear_silu_mul(x: torch.Tensor,  # [T, in]
                            blocked: torch.Tensor,  # block_weight of the [gate; up] weight [2 * I, in]
                            intermediate: int,  # I, a multiple of TILE
                            isa: str = "auto") -> torch.Tensor:  # [T, I]
    """``silu_and_mul(blocked_linear(x, blocked, None, 2 * I))`` to the bit, without storing the [T, 2 * I]
    product: each pass pairs gate tile j with up tile j."""
    return torch.ops.deepinfer.blocked_linear_silu_mul(x, blocked, intermediate, isa)


def kernel_isa() -> str:
    """The instruction set the kernel picked on this CPU."""
    return torch.ops.deepinfer.blocked_linear_isa()
