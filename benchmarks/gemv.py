"""Few-row GEMM: GB/s of weights streamed by the blocked kernel (kernels/gemv.py), oneDNN's packed GEMM and MKL.

Prints the machine (CPU model, family/model, the flags that pick kernels), the read bandwidth (``x.sum()`` over
1 GiB on the torch threads), then for each weight shape (SmolLM2-135M's and a 4096 x 4096) and T activation rows
the weight bytes read per second by: blocked fp32, blocked bf16 weights with fp32 and with bf16 activations,
oneDNN packed fp32 and MKL fp32 (``F.linear``). Each method cycles through copies of the weight that together
exceed ``--working-set-mib``, so every call reads its weight from DRAM as a decode step does (540 MB of SmolLM2
weights a step); past T = 8, where the FMAs bound the time, the rotation shrinks in proportion. Methods alternate
rep by rep so a shared machine's load hits all alike; the best rep counts.
Then the crossover: the smallest T at which oneDNN's packed GEMM beats the blocked kernel, summed over the
SmolLM2 layer shapes (GemvPolicy.max_rows in kernels/gemv.py). Writes benchmarks/results/gemv.md and gemv.png.
"""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.machine import describe, read_bandwidth_gbs  # noqa: E402
from kernels.gemv import block_weight, blocked_linear, gemv_available, kernel_isa  # noqa: E402
from kernels.onednn_gemm import PackedWeight  # noqa: E402

# (out, in): SmolLM2-135M's q/o (576x576), up/gate (1536x576), down (576x1536), head (49152x576); a big square.
SHAPES = [(576, 576), (1536, 576), (576, 1536), (49152, 576), (4096, 4096)]
LAYER_SHAPES = SHAPES[:3]


@dataclass
class Method:
    name: str
    weight_dtype: torch.dtype
    x_dtype: torch.dtype
    make: Callable[[torch.Tensor], Callable[[torch.Tensor], torch.Tensor]]  # plain weight -> call(x)


@dataclass
class Result:
    shape: tuple[int, int]
    rows: int
    gbps: dict[str, float] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)


def methods() -> list[Method]:
    def blocked(weight):
        tensor = block_weight(weight)
        return lambda x: blocked_linear(x, tensor, None, weight.shape[0])

    def onednn(weight):
        packed = PackedWeight(weight)
        return lambda x: torch.ops.mkldnn._linear_pointwise(x, packed.packed, None, "none", [], "")

    def mkl(weight):
        return lambda x: F.linear(x, weight)

    return [Method("blocked fp32", torch.float32, torch.float32, blocked),
            Method("blocked bf16 w, fp32 x", torch.bfloat16, torch.float32, blocked),
            Method("blocked bf16 w, bf16 x", torch.bfloat16, torch.bfloat16, blocked),
            Method("oneDNN packed fp32", torch.float32, torch.float32, onednn),
            Method("MKL F.linear fp32", torch.float32, torch.float32, mkl)]


def machine() -> str:
    return f"{describe().line()}; blocked kernel ISA: {kernel_isa()}"


