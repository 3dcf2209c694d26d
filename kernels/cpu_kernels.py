"""Host CPU kernels written in C++ (kernels/csrc), built as a torch extension on first use.

torch compiles the sources for the instruction set torch itself dispatches to on this CPU (AVX-512, AVX2 or
baseline x86-64; not -march=native, so a build cached on a shared volume never meets a CPU that lacks its
instructions) and caches the library under ~/.cache/torch_extensions (TORCH_EXTENSIONS_DIR): only the first
engine start on a machine pays the ~7 s build (about a minute on a loaded 2-core machine). Ops: paged decode
attention (fp32, or bf16 with fp32 math), the shared-memory all-reduce of tensor-parallel ranks on one machine
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
import hashlib
import logging
import time
from pathlib import Path

import torch

from kernels.quant import FP8_MAX

logger = logging.getLogger(__name__)

_SOURCES = ("paged_decode_attention.cpp", "shm_all_reduce.cpp", "gemv.cpp", "grouped_experts.cpp",
            "hyper_connections.cpp", "sink_attention.cpp", "interleaved_rope.cpp", "rms_norm.cpp",
            "fused_layer_ops.cpp", "llama_decode.cpp", "gemm_amx.cpp", "row_argmax.cpp",
            "head_screen.cpp", "head_int8.cpp", "kv_fp8_store.cpp")
# torch.backends.cpu.get_cpu_capability() -> compiler flags (x86-64; anything else builds for the baseline).
_ISA_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512dq", "-mavx512bw", "-mavx512vl", "-mavx2", "-mfma"],
    "AVX2": ["-mavx2", "-mfma"],
}


def _build_running_in(build_dir: Path) -> bool:
    """Whether a process works in ``build_dir`` (ninja and the compilers run there). Linux's /proc only; elsewhere
    False, and the age rule alone decides."""
    for cwd in Path("/proc").glob("[0-9]*/cwd"):
        try:
            if cwd.readlink() == build_dir:
                return True
        except OSError:  # the process ended, or is another user's
            continue
    return False


def _remove_stale_build_lock(build_dir: Path, stale_after_s: float = 600.0) -> None:
    """torch's build lock has no owner: a build killed midway leaves it, and every later load waits on it forever.
    A build takes seconds to a minute; a lock older than ``stale_after_s`` is such a leftover, unless a compiler
    still runs there (on a loaded 2-core machine a build took 15 minutes, and a second build started beside it
    clobbered its objects)."""
    lock = build_dir / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return
    if age > stale_after_s and not _build_running_in(build_dir.resolve()):
        logger.warning("deepinfer: removing a stale C++ build lock (%.0f s old): %s", age, lock)
        lock.unlink(missing_ok=True)


# Element types of the decode attention kernel: bf16 is widened to fp32 in the kernel (no bf16 instructions
# needed), so every x86 CPU runs both.
CPU_ATTENTION_DTYPES = (torch.float32, torch.bfloat16)


def cpu_kernels_supported(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cpu" and dtype in CPU_ATTENTION_DTYPES


@functools.cache
def load_cpu_kernels() -> bool:
    """Builds (once per machine) and loads the C++ ops; False, with the reason logged, when that fails."""
    from torch.utils import cpp_extension

    sources = [Path(__file__).parent / "csrc" / name for name in _SOURCES]
    capability = torch.backends.cpu.get_cpu_capability()
    # The sources and their directory in the name: two versions, or two checkouts of one version, on one machine
    # never share a build directory (ninja would rebuild it for each checkout's paths, each load waiting on the
    # other's lock).
    headers = sorted(sources[0].parent.glob("*.h"))
    digest = hashlib.sha1(str(sources[0].parent.resolve()).encode()
                          + b"".join(path.read_bytes() for path in [*sources, *headers])).hexdigest()[:10]
    name = f"deepinfer_cpu_kernels_{capability.lower()}_{digest}"
    _remove_stale_build_lock(Path(cpp_extension._get_build_directory(name, verbose=False)))
    try:
        # -fopenmp: at::parallel_for's OpenMP body lives in the headers; the process's libgomp (torch's) serves it.
        cpp_extension.load(name=name,
                           sources=[str(path) for path in sources],
                           is_python_module=False, verbose=False,
                           extra_cflags=["-O3", "-fopenmp", *_ISA_FLAGS.get(capability, [])],
                           extra_ldflags=["-fopenmp"])
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


# The packed-weight GEMMs (weight_format=packed; kernels/packed_gemm.py): their own extension, so that editing them
# rebuilds only them (csrc/packed/*.h stay out of the main build's digest).
_PACKED_SOURCES = ("packed_gemm.cpp",)


@functools.cache
def load_packed_kernels() -> bool:
    """Builds (once per machine) and loads ``deepinfer::packed_linear``; False, with the reason logged, when that
    fails (kernels/packed_gemm.py then runs its torch reference)."""
    from torch.utils import cpp_extension

    csrc = Path(__file__).parent / "csrc"
    sources = [csrc / name for name in _PACKED_SOURCES]
    headers = sorted((csrc / "packed").glob("*.h"))
    capability = torch.backends.cpu.get_cpu_capability()
    digest = hashlib.sha1(str(csrc.resolve()).encode()
                          + b"".join(path.read_bytes() for path in [*sources, *headers])).hexdigest()[:10]
    name = f"deepinfer_packed_kernels_{capability.lower()}_{digest}"
    _remove_stale_build_lock(Path(cpp_extension._get_build_directory(name, verbose=False)))
    try:
        cpp_extension.load(name=name, sources=[str(path) for path in sources], is_python_module=False,
                           verbose=False, extra_cflags=["-O3", "-fopenmp", *_ISA_FLAGS.get(capability, [])],
                           extra_ldflags=["-fopenmp"])
    except Exception as exc:
        logger.warning("deepinfer: could not build the packed-weight GEMMs, using their torch reference: %s", exc)
        return False

    @torch.library.register_fake("deepinfer::packed_linear")
    def _(x: torch.Tensor, data: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None, fmt: str,
          out_features: int, block: list[int], path: str = "auto", isa: str = "auto") -> torch.Tensor:
        return x.new_empty(x.shape[0], out_features)

    return True
