"""Compiled (torch.compile regions) vs eager decode step for SmolLM2-135M, side by side in one process.

One decode step = all 30 layers + final norm + lm_head for B requests with a 100-token context (block table
width bucket 8 x 16 tokens), three ways: eager plain torch (F.linear, block gather + SDPA), eager with the host
kernels (the blocked few-row GEMM and oneDNN's packed GEMM by `GemvPolicy.for_host`, and the C++ decode attention: the
engine's host default), and compiled with the
same host kernels. The compiled path is CompiledModel (backend_lib/neuron/regions.py): the same
padding / per-layer cache views the engine uses; a fourth column runs the same step with
`compile_scope="layer"` (one graph per bucket, called by each layer). The four alternate rep by rep so load changes on a
shared machine hit them alike. Writes benchmarks/results/compiled_decode.md and .png.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from backend_lib.core.model_path import default_model_path  # noqa: E402
from backend_lib.models.loading.loader import load_model  # noqa: E402
from backend_lib.neuron.buckets import BucketSpec  # noqa: E402
from backend_lib.neuron.regions import CompiledModel  # noqa: E402
from kernels.attention_metadata import AttentionMetadata  # noqa: E402
from kernels.cpu_kernels import load_cpu_kernels  # noqa: E402

BS, WIDTH, CONTEXT = 16, 8, 100


def decode_inputs(batch: int):
    tables = torch.arange(batch * WIDTH, dtype=torch.int32).view(batch, WIDTH)
    slots = tables[:, (CONTEXT - 1) // BS].long() * BS + (CONTEXT - 1) % BS
    meta = AttentionMetadata(BS, slots, batch, 1, tables, torch.full((batch,), CONTEXT, dtype=torch.int32),
                             0, [], [], torch.zeros(0, 0, dtype=torch.int32))
    return torch.randint(0, 49152, (batch,)), torch.full((batch,), CONTEXT - 1), meta


def set_host_kernels(model: torch.nn.Module, packs: dict[tuple[str, str], object] | None
                     ) -> dict[tuple[str, str], object]:
    """Swap the model's packed weights (oneDNN's and the blocked few-row kernel's) and C++ decode attention (None:
    plain F.linear and torch attention); returns the packed weights it had."""
    for layer in model.layers:
        layer.self_attn.cpu_decode_kernel = packs is not None
    had = {}
    for name, module in model.named_modules():  # the model itself first, as ""
        for attr in ("packed_head", "packed", "blocked_head", "blocked"):
            if hasattr(module, attr):
                had[name, attr] = getattr(module, attr)
                setattr(module, attr, None if packs is None else packs[name, attr])
    return had


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--threads", type=int, default=0)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    model = load_model(default_model_path(), torch.float32).eval()
    model.pack_for_cpu()  # what the engine does on the host before it builds the regions
    if not load_cpu_kernels():
        raise SystemExit("the C++ host kernels did not build (see the warning above)")
    model.use_cpu_attention()
    packs = set_host_kernels(model, None)
    set_host_kernels(model, packs)
    num_blocks = max(batches) * WIDTH
    caches = [torch.randn(s) * 0.1 for s in model.kv_cache_shapes((num_blocks + 1) * BS)]
    spec = BucketSpec(tuple(batches), (WIDTH,), (), BS)
    compiled = CompiledModel(model, spec, args.backend, scratch_block=num_blocks)
    per_layer = CompiledModel(model, spec, args.backend, scratch_block=num_blocks, scope="layer")
    load_before = os.getloadavg()[0]
    compile_s = compiled.warm_up(caches, progress=True)
    layer_compile_s = per_layer.warm_up(caches, progress=True)

    def step(name: str, ids, pos, meta) -> torch.Tensor:
        if name == "eager, plain torch":
            set_host_kernels(model, None)
            try:
                return model.compute_logits(model(ids, pos, caches, meta))
            finally:
                set_host_kernels(model, packs)
        m = per_layer if name.endswith("per layer") else compiled if name.startswith("compiled") else model
        return m.compute_logits(m(ids, pos, caches, meta))

    names = ("eager, plain torch", "eager, host kernels", f"compiled ({args.backend}), host kernels",
             f"compiled ({args.backend}), per layer")
    rows = []
    with torch.inference_mode():
        for batch in batches:
            ids, pos, meta = decode_inputs(batch)
            logits = {name: step(name, ids, pos, meta) for name in names}
            ref = logits[names[1]]
            same = all(torch.equal(logits[n].argmax(-1), ref.argmax(-1)) for n in names[2:])
            diff = max(float((logits[n] - ref).abs().max()) for n in names[2:])
            times = {name: [] for name in names}
            for _ in range(args.reps):
                for name in names:
                    t = time.perf_counter()
                    step(name, ids, pos, meta)
                    times[name].append(time.perf_counter() - t)
            plain, eager, comp, layer = (statistics.median(times[n]) for n in names)
            rows.append((batch, plain * 1e3, eager * 1e3, comp * 1e3, layer * 1e3, eager / comp, eager / layer,
                         plain / comp, batch / comp, same, diff))
            print(f"batch {batch}: eager plain {plain * 1e3:.1f} ms, eager host kernels {eager * 1e3:.1f} ms, compiled "
                  f"{comp * 1e3:.1f} ms, per layer {layer * 1e3:.1f} ms: {eager / comp:.2f}x / {eager / layer:.2f}x / "
                  f"{plain / comp:.2f}x, greedy same {same}, max |dlogit| {diff:.2e}", flush=True)
    load_after = os.getloadavg()[0]
    out = ROOT / "benchmarks" / "results"
    out.mkdir(parents=True, exist_ok=True)
    lines = [
        "# Compiled vs eager decode step (SmolLM2-135M, fp32, host CPU)", "",
        f"Backend `{args.backend}`, context {CONTEXT} tokens, median of {args.reps} alternating reps; "
        f"torch threads {torch.get_num_threads()}, {os.cpu_count()} cores shared with other jobs "
        f"(1-min load average {load_before:.1f} before, {load_after:.1f} after). Warm-up compile of "
        f"{len(compiled.stats.compiled_keys)} graphs: {compile_s:.0f} s (per layer: {layer_compile_s:.0f} s). "
        "Per layer: `compile_scope=\"layer\"`, one graph per bucket run by each of the 30 layers. "
        "The compiled step and the eager host-kernel "
        "step call the same packed-weight GEMM (kernels/onednn_gemm.py) and C++ decode attention "
        "(kernels/csrc); the plain eager step is F.linear (MKL) and block gather + SDPA. "
        "Logit diff: compiled against eager host kernels.", "",
        "| batch | eager plain ms | eager host kernels ms | compiled ms | compiled per layer ms | compiled vs eager "
        "host kernels | per layer vs eager host kernels | compiled vs eager plain | compiled tok/s | greedy same | "
        "max abs logit diff |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {b} | {p:.1f} | {e:.1f} | {c:.1f} | {lc:.1f} | {s1:.2f}x | {s3:.2f}x | {s2:.2f}x | {tc:.1f} | "
              f"{same} | {d:.1e} |" for b, p, e, c, lc, s1, s3, s2, tc, same, d in rows]
    (out / "compiled_decode.md").write_text("\n".join(lines) + "\n")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    xs = range(len(rows))
    for i, name in enumerate(names):
        ax.bar([x + (i - 1.5) * 0.2 for x in xs], [r[0] / r[1 + i] * 1e3 for r in rows], 0.2, label=name)
    ax.set_xticks(list(xs), [f"batch {r[0]}" for r in rows])
    ax.set_ylabel("decode tokens/s")
    ax.set_title("SmolLM2-135M decode step, host CPU")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "compiled_decode.png", dpi=100)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
