"""Issue 48's benchmark: speculation on the shared workload (benchmarks/workload.py: 32 chat prompts, greedy, EOS
ignored), SmolLM2 (fp32 by default; --dtype bfloat16, --weight-format packed), no speculation vs n-gram vs DFlash vs
DSpark at a fixed length and confidence-scheduled, 1 / 8 / 32 streams, with a drafter directory
(benchmarks/train_drafter.py writes one; its heads off is the DFlash baseline).

One engine per drafting method (n-gram, DFlash, DSpark) runs each group of prompts without speculation (requests opt
out) and then with each of its variants (DSpark: fixed length, then the confidence schedule, switched on the same
engine), group by group (spec_decode.py's ``run_interleaved``: same engine, same load drift); each engine's plain
run is its own baseline. The script checks every output equals the plain one and reports tokens/s, emitted tokens
per step, tokens per verification, acceptance by position, the lengths the schedule chose, and the speedup over
the same engine's plain run. Writes benchmarks/results/spec_decode_block.md and .png (--out: another stem).

    python benchmarks/spec_decode_block.py --drafter ~/.cache/deepinfer/drafters/smollm2-135m-dspark
    python benchmarks/spec_decode_block.py --drafter /tmp/tiny-drafter --prompts 2 --new-tokens 16 --batches 1
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from backend_lib.core.config import EngineConfig  # noqa: E402
from backend_lib.core.model_path import default_model_path  # noqa: E402
from backend_lib.core.sampling_params import SamplingParams  # noqa: E402
from backend_lib.engine.llm_engine import LLMEngine  # noqa: E402
from benchmarks.machine import describe  # noqa: E402
from benchmarks.offline_throughput import load_workload  # noqa: E402
from benchmarks.spec_decode import Result, _load, run, run_interleaved  # noqa: E402
from benchmarks.workload import WORKLOAD_FILE  # noqa: E402

# method -> the schedules its engine runs in turn (n-gram has no schedule: its drafts are its matches)
METHODS = {"ngram": ("fixed",), "dflash": ("fixed",), "dspark": ("fixed", "confidence")}


def run_method(flat: dict, method: str, schedules: tuple[str, ...], prompts: list, params: SamplingParams,
               batch: int) -> list[tuple[str, Result, Result]]:
    engine = LLMEngine(EngineConfig.from_flat({**flat, "method": method}))
    # a first step pays one-off costs (allocations, kernel caches): not in the first group's plain run
    run(engine, "warm", prompts[:1], dataclasses.replace(params, max_tokens=4), 1)
    drafter = engine.runner.block_drafter
    names = [f"{method}-{s}" for s in schedules]
    runs = [("plain", dataclasses.replace(params, speculative=False))] + [(n, params) for n in names]

    def prepare(i: int) -> None:  # the DSpark engine's second run: the same drafter, confidence-scheduled
        if drafter is not None and i > 0:
            drafter.fixed_length = schedules[i - 1] == "fixed"

    base, *specs = run_interleaved(engine, runs, prompts, batch, prepare)
    for schedule, spec in zip(schedules, specs):
        if spec.token_ids != base.token_ids:
            raise SystemExit(f"{method} ({schedule}), batch {batch}: output differs from plain output")
        print(f"{method} {schedule} batch {batch}: plain {base.tok_s:.1f} tok/s, spec {spec.tok_s:.1f} tok/s "
              f"({spec.tokens_per_step:.2f} tokens/step, {spec.accepted_per_step:.2f} tokens/verification, "
              f"lengths {spec.chosen_lengths}), speedup {spec.tok_s / base.tok_s:.2f}x", flush=True)
    return [(schedule, base, spec) for schedule, spec in zip(schedules, specs)]


def mean_length(lengths: list[int] | None) -> str:
    if not lengths or not sum(lengths):
        return "-"
    return f"{sum(n * c for n, c in enumerate(lengths)) / sum(lengths):.2f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--drafter", required=True, help="the drafter directory (speculative_model)")
    parser.add_argument("--k", type=int, default=5, help="num_speculative_tokens (<= the drafter's block size)")
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--prompts", type=int, default=0, help="prompts of the workload to run (0 = all 32)")
    parser.add_argument("--batch1-prompts", type=int, default=4, help="prompts of the one-stream runs")
    parser.add_argument("--groups", type=int, default=0, help="groups of B prompts a B-stream run takes (0 = all)")
    parser.add_argument("--new-tokens", type=int, default=0, help="0 = the workload's")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--weight-format", default="dequantize", choices=("dequantize", "packed"))
    parser.add_argument("--workload", default=str(WORKLOAD_FILE))
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "spec_decode_block"))
    parser.add_argument("--merge", default="", help="rows of an earlier run of the same setup (its .json) to report "
                        "beside this run's (e.g. n-gram measured while the drafter trained)")
    args = parser.parse_args()
    prompts, new_tokens = load_workload(Path(args.workload))
    prompts = prompts[:args.prompts or len(prompts)]
    params = SamplingParams(max_tokens=args.new_tokens or new_tokens, temperature=0.0, ignore_eos=True)
    flat = {"model": default_model_path(), "dtype": args.dtype, "weight_format": args.weight_format,
            "num_blocks": 2048, "max_num_seqs": 32, "enable_prefix_caching": False,
            "num_speculative_tokens": args.k, "speculative_model": args.drafter}
    rows: list = []
    if args.merge:
        for row in json.loads(Path(args.merge).read_text()):
            rows.append((row["method"], row["batch"], row["schedule"], Result(**row["base"]), Result(**row["spec"])))
    for batch in (int(b) for b in args.batches.split(",")):
        group = prompts[:args.batch1_prompts] if batch == 1 else prompts[:batch * args.groups or len(prompts)]
        for method in args.methods.split(","):
            rows += [(method, batch, *row) for row in run_method(flat, method, METHODS[method], group, params, batch)]
    write_results(rows, params, args)
    return 0


def write_results(rows: list[tuple[str, int, str, Result, Result]], params: SamplingParams, args) -> None:
    rows = sorted(rows, key=lambda r: (r[1], list(METHODS).index(r[0]), r[2]))
    machine = describe()
    lines = ["# Speculation on the shared workload: n-gram, DFlash, DSpark", "",
             f"Machine: {machine.cpu}, {machine.cores} cores, load average at the end {_load()}. SmolLM2-135M "
             f"{args.dtype} ({args.weight_format} weights), greedy, {params.max_tokens} tokens a request, k={args.k} "
             f"for every method, drafter {Path(args.drafter).name}. One engine per method; plain = that engine's "
             "requests opting out, run group by group in turn with the method (same-engine ratios); outputs "
             "identical (checked). Chosen lengths: request-steps whose proposer chose 0..k drafts for the next "
             "step.", "",
             "| method | schedule | streams | plain tok/s | spec tok/s | tokens / step | tokens / verification "
             "| acceptance by position | chosen lengths 0..k (mean) | speedup |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for method, batch, schedule, base, spec in rows:
        per_pos = ", ".join(f"{r:.2f}" for r in spec.acceptance_per_position or [])
        lengths = (f"{spec.chosen_lengths} ({mean_length(spec.chosen_lengths)})" if spec.chosen_lengths
                   else "-")
        lines.append(f"| {method} | {schedule if method != 'ngram' else '-'} | {batch} | {base.tok_s:.1f} "
                     f"| {spec.tok_s:.1f} | {spec.tokens_per_step:.2f} | {spec.accepted_per_step:.2f} | {per_pos} "
                     f"| {lengths} | {spec.tok_s / base.tok_s:.2f}x |")
    stem = Path(args.out)
    stem.parent.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    stem.with_suffix(".json").write_text(json.dumps([
        {"method": m, "batch": b, "schedule": s, "base": {**dataclasses.asdict(base), "token_ids": []},
         "spec": {**dataclasses.asdict(spec), "token_ids": []}} for m, b, s, base, spec in rows], indent=1))

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    batches = sorted({batch for _, batch, *_ in rows})
    variants = list(dict.fromkeys(f"{m}" if m == "ngram" else f"{m} {s}" for m, _, s, _, _ in rows))
    fig, ax = plt.subplots(figsize=(8, 3.8))
    width = 0.8 / len(variants)
    for v, variant in enumerate(variants):
        for b, batch in enumerate(batches):
            found = [(base, spec) for m, bt, s, base, spec in rows
                     if bt == batch and (m if m == "ngram" else f"{m} {s}") == variant]
            if not found:
                continue
            base, spec = found[0]
            x = b + (v - (len(variants) - 1) / 2) * width
            ax.bar(x, spec.tok_s / base.tok_s, width=width, color=f"C{v}", label=variant if b == 0 else None)
            ax.text(x, spec.tok_s / base.tok_s, f"{spec.tok_s / base.tok_s:.2f}", ha="center", va="bottom",
                    fontsize=7)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(batches)), [f"{b} stream{'s' if b > 1 else ''}" for b in batches])
    ax.set_ylabel("tok/s over no speculation")
    ax.set_title(f"SmolLM2-135M {args.dtype}, shared workload (same-engine ratios, loaded host)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(stem.with_suffix(".png"), dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())
