"""Engram's cost in a decode step: the same random DeepSeek-V4 with and without Engram layers whose tables are large
(hundreds of MB in host memory), batch 1 / 8 / 32; the gather (hash + table lookup) overlapped with the first
layers or not; resident memory per rank at TP=1 and TP=2.

Model: the backbone of benchmarks/deepseek_v4_decode.py (hidden 512, 6 layers: sliding, CSA, HCA; 16 experts;
hc_mult 4; fp32), Engram on layers 1 and 4 (max_ngram_size 3, 8 heads of 64 per order, kernel 4, table sizes
50,000 per head before the prime search: 1.6 M rows, ~205 MB a layer). The three engines run one after the other
for each batch size, each its median decode step over ``--steps`` steps after the prefill; the gather alone is
timed on the same ids. Writes benchmarks/results/engram.md and .png.
Run: `python benchmarks/engram.py` on a quiet machine (nothing else running).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from backend_lib.core.config import EngineConfig  # noqa: E402
from backend_lib.core.sampling_params import SamplingParams  # noqa: E402
from backend_lib.engine.llm_engine import LLMEngine  # noqa: E402
from backend_lib.tools.tiny import make_tiny  # noqa: E402
from benchmarks.deepseek_v4_decode import MODEL_OVERRIDES  # noqa: E402
from benchmarks.machine import describe  # noqa: E402

ENGRAM_LAYERS = (1, 4)
ENGRAM = dict(engram_vocab_size=[50000, 50000], max_ngram_size=3, n_embed_per_ngram=512, n_head_per_ngram=8,
              kernel_size=4, pad_id=2, seed=0)
PROMPT = 32
VARIANTS = ("no Engram", "Engram, gather overlapped", "Engram, gather first")


def _engine(path: Path, batch: int, **settings) -> LLMEngine:
    return LLMEngine(EngineConfig.from_flat({"model": str(path), "max_model_len": 1024, "block_size": 16,
                                             "max_num_seqs": batch, "max_num_batched_tokens": batch * PROMPT,
                                             "num_blocks": batch * 8 + 8, **settings}))


def _prompts(batch: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(batch)
    return torch.randint(3, 300, (batch, PROMPT), generator=gen).tolist()


def decode_step_ms(engine: LLMEngine, batch: int, steps: int) -> float:
    """Median wall time of a decode step of ``batch`` requests (every request past its prefill)."""
    run = time.perf_counter_ns()  # request ids unique across runs on one engine
    params = SamplingParams(max_tokens=steps + 4, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(_prompts(batch)):
        engine.add_request(f"b{batch}-{run}-{i}", prompt, params)
    engine.step()  # the prefill (one chunk per request: the budget holds them all)
    times = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times[1:-1])


def gather_ms(engine: LLMEngine, batch: int, repeats: int = 50) -> float:
    model = engine.runner.model
    model = getattr(model, "model", model)
    ids = torch.randint(3, 300, (batch,))
    history = torch.randint(3, 300, (batch, model.token_history))
    model.engram_gather(ids, history)
    start = time.perf_counter()
    for _ in range(repeats):
        model.engram_gather(ids, history)
    return 1e3 * (time.perf_counter() - start) / repeats


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        children = (task / "children").read_text().split()
        out += [int(c) for c in children]
    return out


def print_resident_mb(path: Path, tp: int) -> None:
    """In a fresh process: resident MB of each rank's process (this one is the driver) with the model loaded."""
    engine = _engine(path, 1, tensor_parallel_size=tp)
    try:
        workers = [p for p in _children(os.getpid()) if "executor.worker" in Path(f"/proc/{p}/cmdline").read_text()]
        print(json.dumps([_rss_mb(os.getpid())] + [_rss_mb(p) for p in workers]))
    finally:
        engine.close()