def measure(shape: tuple[int, int], rows_list: list[int], chosen: list[Method], working_set: int,
            reps: int) -> list[Result]:
    out_features, in_features = shape
    calls = {}
    for method in chosen:
        copy_bytes = out_features * in_features * method.weight_dtype.itemsize
        copies = max(1, -(-working_set // copy_bytes))
        base = torch.randn(out_features, in_features).to(method.weight_dtype)
        calls[method.name] = ([method.make(base.clone()) for _ in range(copies)], copy_bytes)
    results = []
    for rows in rows_list:
        result = Result(shape, rows)
        inputs = {m.name: torch.randn(rows, in_features).to(m.x_dtype) for m in chosen}
        for name, (fns, _) in calls.items():  # warm up: first-call allocations, page faults
            for fn in fns[:max(1, len(fns) * 8 // max(rows, 8))]:
                fn(inputs[name])
        for _ in range(reps):
            for name, (fns, copy_bytes) in calls.items():
                x = inputs[name]
                # Past 8 rows the FMAs bound the time, not the reads: a shorter rotation keeps the sweep short.
                rotation = fns[:max(1, len(fns) * 8 // max(rows, 8))]
                start = time.perf_counter()
                for fn in rotation:
                    fn(x)
                seconds = (time.perf_counter() - start) / len(rotation)
                if seconds < result.seconds.get(name, float("inf")):
                    result.seconds[name] = seconds
                    result.gbps[name] = copy_bytes / seconds / 1e9
        results.append(result)
        print(f"{out_features} x {in_features}, T = {rows}: "
              + ", ".join(f"{name} {gbps:.1f} GB/s" for name, gbps in result.gbps.items()), flush=True)
    return results


def crossover(results: list[Result], ours: str, theirs: str) -> int | None:
    """Smallest T where ``theirs`` takes less time than ``ours`` summed over the layer shapes."""
    for rows in sorted({r.rows for r in results}):
        at = [r for r in results if r.rows == rows and r.shape in LAYER_SHAPES]
        if sum(r.seconds[theirs] for r in at) < sum(r.seconds[ours] for r in at):
            return rows
    return None


def write_report(out_dir: Path, header: list[str], table: list[Result], sweep: list[Result], names: list[str],
                 cross: int | None) -> None:
    lines = [*header, "", "GB/s of weights read (bf16 rows read half the bytes of fp32 rows):", "",
             "| shape (out x in) | T | " + " | ".join(names) + " |", "|---|---|" + "---|" * len(names)]
    for r in table:
        lines.append(f"| {r.shape[0]} x {r.shape[1]} | {r.rows} | "
                     + " | ".join(f"{r.gbps[n]:.1f}" for n in names) + " |")
    lines += ["", "Crossover sweep, SmolLM2 layer shapes summed (microseconds per call set):", "",
              "| T | blocked fp32 | oneDNN packed fp32 | MKL fp32 |", "|---|---|---|---|"]
    for rows in sorted({r.rows for r in sweep}):
        at = [r for r in sweep if r.rows == rows]
        lines.append(f"| {rows} | " + " | ".join(f"{sum(r.seconds[n] for r in at) * 1e6:.0f}" for n in
                                                 ("blocked fp32", "oneDNN packed fp32", "MKL F.linear fp32")) + " |")
    lines += ["", f"oneDNN's packed GEMM first beats the blocked kernel at T = {cross}"
              if cross else "The blocked kernel was faster at every T swept"]
    text = "\n".join(lines) + "\n"
    print(text)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "gemv.md").write_text(text)

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    shapes = sorted({r.shape for r in table}, key=SHAPES.index)
    fig, axes = plt.subplots(1, len(shapes), figsize=(4 * len(shapes), 3.6), sharey=True)
    for ax, shape in zip(axes, shapes):
        at = [r for r in table if r.shape == shape]
        for name in names:
            ax.plot([r.rows for r in at], [r.gbps[name] for r in at], marker="o", label=name)
        ax.set_title(f"{shape[0]} x {shape[1]}")
        ax.set_xlabel("T (rows)")
        ax.set_xscale("log", base=2)
    axes[0].set_ylabel("GB/s of weights")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out_dir / "gemv.png", dpi=100)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,2,4,8")
    parser.add_argument("--sweep-rows", default="1,4,8,12,16,24,32,64,128")
    parser.add_argument("--working-set-mib", type=int, default=512)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--shapes", default="all", help="'all' or indices into SHAPES, e.g. 0,3")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = parser.parse_args()
    if not gemv_available(torch.device("cpu"), torch.float32):
        print("the C++ kernels did not build; see the warning above")
        return 1
    shapes = SHAPES if args.shapes == "all" else [SHAPES[int(i)] for i in args.shapes.split(",")]
    chosen = methods()
    names = [m.name for m in chosen]
    working_set = args.working_set_mib << 20
    header = [f"Machine: {machine()}", f"Read bandwidth (x.sum over 1 GiB): {read_bandwidth_gbs():.1f} GB/s",
              f"Each call reads its weight from a {args.working_set_mib} MiB rotation of copies; best of "
              f"{args.reps} reps."]
    print("\n".join(header))
    rows = [int(r) for r in args.rows.split(",")]
    table = [r for shape in shapes for r in measure(shape, rows, chosen, working_set, args.reps)]
    sweep_methods = [m for m in chosen if m.name in ("blocked fp32", "oneDNN packed fp32", "MKL F.linear fp32")]
    sweep_rows = [int(r) for r in args.sweep_rows.split(",")]
    sweep = [r for shape in LAYER_SHAPES for r in measure(shape, sweep_rows, sweep_methods, working_set, args.reps)]
    write_report(Path(args.out), header, table, sweep, names, crossover(sweep, "blocked fp32", "oneDNN packed fp32"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
