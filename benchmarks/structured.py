"""Structured output's cost: the shared workload's prompts decoded with a JSON schema vs without, side by side in one
run on SmolLM2 (eager engine, greedy), at 32 streams (one continuous batch) and 1.

Per run: generated tokens, seconds, tokens/s, and the median decode step (steps where every request of a full batch
decodes: the grammar's cost per step is the matchers' mask fill on the host and the matchers taking the tokens,
plus, for these greedy rows, the screened head under the masks (kernels/masked_head_screen.py) where a free batch
takes the plain screen; an unconstrained batch takes the path it took before structured output existed). An
untimed short run first takes the one-time costs (first prefill shapes, kernel warm-up) out of the first table row.
A constrained request stops when its grammar completes, so its run generates fewer tokens than 128 per prompt;
tokens/s and the step time compare, the totals do not. Target (issue 35): a constrained batch-32 step costs at most
1.10x an unconstrained one, and constrained throughput at least 1.3x vLLM CPU's: vLLM runs right after, in the same
sitting, with the same schema (benchmarks/vllm_structured.py through the anchors' /tmp/anchors/run_vllm_anchor.sh;
skipped with a note when ../shared/bench/anchors/setup.sh has not made it).

Prints the machine and a table; writes benchmarks/results/structured.md and .png. Run nothing else meanwhile.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from backend_lib.core.config import EngineConfig  # noqa: E402
from backend_lib.core.sampling_params import SamplingParams  # noqa: E402
from backend_lib.engine.llm_engine import LLMEngine  # noqa: E402
from backend_lib.core.model_path import default_model_path  # noqa: E402
from backend_lib.structured_output.constraints import parse_constraint  # noqa: E402
from benchmarks.machine import describe, measure_limits  # noqa: E402
from benchmarks.plots import paired_bars  # noqa: E402
from benchmarks.structured_schema import SCHEMA  # noqa: E402
from benchmarks.workload import FLOAT_WEIGHTS, WORKLOAD_FILE  # noqa: E402

VLLM_ANCHOR = Path("/tmp/anchors/run_vllm_anchor.sh")

@dataclass
class Run:
    label: str
    streams: int
    tokens: int
    seconds: float
    step_ms: float  # median full-batch decode step
    finished_by_grammar: int

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds


def load_prompts(path: Path) -> tuple[list, int]:
    spec = importlib.util.spec_from_file_location("workload", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.prompts(), module.NEW_TOKENS


def run(engine: LLMEngine, prompts: list, new_tokens: int, constrained: bool, label: str) -> Run:
    constraint = parse_constraint({"structured_outputs": {"json": SCHEMA}}) if constrained else None
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=not constrained,
                            structured_outputs=constraint)
    if constrained:  # compile once before timing: the grammar cache serves every request after
        engine.grammar_compiler.compile(constraint)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{label}-{len(prompts)}-{i}", prompt, params)
    tokens = stopped = 0
    steps: list[float] = []
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        scheduler = engine.scheduler
        full_decode = (not scheduler.waiting and len(scheduler.running) == len(prompts)
                       and all(r.num_computed_tokens >= r.num_prompt_tokens for r in scheduler.running))
        step_start = time.perf_counter()
        outputs = engine.step()
        if full_decode:
            steps.append(time.perf_counter() - step_start)
        for out in outputs:
            tokens += len(out.new_token_ids)
            stopped += out.finished and out.finish_reason == "stop"
    seconds = time.perf_counter() - start
    return Run(label, len(prompts), tokens, seconds, 1e3 * statistics.median(steps) if steps else float("nan"),
               stopped if constrained else 0)


def vllm_runs(workload: Path) -> list[dict]:
    """vLLM CPU's free and constrained runs at 32 streams (one JSON line each), or [] without the anchor."""
    if not VLLM_ANCHOR.exists():
        print(f"vLLM CPU not run: {VLLM_ANCHOR} missing (../shared/bench/anchors/setup.sh 4 makes it)", flush=True)
        return []
    out = subprocess.run([str(VLLM_ANCHOR), str(ROOT / "benchmarks" / "vllm_structured.py"), str(workload), "32"],
                         capture_output=True, text=True, timeout=1800)
    runs = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    if not runs:
        print(f"vLLM CPU run failed (exit {out.returncode}):\n{out.stderr[-2000:]}", flush=True)
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", default=str(WORKLOAD_FILE))
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    parser.add_argument("--streams", default="32,1")
    args = parser.parse_args()
    prompts, new_tokens = load_prompts(Path(args.workload))
    machine = describe().line()
    limits = measure_limits().line()
    print(f"Machine: {machine}; {limits}", flush=True)
    engine = LLMEngine(EngineConfig.from_flat({"model": default_model_path(), **FLOAT_WEIGHTS, "max_num_seqs": 32}))
    run(engine, prompts, 4, False, "warm-up")  # untimed: one-time costs stay out of the first row's seconds
    runs = []
    for streams in (int(s) for s in args.streams.split(",")):
        for constrained in (False, True):
            label = "JSON schema" if constrained else "free"
            runs.append(run(engine, prompts[:streams], new_tokens, constrained, label))
            print(runs[-1], flush=True)
    engine.close()
    peers = vllm_runs(Path(args.workload))
    lines = ["# Structured output: JSON schema vs free decoding, SmolLM2-135M (eager, greedy)", "",
             f"Machine: {machine}; {limits}.", "",
             "| run | streams | tokens | seconds | tokens/s | median decode step (ms) | step vs free | ended by grammar |",
             "|---|---|---|---|---|---|---|---|"]
    free = {r.streams: r for r in runs if r.label == "free"}
    for r in runs:
        ratio = r.step_ms / free[r.streams].step_ms
        lines.append(f"| {r.label} | {r.streams} | {r.tokens} | {r.seconds:.1f} | {r.tok_s:.1f} | {r.step_ms:.1f} | "
                     f"{ratio:.2f}x | {r.finished_by_grammar if r.label != 'free' else '-'} |")
    ours = next((r for r in runs if r.streams == 32 and r.label != "free"), None)
    for peer in peers:
        label = "vLLM CPU " + ("JSON schema" if peer["constrained"] else "free")
        lines.append(f"| {label} | {peer['max_num_seqs']} | {peer['tokens']} | {peer['seconds']:.1f} | "
                     f"{peer['tok_s']:.1f} | - | - | - |")
    vllm_constrained = next((p for p in peers if p["constrained"]), None)
    if ours is not None and vllm_constrained is not None:
        ratio = ours.tok_s / vllm_constrained["tok_s"]
        lines += ["", f"Constrained throughput at 32 streams: {ours.tok_s:.1f} vs vLLM CPU's "
                  f"{vllm_constrained['tok_s']:.1f} tok/s = {ratio:.2f}x (target 1.3x)."]
    text = "\n".join(lines) + "\n"
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "structured.md").write_text(text)
    streams = sorted(free, reverse=True)
    paired_bars(out / "structured.png", [f"{s} stream{'s' * (s > 1)}" for s in streams],
                [("free", [free[s].step_ms for s in streams], "#999999"),
                 ("JSON schema", [next(r for r in runs if r.streams == s and r.label != "free").step_ms
                                  for s in streams], "#4c72b0")],
                "median decode step, ms (lower is better)", f"Structured output cost: {machine.split(',')[0]}")


if __name__ == "__main__":
    main()
