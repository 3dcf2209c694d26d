"""GEMMs that read quantized weights in their packed bytes (kernels/csrc/packed_gemm.cpp): y [rows, out] =
x [rows, in] @ W^T (+ bias) for W a ``PackedWeight`` (kernels/packed_weights.py: fp8 e4m3 block-scaled, fp4 e2m1,
GGUF Q8_0 / Q4_0 / Q4_1 / Q4_K), for decode row counts (any count is correct).

Paths (``path``):

- ``fp32``: the weights widened to fp32 in registers, exactly the values ``PackedWeight.dequantize`` gives, FMA with
  the fp32 activations: ``packed_linear_reference`` up to summation order (every format).
- ``int8`` (GGUF only): each activation row quantized per 32 inputs to int8 (d = amax / 127, round half to even:
  llama.cpp's Q8 activation blocks), integer dot products (VNNI ``vpdpbusd``, or ``vpmaddubsw`` without VNNI) and
  the block scales applied to the int32 sums: ``packed_linear_int8_reference`` up to summation order, which
  differs from the fp32 reference by the activations' rounding alone: ``|err| <= int8_error_bound`` (half a
  quantization step per input, times |W|).
- ``auto``: ``int8`` for GGUF (faster than widening at 1 and 32 rows on the AVX2 machine measured,
  benchmarks/results/quantized_kernels.md), ``fp32`` for fp8 / fp4.

The instruction set is the CPU's best (picked at run time from its flags and logged at load): fp32 path AVX-512 >
AVX2 > plain C++; int8 path AVX512_VNNI > AVX-VNNI > AVX-512 (vpmaddubsw) > AVX2 (vpmaddubsw) > plain C++.
``isa`` forces one (tests). The op is a dispatcher op with a fake kernel: compiled regions keep it as one opaque
call. Without the C++ build (no compiler), ``packed_linear`` runs the torch reference, with a warning.
"""
from __future__ import annotations

import functools
import logging

import torch

from kernels.cpu_kernels import load_packed_kernels
from kernels.packed_weights import PackedGGUF, PackedWeight

logger = logging.getLogger(__name__)

PATHS = ("auto", "fp32", "int8")
ISAS = ("avx512_vnni", "avx_vnni", "avx512", "avx2", "scalar")  # best first
INT8_BLOCK = 32  # activation inputs per int8 scale


@functools.cache
def packed_kernels_available() -> bool:
    """True once the C++ ops are built and loaded; logs the instruction sets each path runs here."""
    if not load_packed_kernels():
        logger.warning("deepinfer: packed GEMMs run the torch reference (dequantize, then matmul): the C++ "
                       "build failed")
        return False
    best = supported_isas()[0]
    widen = {"avx512_vnni": "avx512", "avx_vnni": "avx2"}.get(best, best)
    dot = {"avx512_vnni": "vpdpbusd zmm", "avx_vnni": "vpdpbusd ymm", "avx512": "vpmaddubsw zmm",
           "avx2": "vpmaddubsw ymm", "scalar": "plain C++"}[best]
    logger.info("deepinfer: packed GEMMs: fp32 path %s, int8 path %s (%s)", widen, best, dot)
    return True


def supported_isas() -> list[str]:
    """The instruction sets this CPU runs the packed GEMMs with, best first."""
    return torch.ops.deepinfer.packed_linear_isas().split(",")


def packed_linear(x: torch.Tensor,  # [rows, in] float32 or bfloat16
                  weight: PackedWeight,
                  bias: torch.Tensor | None = None,  # [out]
                  path: str = "auto",
                  isa: str = "auto") -> torch.Tensor:  # [rows, out], x's dtype
    if path not in PATHS:
        raise ValueError(f"packed_linear: path must be one of {PATHS}, got {path!r}")
    if not packed_kernels_available():
        if path == "int8":
            return packed_linear_int8_reference(x, weight, bias)
        return packed_linear_reference(x, weight, bias)
    return torch.ops.deepinfer.packed_linear(x, weight.data, weight.scales, bias, weight.fmt, weight.out_features,
                                             list(weight.block), path, isa)


def packed_linear_buffers(x: torch.Tensor,  # [rows, in] float32 or bfloat16
                          data: torch.Tensor,  # PackedWeight.data, a module buffer
                          scales: torch.Tensor,  # PackedWeight.scales, a module buffer
                          bias: torch.Tensor | None,  # [out]
                          weight: PackedWeight,
                          kernel: bool,
                          path: str = "auto") -> torch.Tensor:  # [rows, out]
    """``packed_linear`` on the module's buffers (compiled regions take buffers as graph inputs; ``weight``
    supplies the format and sizes only). ``kernel``: ``packed_kernels_available()`` as the caller found it at
    load (a cached check that compiled regions cannot trace); False runs the torch reference."""
    if not kernel:
        if path == "int8" or (path == "auto" and isinstance(weight, PackedGGUF)):
            return packed_linear_int8_reference(x, weight, bias)
        return packed_linear_reference(x, weight, bias)
    return torch.ops.deepinfer.packed_linear(x, data, scales, bias, weight.fmt, weight.out_features,
                                             list(weight.block), path, "auto")


def packed_linear_reference(x: torch.Tensor, weight: PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Plain torch: dequantize the whole weight, then matmul in fp32 (``weight_format=dequantize``'s function)."""
    y = x.float() @ weight.dequantize().T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The int8 path's activation blocks in torch: (q int8 [rows, in], d fp32 [rows, in / 32], sum int32
    [rows, in / 32]); the kernel's own, bit for bit (the same fp32 operations; round half to even)."""
    rows, cols = x.shape
    if cols % INT8_BLOCK:
        raise ValueError(f"quantize_activations: in ({cols}) must be a multiple of {INT8_BLOCK}")
    blocks = x.float().reshape(rows, cols // INT8_BLOCK, INT8_BLOCK)
    d = blocks.abs().amax(dim=-1) / 127
    inv = torch.where(d != 0, 1 / torch.where(d != 0, d, 1), 0)
    q = torch.round(blocks * inv[..., None]).to(torch.int8)
    return q.reshape(rows, cols), d, q.to(torch.int32).sum(dim=-1, dtype=torch.int32)


def dequantize_activations(q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:  # -> [rows, in] float32
    return (q.float().reshape(*d.shape, INT8_BLOCK) * d[..., None]).reshape(q.shape)


def packed_linear_int8_reference(x: torch.Tensor, weight: PackedWeight,
                                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """The int8 path's function: the reference on the rounded activations ``d * q``."""
    if not isinstance(weight, PackedGGUF):
        raise ValueError(f"the int8 path is for GGUF weights, not {weight.fmt}")
    q, d, _ = quantize_activations(x)
    return packed_linear_reference(dequantize_activations(q, d), weight, bias).to(x.dtype)


def int8_error_bound(x: torch.Tensor, weight: PackedWeight, dequantized: torch.Tensor | None = None,
                     rel_slack: float = 1e-5) -> torch.Tensor:
    """[rows, out]: a bound on |int8 path - packed_linear_reference| from the activations' rounding: each input
    moves by at most half its block's step d / 2, so output o moves by at most sum_k |W[o, k]| d_k / 2; plus
    ``rel_slack`` * (|x| @ |W|^T) for the fp32 sums' order (either side)."""
    w = weight.dequantize() if dequantized is None else dequantized
    _, d, _ = quantize_activations(x)
    step = d.repeat_interleave(INT8_BLOCK, dim=1)  # [rows, in]
    return 0.5 * step @ w.abs().T + rel_slack * (x.float().abs() @ w.abs().T)
