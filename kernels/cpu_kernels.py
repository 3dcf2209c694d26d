"""Host CPU kernels written in C++ (kernels/csrc), built as torch extensions at install (``python -m kernels.build``,
run by ``make install`` and the Dockerfile) or, where that was skipped, on first use (kernels/extension_build.py:
where the libraries live, why there, and their names that change with every source edit).

The sources are compiled for the instruction set torch itself dispatches to on this CPU (AVX-512, AVX2 or baseline
x86-64): ~7 s on a quiet machine, two minutes on a loaded 2-core one. Ops: paged decode attention (fp32, or bf16 with fp32 math), the shared-memory all-reduce of tensor-parallel ranks on one machine
(shm_all_reduce.cpp), the few-row GEMM on pre-blocked weights (gemv.cpp, which picks its instruction set from the
CPU's flags at run time, whatever flags built it; kernels/gemv.py), the routed MoE experts on the same blocked
weights (grouped_experts.cpp), mHC's mixes with their Sinkhorn loop and its stream collapse / expansion
(hyper_connections.cpp) and DeepSeek-V4's sink attention over two key sets or over the window ring in place
(sink_attention.cpp), interleaved tail RoPE (interleaved_rope.cpp) and its RMS norms (rms_norm.cpp), a Llama
layer's norms, SiLU gate and RoPE + KV-cache write (fused_layer_ops.cpp, kernels/fused_layer_ops.py), the GEMM's
AMX tile passes (gemm_amx.cpp), a Llama decode step's layers as one op over the others (llama_decode.cpp), greedy
sampling's row argmax (row_argmax.cpp), the screened greedy heads' passes (head_screen.cpp, head_int8.cpp) and the
fp8 KV cache's RoPE + e4m3 store (kv_fp8_store.cpp). The ops are registered with the dispatcher
(``torch.ops.deepinfer.*``); those compiled regions can meet have fake kernels, so regions keep each as one opaque
call, as they do the packed GEMM (the screened heads' ops run in eager steps only and have none).
"""
from __future__ import annotations

import functools
import logging
from pathlib import Path

import torch

from kernels.extension_build import ExtensionSpec, load_extension
from kernels.quant import FP8_MAX

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).parent / "csrc"
CPU_KERNELS = ExtensionSpec(
    stem="deepinfer_cpu_kernels",
    sources=tuple(_CSRC / name for name in (
        "paged_decode_attention.cpp", "shm_all_reduce.cpp", "gemv.cpp", "grouped_experts.cpp",
        "hyper_connections.cpp", "sink_attention.cpp", "interleaved_rope.cpp", "rms_norm.cpp", "fused_layer_ops.cpp",
        "llama_decode.cpp", "gemm_amx.cpp", "row_argmax.cpp", "head_screen.cpp", "head_int8.cpp",
        "kv_fp8_store.cpp")),
    headers=tuple(sorted(_CSRC.glob("*.h"))))
# The packed-weight GEMMs (weight_format=packed; kernels/packed_gemm.py): their own extension, so that editing them
# rebuilds only them (csrc/packed/*.h stay out of the main build's digest).
PACKED_KERNELS = ExtensionSpec(stem="deepinfer_packed_kernels", sources=(_CSRC / "packed_gemm.cpp",),
                               headers=tuple(sorted((_CSRC / "packed").glob("*.h"))))
EXTENSIONS = (CPU_KERNELS, PACKED_KERNELS)


# Element types of the decode attention kernel: bf16 is widened to fp32 in the kernel (no bf16 instructions
# needed), so every x86 CPU runs both.
CPU_ATTENTION_DTYPES = (torch.float32, torch.bfloat16)


