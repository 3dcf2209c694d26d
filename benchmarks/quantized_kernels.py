"""Packed quantized-weight GEMMs (kernels/packed_gemm.py) against the blocked fp32 and bf16 GEMMs on the same
weights dequantized (kernels/gemv.py, what ``weight_format=dequantize`` runs), at 1 and 32 activation rows.

Formats: fp8 e4m3 with 128x128 ue8m0 block scales, fp4 e2m1 (ue8m0 per 32), GGUF Q8_0 / Q4_0 / Q4_1 / Q4_K (Q4_K
needs in % 256 == 0: not SmolLM2's 576-wide inputs). GGUF runs both kernel paths: ``fp32`` (weights widened to
fp32 in registers, FMA) and ``int8`` (activations quantized to int8 per 32 inputs, integer dot products: VNNI
vpdpbusd where the CPU has it, else vpmaddubsw). Shapes (out x in): SmolLM2-135M's up / gate 1536 x 576, down
576 x 1536 and tied head 49152 x 576; DeepSeek-like expert projections 2048 x 7168 and 7168 x 2048.

Each method cycles through copies of its weight that together exceed ``--working-set-mib`` so that each call
reads its weight from DRAM as a decode step does (at 32 rows, where arithmetic bounds the time, one copy).
Methods alternate rep by rep so a shared machine's load hits all alike; the best rep counts.
Writes benchmarks/results/quantized_kernels.md.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import sys
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.machine import describe  # noqa: E402
from kernels.fp4 import quantize_fp4  # noqa: E402
from kernels.gemv import block_weight, blocked_linear, gemv_available, kernel_isa  # noqa: E402
from kernels.packed_gemm import packed_kernels_available, packed_linear, supported_isas  # noqa: E402
from kernels.packed_weights import PackedWeight, pack_fp4, pack_fp8, pack_gguf  # noqa: E402
from kernels.quant import quantize_block_fp8  # noqa: E402

SHAPES = {  # name -> (out, in)
    "SmolLM2 up/gate 1536x576": (1536, 576),
    "SmolLM2 down 576x1536": (576, 1536),
    "SmolLM2 head 49152x576": (49152, 576),
    "DeepSeek expert up 2048x7168": (2048, 7168),
    "DeepSeek expert down 7168x2048": (7168, 2048),
}
FORMATS = ("fp8_e4m3", "fp4_e2m1", "q8_0", "q4_0", "q4_1", "q4_k")


def make_packed(fmt: str, weight: torch.Tensor) -> PackedWeight | None:
    out, inp = weight.shape
    if fmt == "fp8_e4m3":
        q, scale = quantize_block_fp8(weight, (128, 128), "ue8m0")
        return pack_fp8(q, scale, (128, 128))
    if fmt == "fp4_e2m1":
        return pack_fp4(*quantize_fp4(weight))
    if fmt == "q4_k":
        if inp % 256:
            return None
        rng = np.random.default_rng(0)  # gguf 0.19 has no Q4_K quantizer: random blocks, sane scales
        blocks = rng.integers(0, 256, size=(out, inp // 256, 144), dtype=np.uint8)
        blocks[..., 0:4] = np.array([0.002, 0.004], np.float16).view(np.uint8)
        return pack_gguf(blocks.reshape(out, -1), "q4_k")
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize
    return pack_gguf(quantize(weight.numpy(), GGMLQuantizationType[fmt.upper()]), fmt)


def time_methods(methods: dict[str, tuple[list[Callable[[], torch.Tensor]], int]], rows: int,
                 reps: int) -> dict[str, float]:
    """name -> best seconds per call; ``methods``: name -> (one call per weight copy, weight bytes)."""
    best = {name: float("inf") for name in methods}
    for calls, _ in methods.values():  # warm-up: first-call allocations, page faults
        for call in calls:
            call()
    for _ in range(reps):
        for name, (calls, _) in methods.items():
            rotation = calls if rows <= 8 else calls[:1]
            start = time.perf_counter()
            for call in rotation:
                call()
            best[name] = min(best[name], (time.perf_counter() - start) / len(rotation))
    return best


def measure_shape(label: str, shape: tuple[int, int], formats: list[str], rows_list: list[int], working_set: int,
                  reps: int) -> list[dict]:
    out, inp = shape
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(out, inp, generator=gen) * 0.05

    def copies(nbytes: int) -> int:
        return max(1, -(-working_set // nbytes))

    methods: dict[str, tuple[list, int, int]] = {}  # name -> (objects, bytes, copies)
    fp32 = block_weight(weight)
    methods["fp32 blocked"] = ([fp32] + [fp32.clone() for _ in range(copies(fp32.nbytes) - 1)], fp32.nbytes)
    bf16 = block_weight(weight.bfloat16())
    methods["bf16 blocked"] = ([bf16] + [bf16.clone() for _ in range(copies(bf16.nbytes) - 1)], bf16.nbytes)
    packed = {}
    for fmt in formats:
        w = make_packed(fmt, weight)
        if w is None:
            continue
        n = copies(w.nbytes)
        packed[fmt] = [w] + [dataclasses.replace(w, data=w.data.clone()) for _ in range(n - 1)]
    results = []
    for rows in rows_list:
        x = torch.randn(rows, inp, generator=gen)
        calls: dict[str, tuple[list[Callable], int]] = {}
        for name, (tensors, nbytes) in methods.items():
            calls[name] = ([lambda t=t: blocked_linear(x, t, None, out) for t in tensors], nbytes)
        for fmt, ws in packed.items():
            paths = ("fp32", "int8") if fmt.startswith("q") else ("fp32",)
            for path in paths:
                calls[f"{fmt} {path}"] = ([lambda w=w, p=path: packed_linear(x, w, None, p) for w in ws],
                                          ws[0].nbytes)
        best = time_methods(calls, rows, reps)
        for name, seconds in best.items():
            results.append({"shape": label, "rows": rows, "method": name, "us": seconds * 1e6,
                            "gbs": calls[name][1] / seconds / 1e9, "bytes": calls[name][1]})
        base = best["fp32 blocked"]
        print(f"{label}, {rows} rows: " + ", ".join(f"{n} {s * 1e6:.0f} us ({base / s:.2f}x)"
                                                      for n, s in best.items()), flush=True)
    del methods, packed, fp32, bf16
    gc.collect()
    return results


SHORT = {"SmolLM2 up/gate 1536x576": "S 1536x576", "SmolLM2 down 576x1536": "S 576x1536",
         "SmolLM2 head 49152x576": "S 49152x576", "DeepSeek expert up 2048x7168": "D 2048x7168",
         "DeepSeek expert down 7168x2048": "D 7168x2048"}


def section(results: list[dict], formats: list[str]) -> list[str]:
    """Methods as rows, (shape, rows) as columns: microseconds per call and the speedup over fp32 blocked."""
    keys = sorted({(r["shape"], r["rows"]) for r in results}, key=lambda k: (k[1], list(SHAPES).index(k[0])))
    at = {(r["shape"], r["rows"], r["method"]): r for r in results}
    names = ["fp32 blocked", "bf16 blocked"] + [
        n for f in formats for n in ((f"{f} fp32", f"{f} int8") if f.startswith("q") else (f"{f} fp32",))]
    lines = ["Microseconds per call (best rep) and, in brackets, the speedup over the dequantized fp32 blocked GEMM. "
             "S = SmolLM2-135M, D = DeepSeek-like; out x in; 'fp32' / 'int8' = the packed kernel's path.", "",
             "| method | " + " | ".join(f"{SHORT[shape]}, {rows} row{'s' if rows > 1 else ''}"
                                      for shape, rows in keys) + " |",
             "|---|" + "---|" * len(keys)]
    for name in names:
        cells = []
        for shape, rows in keys:
            r = at.get((shape, rows, name))
            base = at[(shape, rows, "fp32 blocked")]["us"]
            cells.append("n/a" if r is None else f"{r['us']:.0f} ({base / r['us']:.2f}x)")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    qs = [f for f in formats if f.startswith("q")]
    lines += ["", "GGUF, int8-path time / fp32-widening-path time (< 1: int8 faster):", "",
              "| format | " + " | ".join(f"{SHORT[shape]}, {rows}" for shape, rows in keys) + " |",
              "|---|" + "---|" * len(keys)]
    for f in qs:
        cells = [f"{at[(shape, rows, f + ' int8')]['us'] / at[(shape, rows, f + ' fp32')]['us']:.2f}"
                 if (shape, rows, f + " int8") in at else "n/a" for shape, rows in keys]
        lines.append(f"| {f} | " + " | ".join(cells) + " |")
    return lines


def write_report(path: Path, header: list[str], sections: list[tuple[int, list[dict]]], formats: list[str]) -> None:
    lines = [*header]
    for threads, results in sections:
        lines += ["", f"## {threads} thread{'s' if threads > 1 else ''}", ""] + section(results, formats)
    text = "\n".join(lines) + "\n"
    print(text)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,32")
    parser.add_argument("--shapes", default="all", help="'all' or indices into SHAPES, e.g. 0,3")
    parser.add_argument("--formats", default=",".join(FORMATS))
    parser.add_argument("--working-set-mib", type=int, default=256)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", default="1,2", help="torch threads, each a table (the kernels' threads)")
    parser.add_argument("--note", default="Taken on a BUSY shared 2-core machine (other engineers' tests running): "
                        "indicative only, to be re-measured on a quiet one.")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "quantized_kernels.md"))
    args = parser.parse_args()
    if not (packed_kernels_available() and gemv_available(torch.device("cpu"), torch.float32)):
        print("the C++ kernels did not build; see the warning above")
        return 1
    names = list(SHAPES)
    shapes = names if args.shapes == "all" else [names[int(i)] for i in args.shapes.split(",")]
    formats = args.formats.split(",")
    rows_list = [int(r) for r in args.rows.split(",")]
    machine = describe()
    isas = supported_isas()
    header = ["# Packed quantized-weight GEMMs vs dequantized fp32 / bf16 blocked GEMMs", "",
              f"Machine: {machine.line()}", "",
              f"Kernels: packed GEMM instruction sets {', '.join(isas)} (int8 path: {isas[0]}"
              f"{' with VNNI' if 'vnni' in isas[0] else ', no VNNI on this CPU: vpmaddubsw'}); blocked GEMM "
              f"{kernel_isa()}. Each call reads its weight from a {args.working_set_mib} MiB rotation of copies "
              f"(1 row; one copy at 32 rows); best of {args.reps} reps.", "", f"**{args.note}**"]
    print("\n".join(header), flush=True)
    started = time.time()
    sections = []
    for threads in [int(t) for t in args.threads.split(",")]:
        torch.set_num_threads(threads)
        print(f"--- {threads} thread(s)", flush=True)
        results = [r for label in shapes
                   for r in measure_shape(label, SHAPES[label], formats, rows_list, args.working_set_mib << 20,
                                          args.reps)]
        sections.append((threads, results))
    header.append(f"\nLoad average at the end: {' '.join(f'{v:.2f}' for v in os.getloadavg())}; "
                  f"run took {time.time() - started:.0f} s.")
    write_report(Path(args.out), header, sections, formats)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
