"""bf16 x bf16 GEMMs at decode and prefill row counts: the blocked kernel's AMX tile passes, its vdpbf16ps passes
and oneDNN's packed bf16 GEMM, side by side in one run (the crossovers behind GemvPolicy.for_host for bf16).

Each method runs SmolLM2-135M's four layer projections (qkv 960x576, o 576x576, gate_up 3072x576, down 576x1536)
for all 30 layers, on 30 distinct weight copies, so the weights stream from memory as in a decode step; best of
5 passes. Prints the machine and writes benchmarks/results/bf16_gemm.md and .png.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.machine import best_seconds, describe  # noqa: E402
from kernels.gemv import block_weight, blocked_linear, gemv_available, kernel_isa  # noqa: E402
from kernels.onednn_gemm import PackedWeight, packed_linear  # noqa: E402

LAYER_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (out, in)
ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


def time_method(method: str, weights, rows: int, passes: int = 5) -> float:
    """Milliseconds for one pass over every layer's projections (best of ``passes``)."""
    inputs = {i: torch.randn(rows, i).bfloat16() for i in {i for _, i in LAYER_SHAPES}}

    def one_pass():
        for (out, in_features), plain, blocked, packed in weights:
            x = inputs[in_features]
            if method == "onednn":
                packed_linear(x, plain, None, packed)
            else:
                blocked_linear(x, blocked, None, out, method)

    return best_seconds(one_pass, passes) * 1e3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = parser.parse_args()
    if not gemv_available(torch.device("cpu"), torch.bfloat16):
        raise SystemExit("the C++ kernels did not build")
    machine = describe()
    print(machine.line(), flush=True)
    methods = ["onednn", "avx512_bf16"] + (["amx_bf16"] if kernel_isa() == "amx_bf16" else [])
    gen = torch.Generator().manual_seed(0)
    weights = []
    for _ in range(args.layers):
        for out, in_features in LAYER_SHAPES:
            plain = torch.randn(out, in_features, generator=gen).bfloat16()
            weights.append(((out, in_features), plain, block_weight(plain), PackedWeight(plain)))
    results = {}
    for rows in ROWS:
        results[rows] = {m: time_method(m, weights, rows) for m in methods}
        print(rows, {m: round(v, 2) for m, v in results[rows].items()}, flush=True)
    header = "| rows | " + " | ".join(f"{m} (ms)" for m in methods) + " | best blocked / oneDNN |"
    lines = [f"bf16 GEMMs over SmolLM2's {args.layers} layers' projections, weights streamed from memory, best of 5.",
             "", machine.line(), "", header, "|" + "---|" * (len(methods) + 2)]
    for rows, times in results.items():
        best_blocked = min(t for m, t in times.items() if m != "onednn")
        lines.append(f"| {rows} | " + " | ".join(f"{times[m]:.2f}" for m in methods)
                     + f" | {best_blocked / times['onednn']:.2f}x |")
    text = "\n".join(lines) + "\n"
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bf16_gemm.md").write_text(text)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    for m in methods:
        ax.plot(list(results), [results[r][m] for r in results], marker="o", label=m)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("activation rows")
    ax.set_ylabel(f"ms for {args.layers} layers' projections")
    ax.set_title("bf16 GEMMs, weights from memory")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "bf16_gemm.png", dpi=100)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