def cpu_kernels_supported(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cpu" and dtype in CPU_ATTENTION_DTYPES


@functools.cache
def load_cpu_kernels() -> bool:
    """Loads the C++ ops (built at install, or here on first use); False, with the reason logged, when that fails."""
    try:
        load_extension(CPU_KERNELS)
    except Exception as exc:  # no compiler, no ninja, ...: the torch forms of the same ops still work
        logger.warning("deepinfer: could not build the C++ CPU kernels, using the torch forms instead: %s", exc)
        return False

    @torch.library.register_fake("deepinfer::cpu_paged_decode_attention")
    def _(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
          seq_lens: torch.Tensor, query_len: int, block_size: int, scale: float) -> torch.Tensor:
        return torch.empty_like(q, memory_format=torch.contiguous_format)

    @torch.library.register_fake("deepinfer::cpu_paged_prefill_attention")
    def _(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
          seq_lens: torch.Tensor, query_starts: torch.Tensor, block_size: int, scale: float) -> torch.Tensor:
        return torch.empty_like(q, memory_format=torch.contiguous_format)

    @torch.library.register_fake("deepinfer::cpu_paged_decode_attention_fp8")
    def _(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
          seq_lens: torch.Tensor, query_len: int, block_size: int, scale: float, k_scale: float,
          v_scale: float) -> torch.Tensor:
        return torch.empty_like(q, memory_format=torch.contiguous_format)

    @torch.library.register_fake("deepinfer::cpu_paged_decode_attention_lse")
    def _(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
          seq_lens: torch.Tensor, block_size: int, scale: float, k_scale: float, v_scale: float,
          fp8: bool) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.empty_like(q, memory_format=torch.contiguous_format), q.new_empty(q.shape[:2], dtype=torch.float32)

    @torch.library.register_fake("deepinfer::cpu_paged_prefill_attention_fp8")
    def _(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
          seq_lens: torch.Tensor, query_starts: torch.Tensor, block_size: int, scale: float, k_scale: float,
          v_scale: float) -> torch.Tensor:
        return torch.empty_like(q, memory_format=torch.contiguous_format)

    @torch.library.register_fake("deepinfer::row_argmax")
    def _(logits: torch.Tensor) -> torch.Tensor:
        return logits.new_empty(logits.shape[0], dtype=torch.int64)

    @torch.library.register_fake("deepinfer::shm_all_reduce")
    def _(x: torch.Tensor, handle: int) -> torch.Tensor:
        return torch.empty_like(x, memory_format=torch.contiguous_format)

    @torch.library.register_fake("deepinfer::blocked_linear")
    def _(x: torch.Tensor, blocked: torch.Tensor, bias: torch.Tensor | None, out_features: int,
          isa: str = "auto") -> torch.Tensor:
        return x.new_empty(x.shape[0], out_features)

    @torch.library.register_fake("deepinfer::blocked_linear_add")
    def _(x: torch.Tensor, blocked: torch.Tensor, bias: torch.Tensor | None, out_features: int,
          residual: torch.Tensor, isa: str = "auto") -> torch.Tensor:
        return x.new_empty(x.shape[0], out_features)

    @torch.library.register_fake("deepinfer::blocked_linear_float")
    def _(x: torch.Tensor, blocked: torch.Tensor, out_features: int, isa: str = "auto") -> torch.Tensor:
        return x.new_empty(x.shape[0], out_features, dtype=torch.float32)

    @torch.library.register_fake("deepinfer::blocked_linear_silu_mul")
    def _(x: torch.Tensor, blocked: torch.Tensor, intermediate: int, isa: str = "auto") -> torch.Tensor:
        return x.new_empty(x.shape[0], intermediate)

    @torch.library.register_fake("deepinfer::llama_decode_layers")
    def _(hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_caches: torch.Tensor,
          v_caches: torch.Tensor, slot_mapping: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
          query_len: int, block_size: int, scale: float, num_heads: int, num_kv_heads: int, intermediate: int,
          eps: float, norms: list[torch.Tensor], projections: list[torch.Tensor], gemm_path: int,
          packed_fmt: str = "", packed_path: str = "auto", k_scales: list[float] = (), v_scales: list[float] = (),
          fp8_max: float = FP8_MAX) -> torch.Tensor:
        return torch.empty_like(hidden, memory_format=torch.contiguous_format)

    @torch.library.register_fake("deepinfer::blocked_grouped_experts")
    def _(x: torch.Tensor, weights: torch.Tensor, local_ids: torch.Tensor, gate_up: torch.Tensor,
          down: torch.Tensor, inter: int, limit: float) -> torch.Tensor:
        return torch.empty_like(x, memory_format=torch.contiguous_format)

    @torch.library.register_fake("deepinfer::sink_attention")
    def _(q: torch.Tensor, keys: torch.Tensor, allowed: torch.Tensor, extra: torch.Tensor,
          extra_allowed: torch.Tensor, sinks: torch.Tensor, scale: float) -> torch.Tensor:
        return torch.empty_like(q, memory_format=torch.contiguous_format)

    @torch.library.register_fake("deepinfer::ring_sink_attention")
    def _(q: torch.Tensor, ring: torch.Tensor, fresh: torch.Tensor, slots: torch.Tensor, starts: torch.Tensor,
          positions: torch.Tensor, first: int, window: int, extra: torch.Tensor, extra_allowed: torch.Tensor,
          sinks: torch.Tensor, scale: float) -> torch.Tensor:
        return torch.empty_like(q, memory_format=torch.contiguous_format)

    @torch.library.register_fake("deepinfer::rms_norm")
    def _(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
        return torch.empty_like(x, memory_format=torch.contiguous_format)

    @torch.library.register_fake("deepinfer::tail_rope")
    def _(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(x, memory_format=torch.contiguous_format)

    @torch.library.register_fake("deepinfer::hc_mixes")
    def _(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, iters: int,
          hc_eps: float, norm_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        tokens, hc = streams.shape[0], streams.shape[1]
        new = functools.partial(streams.new_empty, dtype=torch.float32)
        return new(tokens, hc), new(tokens, hc), new(tokens, hc, hc)

    @torch.library.register_fake("deepinfer::hc_pre")
    def _(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, iters: int,
          hc_eps: float, norm_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        tokens, hc = streams.shape[0], streams.shape[1]
        new = functools.partial(streams.new_empty, dtype=torch.float32)
        return streams.new_empty(tokens, streams.shape[2]), new(tokens, hc), new(tokens, hc, hc)

    @torch.library.register_fake("deepinfer::hc_post")
    def _(block_out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(streams, memory_format=torch.contiguous_format)

    @torch.library.register_fake("deepinfer::llama_rms_norm")
    def _(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return torch.empty_like(x, memory_format=torch.contiguous_format)

    @torch.library.register_fake("deepinfer::llama_add_rms_norm")
    def _(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
          eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.empty_like(x, memory_format=torch.contiguous_format),
                torch.empty_like(x, memory_format=torch.contiguous_format))

    @torch.library.register_fake("deepinfer::silu_and_mul")
    def _(x: torch.Tensor) -> torch.Tensor:
        return x.new_empty(x.shape[0], x.shape[1] // 2)

    @torch.library.register_fake("deepinfer::rope_qkv_to_cache")
    def _(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
          slot_mapping: torch.Tensor, num_heads: int, num_kv_heads: int) -> torch.Tensor:
        return qkv.new_empty(qkv.shape[0], num_heads, k_cache.shape[2])

    @torch.library.register_fake("deepinfer::rope_qkv_to_cache_fp8")
    def _(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
          slot_mapping: torch.Tensor, num_heads: int, num_kv_heads: int, k_scale: float, v_scale: float,
          fp8_max: float) -> torch.Tensor:
        return qkv.new_empty(qkv.shape[0], num_heads, k_cache.shape[2])

    return True


@functools.cache
def load_packed_kernels() -> bool:
    """Loads ``deepinfer::packed_linear`` (built at install, or here on first use); False, with the reason logged,
    when that fails (kernels/packed_gemm.py then runs its torch reference)."""
    try:
        load_extension(PACKED_KERNELS)
    except Exception as exc:
        logger.warning("deepinfer: could not build the packed-weight GEMMs, using their torch reference: %s", exc)
        return False

    @torch.library.register_fake("deepinfer::packed_linear")
    def _(x: torch.Tensor, data: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None, fmt: str,
          out_features: int, block: list[int], path: str = "auto", isa: str = "auto") -> torch.Tensor:
        return x.new_empty(x.shape[0], out_features)

    return True
