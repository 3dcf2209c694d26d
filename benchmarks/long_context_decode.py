"""Host paged decode attention at long contexts (deepinfer::cpu_paged_decode_attention and its fp8 op).

SmolLM2-135M's head layout (9 query heads, 3 KV heads, head_dim 64, block 16); contexts 512 to 32k, batch 1 and
8; fp32, bf16 and fp8 (e4m3 codes, scales 1/16) caches; 1 and 2 torch threads. Each cache is one pool of at least
``--pool-mib`` (and of every configuration's K rows) and successive calls of a sweep read different blocks of it,
scattered at random as a long-running engine leaves them, so the rows come from DRAM as in a decode step (30 layers'
caches between two reads of one layer). Reported: ms per call and GB/s of K + V bytes read (visible rows only).

Also: the torch reference (the eager torch form: gather the request's blocks, dequantize fp8, SDPA) on the same
inputs, timed at batch 1 on one thread and compared with the kernel's output, and ``--baseline REV``'s kernel
(benchmarks/decode_attention.py's build, op namespace deepinfer_base) timed alongside, alternating rep by rep so a
shared machine's load hits both alike; a rep's time is its median call, the best rep counts.
Writes benchmarks/results/long_context_decode.md and .png.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.decode_attention import build_baseline  # noqa: E402
from benchmarks.machine import describe  # noqa: E402
from kernels.attention import paged_decode_attention  # noqa: E402
from kernels.cpu_kernels import load_cpu_kernels  # noqa: E402
from kernels.host_memory import HUGE_PAGE_BYTES, _advise_huge_pages  # noqa: E402
from kernels.kv_fp8 import KVQuant  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
SCALE = HEAD_DIM ** -0.5
FP8_SCALE = 1 / 16  # K / 16 and V / 16 as codes: values of N(0, 1) * 16 keep e4m3's normal range
DTYPES = {"fp32": (torch.float32, 4), "bf16": (torch.bfloat16, 2), "fp8": (torch.float32, 1)}  # q dtype, cache B
MAX_CALLS = 16  # per timed sweep
COLORS = ("tab:blue", "tab:orange", "tab:green", "tab:red")  # one per (batch, threads); base dashed, new solid


@dataclass
class Case:
    dtype: str
    threads: int
    batch: int
    context: int
    ms: dict[str, float]  # op name -> ms per call
    torch_ms: float | None = None
    max_err: float | None = None  # kernel vs torch reference, max |difference|

    def gbs(self, name: str) -> float:
        return 2 * self.batch * self.context * KV_HEADS * HEAD_DIM * DTYPES[self.dtype][1] / self.ms[name] / 1e6


def empty_cache(slots: int, dtype: torch.dtype, huge_pages: bool) -> torch.Tensor:  # [slots, Hkv, D]
    """A cache as torch allocates it (4 KiB pages: the engine's KV caches), or advised onto 2 MiB pages before its
    first touch (kernels/host_memory.py's way for the weights)."""
    if not huge_pages:
        return torch.empty(slots, KV_HEADS, HEAD_DIM, dtype=dtype)
    nbytes = slots * KV_HEADS * HEAD_DIM * dtype.itemsize
    length = -(-nbytes // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
    buffer = torch.empty(length + HUGE_PAGE_BYTES, dtype=torch.uint8)
    start = -buffer.data_ptr() % HUGE_PAGE_BYTES
    assert _advise_huge_pages(buffer.data_ptr() + start, length), "madvise(MADV_HUGEPAGE) refused"
    return buffer[start:start + nbytes].view(dtype).view(slots, KV_HEADS, HEAD_DIM)


def make_pool(dtype: str, slots: int, gen: torch.Generator, huge_pages: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V caches [slots, Hkv, D]: N(0, 1) values (fp8: codes of value / FP8_SCALE), filled a slice at a time."""
    caches = []
    for _ in range(2):
        cache = empty_cache(slots, torch.uint8 if dtype == "fp8" else DTYPES[dtype][0], huge_pages)
        for start in range(0, slots, 1 << 16):
            part = torch.randn(min(1 << 16, slots - start), KV_HEADS, HEAD_DIM, generator=gen)
            if dtype == "fp8":
                part = (part / FP8_SCALE).to(torch.float8_e4m3fn).view(torch.uint8)
            cache[start:start + part.shape[0]] = part.to(cache.dtype)
        caches.append(cache)
    return caches[0], caches[1]


def call(op_ns, dtype: str, q, k, v, table, lens) -> torch.Tensor:
    if dtype == "fp8":
        return op_ns.cpu_paged_decode_attention_fp8(q, k, v, table, lens, 1, BLOCK, SCALE, FP8_SCALE, FP8_SCALE)
    return op_ns.cpu_paged_decode_attention(q, k, v, table, lens, 1, BLOCK, SCALE)


def torch_reference(dtype: str, q, k, v, table, lens) -> torch.Tensor:
    quant = KVQuant(FP8_SCALE, FP8_SCALE) if dtype == "fp8" else None
    return paged_decode_attention(q, k, v, table, lens, 1, BLOCK, SCALE, cpu_kernel=False, kv_quant=quant)


def block_tables(pool_blocks: int, batch: int, width: int, calls: int, adjacent: bool,
                 gen: torch.Generator) -> list[torch.Tensor]:  # each [batch, width] int32
    """A table per call: blocks scattered over the pool at random, or each request's consecutive (a lone long
    request in a fresh engine), the calls walking the pool."""
    if adjacent:
        return [(torch.arange(batch * width) + (c * batch * width) % max(pool_blocks - batch * width, 1))
                .view(batch, width).to(torch.int32) for c in range(calls)]
    return [torch.randperm(pool_blocks, generator=gen)[: batch * width].view(batch, width).to(torch.int32)
            for _ in range(calls)]


def time_case(ops: dict, dtype: str, batch: int, context: int, k, v, reps: int, gen: torch.Generator,
              with_torch: bool, adjacent: bool) -> Case:
    pool_blocks = k.shape[0] // BLOCK
    width = context // BLOCK
    calls = max(2, min(MAX_CALLS, pool_blocks // (batch * width)))
    tables = block_tables(pool_blocks, batch, width, calls, adjacent, gen)
    lens = torch.full((batch,), context, dtype=torch.int32)
    q = torch.randn(batch, HEADS, HEAD_DIM, generator=gen).to(DTYPES[dtype][0])
    best = {name: float("inf") for name in ops}
    for _ in range(reps):
        for name, op_ns in ops.items():  # alternating: a shared machine's load hits both alike
            times = []
            for table in tables:
                start = time.perf_counter()
                call(op_ns, dtype, q, k, v, table, lens)
                times.append(time.perf_counter() - start)
            best[name] = min(best[name], sorted(times)[len(times) // 2])
    outs = {name: call(op_ns, dtype, q, k, v, tables[0], lens).float() for name, op_ns in ops.items()}
    case = Case(dtype, torch.get_num_threads(), batch, context, {n: t * 1e3 for n, t in best.items()})
    if "base" in outs:
        tolerance = 1e-5 if dtype != "bf16" else 1e-2
        gap = (outs["new"] - outs["base"]).abs().max().item()
        assert gap <= tolerance, f"{dtype} batch {batch} context {context}: new vs base differ by {gap}"
    if with_torch:
        want = torch_reference(dtype, q, k, v, tables[0], lens).float()
        case.max_err = (outs["new"] - want).abs().max().item()
        times = []
        for table in tables[: max(2, min(5, calls))]:
            start = time.perf_counter()
            torch_reference(dtype, q, k, v, table, lens)
            times.append(time.perf_counter() - start)
        case.torch_ms = sorted(times)[len(times) // 2] * 1e3
    return case


def write_report(cases: list[Case], names: list[str], out: Path, header: str) -> None:
    cols = " | ".join(f"{n} ms | {n} GB/s" for n in names)
    lines = [f"| dtype | threads | batch | context | {cols} |" + (" speedup |" if len(names) == 2 else "")
             + " torch ms | max err vs torch |"]
    lines.append("|" + "---|" * (lines[0].count("|") - 1))
    for c in cases:
        row = (f"| {c.dtype} | {c.threads} | {c.batch} | {c.context} | "
               + " | ".join(f"{c.ms[n]:.3f} | {c.gbs(n):.1f}" for n in names) + " |")
        if len(names) == 2:
            row += f" {c.ms[names[0]] / c.ms[names[1]]:.2f}x |"
        row += (f" {c.torch_ms:.2f} | {c.max_err:.1e} |" if c.torch_ms is not None else " - | - |")
        lines.append(row)
    text = header + "\n\n" + "\n".join(lines) + "\n"
    out.write_text(text)
    print(text)
    plot(cases, names, out.with_suffix(".png"))


def plot(cases: list[Case], names: list[str], path: Path) -> None:
    """GB/s against context, one panel per dtype, a line per (op, batch, threads)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    dtypes = sorted({c.dtype for c in cases}, key=list(DTYPES).index)
    fig, axes = plt.subplots(1, len(dtypes), figsize=(5 * len(dtypes), 3.6), squeeze=False)
    for ax, dtype in zip(axes[0], dtypes):
        for name, style in zip(names, ("--", "-") if len(names) == 2 else ("-",)):
            for (batch, threads), color in zip(sorted({(c.batch, c.threads) for c in cases}), COLORS):
                sel = [c for c in cases if (c.dtype, c.batch, c.threads) == (dtype, batch, threads)]
                ax.plot([c.context for c in sel], [c.gbs(name) for c in sel], style, marker="o", color=color,
                        label=f"{name} b{batch} t{threads}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel("K+V read GB/s")
        ax.set_title(dtype)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", help="git revision whose kernel to time alongside")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--pool-mib", type=int, default=768, help="at least this much per cache")
    parser.add_argument("--dtypes", default="fp32,bf16,fp8")
    parser.add_argument("--contexts", default="512,2048,8192,16384,32768")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--adjacent", action="store_true", help="each request's blocks consecutive (else scattered)")
    parser.add_argument("--huge-pages", action="store_true", help="pools on 2 MiB pages (else 4 KiB, as the engine)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "long_context_decode.md"))
    args = parser.parse_args()
    assert load_cpu_kernels(), "the C++ host kernels did not build"
    ops = {"new": torch.ops.deepinfer}
    if args.baseline:
        build_baseline(args.baseline)
        ops = {"base": torch.ops.deepinfer_base, **ops}
    machine = describe().line()
    print(machine, flush=True)
    contexts = [int(x) for x in args.contexts.split(",")]
    batches = [int(x) for x in args.batches.split(",")]
    gen = torch.Generator().manual_seed(0)
    cases = []
    for dtype in args.dtypes.split(","):
        row_bytes = KV_HEADS * HEAD_DIM * DTYPES[dtype][1]
        slots = max(args.pool_mib * 2 ** 20 // row_bytes, max(batches) * max(contexts) * 5 // 4)
        k, v = make_pool(dtype, -(-slots // BLOCK) * BLOCK, gen, args.huge_pages)
        for threads in [int(x) for x in args.threads.split(",")]:
            torch.set_num_threads(threads)
            for batch in batches:
                for context in contexts:
                    case = time_case(ops, dtype, batch, context, k, v, args.reps, gen,
                                     with_torch=batch == 1 and threads == 1, adjacent=args.adjacent)
                    cases.append(case)
                    print(f"{dtype} t{threads} b{batch} {context}: "
                          + ", ".join(f"{n} {case.ms[n]:.3f} ms {case.gbs(n):.1f} GB/s" for n in ops)
                          + (f", torch {case.torch_ms:.2f} ms err {case.max_err:.1e}" if case.torch_ms else ""),
                          flush=True)
        del k, v
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    header = (f"# Host paged decode attention at long contexts, SmolLM2-135M heads (9 q, 3 KV, head_dim 64)\n\n"
              f"{machine}; load average {load} at the end; {args.reps} reps, best rep's median call; pools of "
              f">= {args.pool_mib} MiB per cache on {'2 MiB' if args.huge_pages else '4 KiB'} pages, each request's "
              f"blocks {'adjacent' if args.adjacent else 'scattered'}; GB/s = K + V bytes of the visible rows / time"
              + (f"; base = {args.baseline}'s kernel, new = this tree's" if args.baseline else "")
              + "; torch = gather + SDPA (kernels/attention.py's eager form), batch 1, one thread")
    write_report(cases, list(ops), Path(args.out), header)


if __name__ == "__main__":
    main()
