"""oneDNN's packed-weight GEMM for the host CPU, usable both eagerly and inside compiled regions.

oneDNN's packed fp32 GEMM runs about 2x MKL's sgemm at decode batch sizes on the host, but its packed weight is
an opaque ``mkldnn``-layout tensor that torch.compile cannot turn into a fake tensor, so it cannot be a graph
input (and inductor's own prepacking needs frozen weights: one packed copy per graph). ``PackedWeight`` wraps it
as a reference-type opaque object and ``onednn_linear`` is a custom op taking it, so a compiled region calls the
same kernel on the same packed weight as the eager path: one copy, and the same products in both.

bf16 weights pack the same way: oneDNN runs them on AMX tiles or AVX512-BF16 dot products where the CPU has them
(fp32 accumulation, the output rounded to bf16, as torch's own bf16 ``F.linear``, whose result it equals), and
emulates bf16 on plain AVX-512. Without AVX-512 oneDNN has no bf16 GEMM, so such a model keeps ``F.linear``.
SmolLM2 shapes on the Xeon (AMX) host, one thread, packed bf16 against packed fp32 / plain bf16 F.linear:
head 49152x576 at 1 row 2.9 ms against 8.9 / 6.0, at 32 rows 4.3 ms against 23.6 / 9.0; gate/up 3072x576 at
32 rows 0.31 ms against 1.05 / 0.44 (cache-warm, one matrix at a time). Every SmolLM2 GEMM of a step in turn, so
that weights stream from memory (shared machine): 1 row 72 ms against 133 / 117, 32 rows 177 ms against 324 / 234.
"""
from __future__ import annotations

import torch

try:  # opaque objects for custom ops: torch >= 2.10
    from torch._library.opaque_object import register_opaque_type
    from torch._opaque_base import OpaqueBase
except ImportError:  # older torch (e.g. torch-neuronx's): packed weights stay on the eager path
    register_opaque_type = None
    OpaqueBase = object


def _refuse_unpickle(shape: tuple[int, ...], dtype: str) -> "PackedWeight":
    raise TypeError(f"a PackedWeight ({shape}, {dtype}) cannot be unpickled: pack the weight again in this process")


class PackedWeight(OpaqueBase):
    """A [out, in] weight reordered into oneDNN's blocked layout; a black box to torch.compile."""

    def __init__(self, weight: torch.Tensor) -> None:  # weight [out, in]
        # The batch hint only picks the blocked layout; any number of rows works with the packed weight.
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 32)
        self.shape, self.dtype = tuple(weight.shape), weight.dtype

    def __reduce__(self):
        """Inductor's FX-graph and AOTAutograd caches key a graph by pickling its inputs, this opaque one too;
        pickling the mkldnn tensor inside fails and made them bypass every graph with a packed GEMM (recompiled
        at each start). A graph input's value arrives at run time, so the key needs only what the graph sees:
        the weight's shape and dtype. No mkldnn tensor ever pickled, so unpickling was never possible: it
        still fails, now with a message."""
        return _refuse_unpickle, (self.shape, str(self.dtype))


if register_opaque_type is not None:
    register_opaque_type(PackedWeight, typ="reference")


def onednn_gemm_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``PackedWeight`` and ``packed_linear`` serve this device and weight dtype."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.float32:
        return True
    # oneDNN's bf16 GEMM needs AVX-512 (native with AVX512-BF16 / AMX, emulated otherwise).
    return dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def native_bf16_gemm() -> bool:
    """Whether this CPU multiplies bf16 in hardware (AVX512-BF16 or AMX), for logs and benchmark reports."""
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


def _register_custom_op():
    @torch.library.custom_op("deepinfer::onednn_linear", mutates_args=())
    def onednn_linear(x: torch.Tensor,  # [T, in]
                      weight: torch.Tensor,  # [out, in]: only its shape is read (by the fake kernel)
                      bias: torch.Tensor | None,  # [out]
                      packed: PackedWeight) -> torch.Tensor:  # [T, out]
        return torch.ops.mkldnn._linear_pointwise(x, packed.packed, bias, "none", [], "")

    @onednn_linear.register_fake
    def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed: PackedWeight) -> torch.Tensor:
        return x.new_empty(x.shape[0], weight.shape[0])

    return onednn_linear


onednn_linear = _register_custom_op() if register_opaque_type is not None else None


def packed_linear(x: torch.Tensor,  # [T, in]
                  weight: torch.Tensor,  # [out, in]
                  bias: torch.Tensor | None,  # [out]
                  packed: PackedWeight) -> torch.Tensor:  # [T, out]
    """Eagerly the kernel itself (a custom op's Python dispatch costs ~10 us a call, ~1 ms a SmolLM2 step);
    under torch.compile the custom op, which the graph keeps as one opaque call."""
    if torch.compiler.is_compiling():
        if onednn_linear is None:  # no opaque objects in this torch: the graph takes the plain weight
            return torch.nn.functional.linear(x, weight, bias)
        return onednn_linear(x, weight, bias, packed)
    return torch.ops.mkldnn._linear_pointwise(x, packed.packed, bias, "none", [], "")
