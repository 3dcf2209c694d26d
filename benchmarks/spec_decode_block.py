"""Block drafters on the shared workload (issue 48): SmolLM2 fp32 greedy, no speculation vs DFlash vs DSpark (fixed
length and confidence-scheduled), 1 / 8 / 32 streams, with a drafter directory (benchmarks/train_drafter.py writes
one; its heads off is the DFlash baseline).

Per variant one engine runs each group of prompts without speculation (requests opt out) and then with it, group by
group (spec_decode.py's ``run_interleaved``: same engine, same load drift); the script checks the outputs are
identical and reports tokens/s, emitted tokens per step, accepted tokens per verification, acceptance by position
and the speedup. Writes benchmarks/results/spec_decode_block.md (--out: another stem).

    python benchmarks/spec_decode_block.py --drafter ~/.cache/deepinfer/drafters/smollm2-135m-dspark
    python benchmarks/spec_decode_block.py --drafter /tmp/tiny-drafter --prompts 2 --new-tokens 16 --batches 1
"""
from __future__ import annotations

import argparse
import dataclasses
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
from benchmarks.spec_decode import _load, run_interleaved  # noqa: E402

VARIANTS = (("dflash", "fixed"), ("dspark", "fixed"), ("dspark", "confidence"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--drafter", required=True, help="the drafter directory (speculative_model)")
    parser.add_argument("--k", type=int, default=5, help="num_speculative_tokens (<= the drafter's block size)")
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--prompts", type=int, default=0, help="prompts of the workload to run (0 = all 32)")
    parser.add_argument("--new-tokens", type=int, default=0, help="0 = the workload's")
    parser.add_argument("--workload", default=str(ROOT.parent / "shared" / "bench" / "workload.py"))
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "spec_decode_block"))
    args = parser.parse_args()
    prompts, new_tokens = load_workload(Path(args.workload))
    prompts = prompts[:args.prompts or len(prompts)]
    params = SamplingParams(max_tokens=args.new_tokens or new_tokens, temperature=0.0, ignore_eos=True)
    flat = {"model": default_model_path(), "num_blocks": 2048, "max_num_seqs": 32, "enable_prefix_caching": False,
            "num_speculative_tokens": args.k, "speculative_model": args.drafter}
    rows = []
    for method, schedule in VARIANTS:
        engine = LLMEngine(EngineConfig.from_flat({**flat, "method": method, "spec_schedule": schedule}))
        for batch in (int(b) for b in args.batches.split(",")):
            group = prompts if batch > 1 else prompts[:max(1, len(prompts) // 8)]
            base, spec = run_interleaved(engine, [("plain", dataclasses.replace(params, speculative=False)),
                                                  (f"{method}-{schedule}", params)], group, batch)
            if spec.token_ids != base.token_ids:
                raise SystemExit(f"{method} ({schedule}), batch {batch}: output differs from plain output")
            rows.append((method, schedule, base, spec))
            print(f"{method} {schedule} batch {batch}: plain {base.tok_s:.1f} tok/s, spec {spec.tok_s:.1f} tok/s "
                  f"({spec.tokens_per_step:.2f} tokens/step, {spec.accepted_per_step:.2f} tokens/verification), "
                  f"speedup {spec.tok_s / base.tok_s:.2f}x", flush=True)
    machine = describe()
    lines = ["# Block drafters (DFlash, DSpark) on the shared workload", "",
             f"Machine: {machine.cpu}, {machine.cores} cores, load average at the end {_load()}. SmolLM2-135M "
             f"fp32, greedy, {params.max_tokens} tokens a request, k={args.k}, drafter {args.drafter}. Same-engine "
             "ratios (plain = the same engine's requests opting out); outputs identical (checked).", "",
             "| method | schedule | batch | plain tok/s | spec tok/s | tokens / step | tokens / verification "
             "| acceptance by position | speedup |", "|---|---|---|---|---|---|---|---|---|"]
    for method, schedule, base, spec in rows:
        per_pos = ", ".join(f"{r:.2f}" for r in spec.acceptance_per_position or [])
        lines.append(f"| {method} | {schedule} | {base.batch} | {base.tok_s:.1f} | {spec.tok_s:.1f} "
                     f"| {spec.tokens_per_step:.2f} | {spec.accepted_per_step:.2f} | {per_pos} "
                     f"| {spec.tok_s / base.tok_s:.2f}x |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).with_suffix(".md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
