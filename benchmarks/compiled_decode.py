"""Compiled (torch.compile regions) vs eager decode step for SmolLM2-135M, side by side in one process.

One decode step = all 30 layers + final norm + lm_head for B requests with a 100-token context (block table
width bucket 8 x 16 tokens). The compiled path is CompiledModel (backend_lib/neuron/regions.py): the same
padding / per-layer cache views the engine uses. Eager and compiled alternate rep by rep so load changes on a
shared machine hit both alike. Writes benchmarks/results/compiled_decode.md and .png.
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

from backend_lib.models.loader import default_model_path, load_model  # noqa: E402
from backend_lib.neuron.buckets import BucketSpec  # noqa: E402
from backend_lib.neuron.regions import CompiledModel  # noqa: E402
from kernels.attention_metadata import AttentionMetadata  # noqa: E402

BS, WIDTH, CONTEXT = 16, 8, 100


def decode_inputs(batch: int):
    tables = torch.arange(batch * WIDTH, dtype=torch.int32).view(batch, WIDTH)
    slots = tables[:, (CONTEXT - 1) // BS].long() * BS + (CONTEXT - 1) % BS
    meta = AttentionMetadata(BS, slots, batch, 1, tables, torch.full((batch,), CONTEXT, dtype=torch.int32),
                             0, [], [], torch.zeros(0, 0, dtype=torch.int32))
    return torch.randint(0, 49152, (batch,)), torch.full((batch,), CONTEXT - 1), meta


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
    num_blocks = max(batches) * WIDTH
    caches = [torch.randn(s) * 0.1 for s in model.kv_cache_shapes((num_blocks + 1) * BS)]
    spec = BucketSpec(tuple(batches), (WIDTH,), (), BS)
    compiled = CompiledModel(model, spec, args.backend, scratch_block=num_blocks)
    load_before = os.getloadavg()[0]
    compile_s = compiled.warm_up(caches, progress=True)
    rows = []
    with torch.inference_mode():
        for batch in batches:
            ids, pos, meta = decode_inputs(batch)
            eager_logits = model.compute_logits(model(ids, pos, caches, meta))
            got = compiled.compute_logits(compiled(ids, pos, caches, meta))
            same = bool(torch.equal(got.argmax(-1), eager_logits.argmax(-1)))
            diff = float((got - eager_logits).abs().max())
            times = {"eager": [], "compiled": []}
            for _ in range(args.reps):
                for name, m in (("eager", model), ("compiled", compiled)):
                    t = time.perf_counter()
                    m.compute_logits(m(ids, pos, caches, meta))
                    times[name].append(time.perf_counter() - t)
            e, c = statistics.median(times["eager"]), statistics.median(times["compiled"])
            rows.append((batch, e * 1e3, c * 1e3, e / c, batch / e, batch / c, same, diff))
            print(f"batch {batch}: eager {e * 1e3:.1f} ms, compiled {c * 1e3:.1f} ms, speedup {e / c:.2f}x, "
                  f"greedy same {same}, max |dlogit| {diff:.2e}", flush=True)
    load_after = os.getloadavg()[0]
    out = ROOT / "benchmarks" / "results"
    out.mkdir(parents=True, exist_ok=True)
    lines = [
        "# Compiled vs eager decode step (SmolLM2-135M, fp32, host CPU)", "",
        f"Backend `{args.backend}`, context {CONTEXT} tokens, median of {args.reps} alternating reps; "
        f"torch threads {torch.get_num_threads()}, {os.cpu_count()} cores shared with other jobs "
        f"(1-min load average {load_before:.1f} before, {load_after:.1f} after). Warm-up compile of "
        f"{len(compiled.stats.compiled_keys)} graphs: {compile_s:.0f} s.", "",
        "| batch | eager ms/step | compiled ms/step | speedup | eager tok/s | compiled tok/s | greedy same | "
        "max abs logit diff |", "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {b} | {e:.1f} | {c:.1f} | {s:.2f}x | {te:.1f} | {tc:.1f} | {same} | {d:.1e} |"
              for b, e, c, s, te, tc, same, d in rows]
    (out / "compiled_decode.md").write_text("\n".join(lines) + "\n")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r[4] for r in rows], 0.4, label="eager")
    ax.bar([x + 0.2 for x in xs], [r[5] for r in rows], 0.4, label=f"compiled ({args.backend})")
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