def resident_mb(path: Path, tp: int) -> list[float]:
    result = subprocess.run([sys.executable, __file__, "--resident", str(path), "--tp", str(tp)], check=True,
                            capture_output=True, text=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def table_mb(path: Path) -> float:
    engine = _engine(path, 1)
    try:
        model = getattr(engine.runner.model, "model", engine.runner.model)
        return sum(model.layers[i].engram.multi_head_embedding.embedding.weight.nbytes
                   for i in ENGRAM_LAYERS) / 2**20
    finally:
        engine.close()


def plot(results: dict[int, dict[str, float]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = sorted(results)
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.25
    for k, variant in enumerate(VARIANTS):
        ax.bar([i + (k - 1) * width for i in range(len(batches))], [results[b][variant] for b in batches], width,
               label=variant)
    ax.set_xticks(range(len(batches)), [f"batch {b}" for b in batches])
    ax.set_ylabel("decode step, ms (median)")
    ax.set_title("DeepSeek-V4 (random, 6 layers) with 2 Engram layers of ~205 MB tables")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    parser.add_argument("--resident", default="", help=argparse.SUPPRESS)  # the per-rank memory subprocess
    parser.add_argument("--tp", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.resident:
        print_resident_mb(Path(args.resident), args.tp)
        return 0
    if args.threads:
        torch.set_num_threads(args.threads)
    machine = describe()
    print(machine.line())
    work = Path(tempfile.mkdtemp(prefix="engram-bench-"))
    plain = make_tiny("deepseek_v4", work / "plain", seed=3, initializer_range=0.05, overrides=MODEL_OVERRIDES)
    engram = make_tiny("deepseek_v4", work / "engram", seed=3, initializer_range=0.05, overrides=MODEL_OVERRIDES,
                       engram_layers=ENGRAM_LAYERS, engram=ENGRAM)
    tables = table_mb(engram)
    results: dict[int, dict[str, float]] = {}
    gathers: dict[int, float] = {}
    for batch in [int(b) for b in args.batches.split(",")]:
        plain_engine, engram_engine = _engine(plain, batch), _engine(engram, batch)
        model = getattr(engram_engine.runner.model, "model", engram_engine.runner.model)
        decode_step_ms(plain_engine, batch, 4)  # warm-up: kernels loaded, buffers sized
        decode_step_ms(engram_engine, batch, 4)
        row = {variant: float("inf") for variant in VARIANTS}
        for _ in range(args.rounds):  # alternating, each variant's best median counts
            row[VARIANTS[0]] = min(row[VARIANTS[0]], decode_step_ms(plain_engine, batch, args.steps))
            for variant, overlap in ((VARIANTS[1], True), (VARIANTS[2], False)):
                model.engram_prefetch.overlap = overlap
                row[variant] = min(row[variant], decode_step_ms(engram_engine, batch, args.steps))
        gathers[batch] = gather_ms(engram_engine, batch)
        plain_engine.close()
        engram_engine.close()
        results[batch] = row
        print(batch, row, f"gather {gathers[batch]:.3f} ms")
    memory = {tp: (resident_mb(plain, tp), resident_mb(engram, tp)) for tp in (1, 2)}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    lines = ["# Engram in a decode step", "", f"Machine: {machine.line()}.", "",
             f"Engram tables: {tables:.0f} MB in all (layers {list(ENGRAM_LAYERS)}), fp32.", "",
             "| batch | no Engram, ms | Engram overlapped, ms | Engram gather first, ms | gather alone, ms | "
             "overhead (overlapped) |", "|---|---|---|---|---|---|"]
    for batch, row in results.items():
        lines.append(f"| {batch} | {row[VARIANTS[0]]:.2f} | {row[VARIANTS[1]]:.2f} | {row[VARIANTS[2]]:.2f} | "
                     f"{gathers[batch]:.3f} | {row[VARIANTS[1]] / row[VARIANTS[0]] - 1:+.1%} |")
    lines += ["", "| tensor parallel | resident MB per rank, no Engram | with Engram |", "|---|---|---|"]
    for tp, (without, with_engram) in memory.items():
        lines.append(f"| TP={tp} | {', '.join(f'{m:.0f}' for m in without)} | "
                     f"{', '.join(f'{m:.0f}' for m in with_engram)} |")
    (out / "engram.md").write_text("\n".join(lines) + "\n")
    plot(results, out / "engram.png")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
