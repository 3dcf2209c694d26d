"""Speculative decoding benchmark: n-gram drafts on a copy-heavy workload, and MTP acceptance on a tiny DeepSeek-V3.

n-gram (SmolLM2-135M-Instruct GGUF, fp32, greedy): prompts that ask to repeat or lightly edit a given text. Two
workloads: "copy" (the request ends at the model's end-of-turn: the output is the copy, 33-37 tokens) and "copy +
tail" (EOS ignored, a fixed number of tokens: after the copy the model free-runs a new chat turn that no n-gram
predicts, so speculation can only speed up the copied part). For batch 1 (prompts one at a time) and batch 8 (eight
prompts as one continuous batch) one engine runs each group without speculation (the requests opt out) and then
with it, group after group, so that a shared machine's load drift hits both alike; each run's time is the sum of
its own steps (prefill included; prefix caching off, so the second run of a group prefills too). The script
checks the tokens are identical and reports tokens/s, engine steps, emitted tokens per step, accepted tokens per
verification, the per-position acceptance rate, and what a verification step costs against a plain step.
MTP: a tiny random DeepSeek-V3 (make-tiny, one MTP layer) with 1 and 3 drafts; random weights, so the measured
acceptance rate is whatever it is (reported, not tuned).
Writes benchmarks/results/spec_decode.md and .png (--out: another stem, e.g. one per machine class).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from backend_lib.core.config import EngineConfig  # noqa: E402
from backend_lib.core.sampling_params import SamplingParams  # noqa: E402
from backend_lib.engine.llm_engine import LLMEngine  # noqa: E402
from backend_lib.core.model_path import default_model_path  # noqa: E402
from backend_lib.tools.tiny import make_tiny  # noqa: E402
from benchmarks.machine import describe  # noqa: E402
from benchmarks.workload import FLOAT_WEIGHTS  # noqa: E402

TEXTS = [
    "The lighthouse keeper climbed the spiral stairs every evening at dusk, lit the great lamp, and wrote the names "
    "of passing ships in a worn leather book that had belonged to his grandfather.",
    "To install the package, create a virtual environment, activate it, and run pip install with the pinned "
    "requirements file; then start the server with the default configuration and open the dashboard.",
    "Photosynthesis converts light energy into chemical energy: chlorophyll absorbs light, water is split, oxygen "
    "is released, and carbon dioxide is fixed into sugars through the Calvin cycle.",
    "The committee met on Tuesday to review the budget, approved the new library hours, postponed the vote on the "
    "parking plan, and thanked the volunteers who organised the spring festival.",
]
INSTRUCTIONS = ["Repeat the following text exactly, word for word.",
                "Copy this text, but replace every comma with a semicolon."]


def copy_prompts(n: int) -> list[list[dict]]:
    return [[{"role": "user", "content": f"{INSTRUCTIONS[i % 2]}\n\n{TEXTS[i % len(TEXTS)]}"}] for i in range(n)]


@dataclass
class Result:
    name: str
    batch: int
    tokens: int = 0
    seconds: float = 0.0  # the sum of this engine's own steps
    steps: int = 0
    token_ids: list[list[int]] = field(default_factory=list)
    plain_step_s: list[float] = field(default_factory=list)  # decode steps without drafts
    verify_step_s: list[float] = field(default_factory=list)  # decode steps that verified drafts
    accepted_per_step: float = 0.0  # mean emitted tokens per verification (1 + accepted / verifications)
    acceptance_per_position: list[float] | None = None
    acceptance_rate: float = 0.0
    chosen_lengths: list[int] | None = None  # request-steps whose proposer chose L drafts (index L)

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds

    @property
    def tokens_per_step(self) -> float:
        return self.tokens / self.steps


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2] if ordered else float("nan")


class _Run:
    """One run (with or without speculation) on the shared engine: its requests, step times and spec counters."""

    def __init__(self, engine: LLMEngine, name: str, batch: int) -> None:
        self.engine, self.result = engine, Result(name, batch)
        self.stats = _SpecCounts()
        self.ids: dict[str, list[int]] = {}

    def add(self, group: list, params: SamplingParams, first: int) -> None:
        for i, prompt in enumerate(group):
            rid = f"{self.result.name}-{first + i}"
            self.ids[rid] = []
            self.engine.add_request(rid, prompt, params)

    def step(self) -> None:
        before = self.engine.stats()
        drafts0 = before.spec_num_drafts
        scheduler = self.engine.scheduler  # a decode-only step: nothing waits, every prompt is computed
        decoding = not scheduler.waiting and all(r.num_computed_tokens >= r.num_prompt_tokens
                                                 for r in scheduler.running)
        start = time.perf_counter()
        outputs = self.engine.step()
        elapsed = time.perf_counter() - start
        self.result.seconds += elapsed
        for out in outputs:
            self.ids[out.request_id] += out.new_token_ids
        after = self.engine.stats()
        self.result.steps += 1
        self.stats.add(before, after)
        if decoding:
            verified = after.spec_num_drafts > drafts0
            (self.result.verify_step_s if verified else self.result.plain_step_s).append(elapsed)

    def finish(self) -> Result:
        res, c = self.result, self.stats
        res.token_ids = list(self.ids.values())
        res.tokens = sum(map(len, res.token_ids))
        res.acceptance_per_position = [a / d if d else 0.0 for a, d in zip(c.accepted_per_position,
                                                                            c.drafts_per_position)] or None
        res.accepted_per_step = 1 + c.accepted / c.verifications if c.verifications else 1.0
        res.acceptance_rate = c.accepted / c.drafted if c.drafted else 0.0
        res.chosen_lengths = c.chosen_lengths or None
        return res


@dataclass
class _SpecCounts:
    """One run's share of the engine's cumulative spec counters (summed step by step: the engine is shared)."""
    verifications: int = 0
    accepted: int = 0
    drafted: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    drafts_per_position: list[int] = field(default_factory=list)
    chosen_lengths: list[int] = field(default_factory=list)

    def add(self, before, after) -> None:
        self.verifications += after.spec_num_drafts - before.spec_num_drafts
        self.accepted += after.spec_accepted_tokens - before.spec_accepted_tokens
        self.drafted += after.spec_draft_tokens - before.spec_draft_tokens
        for mine, b, a in ((self.accepted_per_position, before.spec_accepted_per_position,
                            after.spec_accepted_per_position),
                           (self.drafts_per_position, before.spec_drafts_per_position, after.spec_drafts_per_position)):
            mine += [0] * (len(a) - len(mine))
            for j, value in enumerate(a):
                mine[j] += value - (b[j] if j < len(b) else 0)
        a, b = after.spec_chosen_lengths, before.spec_chosen_lengths
        self.chosen_lengths += [0] * (len(a) - len(self.chosen_lengths))
        for n, value in enumerate(a):
            self.chosen_lengths[n] += value - (b[n] if n < len(b) else 0)


def run(engine: LLMEngine, name: str, prompts: list, params: SamplingParams, batch: int) -> Result:
    """The prompts on one engine, ``batch`` at a time."""
    return run_interleaved(engine, [(name, params)], prompts, batch)[0]


def run_interleaved(engine: LLMEngine, runs: list[tuple[str, SamplingParams]], prompts: list,
                    batch: int, prepare: Callable[[int], None] | None = None) -> list[Result]:
    """Each group of ``batch`` prompts under every run's parameters in turn, on one engine.

    One engine for the runs with and without speculation (``SamplingParams.speculative=False`` opts out), not two:
    on the shared host two engines built in one process streamed their weights at different speeds (the first
    engine's blocked GEMM ran 1.7-2.8x slower than the second's on identical weights, and than a clone of its own
    weights), which a two-engine ratio would have credited to speculation. Interleaving by group spreads load drift
    over both runs. ``prepare(i)`` runs before run ``i`` takes its turn (to switch an engine-wide setting)."""
    states = [_Run(engine, name, batch) for name, _ in runs]
    for first in range(0, len(prompts), batch):
        for i, (state, (_, params)) in enumerate(zip(states, runs)):
            if prepare is not None:
                prepare(i)
            state.add(prompts[first:first + batch], params, first)
            while engine.has_unfinished_requests():
                state.step()
    return [state.finish() for state in states]


WORKLOADS = ("copy", "copy+tail")


def workload_params(workload: str, new_tokens: int) -> SamplingParams:
    if workload == "copy":  # ends at the model's end-of-turn; the cap is never reached by these prompts
        return SamplingParams(max_tokens=4 * new_tokens, temperature=0.0)
    return SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens per request of copy+tail")
    parser.add_argument("--k", type=int, default=7, help="n-gram drafts per step at most (one request: 1 + k rows "
                        "stay within the 8 rows the few-row GEMM reads the weights once for)")
    parser.add_argument("--batch1-prompts", type=int, default=4)
    parser.add_argument("--batches", default="1,8", help="comma-separated batch sizes")
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--no-mtp", action="store_true", help="skip the MTP acceptance section")
    # All cores by default, as the engine runs: a verification's 8 rows cost a core twice the FMAs of 4, so one
    # thread turns them compute-bound (Zen 4: a verification 1.47x a plain step on one thread, 1.10x on two).
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default, all cores)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "spec_decode"),
                        help="report path without suffix (.md and .png are written)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    # Prefix caching off: both runs of a group prefill the same prompts, neither reuses the other's KV.
    flat = {"model": default_model_path(), **FLOAT_WEIGHTS, "num_blocks": 512, "max_num_seqs": 16, "enable_prefix_caching": False}
    engine = LLMEngine(EngineConfig.from_flat({**flat, "method": "ngram", "num_speculative_tokens": args.k}))
    run(engine, "warm", copy_prompts(1), SamplingParams(max_tokens=4, temperature=0.0), 1)
    rows: list[tuple[str, Result, Result]] = []
    for workload in args.workloads.split(","):
        params = workload_params(workload, args.new_tokens)
        for batch in (int(b) for b in args.batches.split(",")):
            prompts = copy_prompts(args.batch1_prompts if batch == 1 else batch)
            plain_params = dataclasses.replace(params, speculative=False)
            base, spec = run_interleaved(engine, [(f"plain-{workload}-b{batch}", plain_params),
                                                  (f"ngram-{workload}-b{batch}", params)], prompts, batch)
            if spec.token_ids != base.token_ids:
                raise SystemExit(f"{workload}, batch {batch}: n-gram output differs from plain output")
            rows.append((workload, base, spec))
            print(f"{workload}, batch {batch}: plain {base.tok_s:.1f} tok/s ({base.steps} steps), n-gram "
                  f"{spec.tok_s:.1f} tok/s ({spec.steps} steps, {spec.tokens_per_step:.2f} tokens/step, "
                  f"{spec.accepted_per_step:.2f} tokens/verification), verify step {_step_ratio(base, spec):.2f}x a "
                  f"plain step, speedup {spec.tok_s / base.tok_s:.2f}x", flush=True)

    mtp_rows = []
    if not args.no_mtp:
        with tempfile.TemporaryDirectory() as tmp:
            path = make_tiny("deepseek_v3", tmp, seed=7, mtp_layers=1)
            prompts = [torch.randint(3, 300, (16,), generator=torch.Generator().manual_seed(i)).tolist()
                       for i in range(4)]
            tiny_params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
            for k in (1, 3):
                mtp = LLMEngine(EngineConfig.from_flat({"model": str(path), "max_model_len": 256, "method": "mtp",
                                                        "num_speculative_tokens": k}))
                mtp_rows.append((k, run(mtp, f"mtp{k}", prompts, tiny_params, 4)))
                print(f"MTP k={k}: acceptance {mtp_rows[-1][1].acceptance_rate:.3f}")
    write_results(rows, mtp_rows, args)
    return 0


def _step_ratio(base: Result, spec: Result) -> float:
    """Median verification step over the plain engine's median decode step (same run, same load)."""
    return _median(spec.verify_step_s) / _median(base.plain_step_s)


def _load() -> str:
    try:
        return ", ".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:
        return "unknown"


def write_results(rows: list[tuple[str, Result, Result]], mtp_rows: list[tuple[int, Result]], args) -> None:
    stem = Path(args.out)
    stem.parent.mkdir(parents=True, exist_ok=True)
    machine = describe()
    lines = [
        "# Speculative decoding",
        "",
        f"Machine: {machine.cpu} (cpu family {machine.family}, model {machine.model}), {machine.cores} cores, "
        f"{machine.threads} torch threads, load average at the end {_load()}. SmolLM2-135M-Instruct Q4_1 "
        f"GGUF in fp32, greedy, n-gram k={args.k} (n in [1, 4]; a one-token match drafts one token; at most 8 "
        "verification rows a step). Copy-heavy prompts: repeat a paragraph, or copy it with a light edit. "
        "**copy**: each request ends at the model's end-of-turn (the output is the copy). **copy+tail**: EOS "
        f"ignored, {args.new_tokens} tokens a request: after the copy (~35 tokens) the model free-runs a new chat "
        "turn that no n-gram predicts. One engine runs both: without speculation "
        "(requests opt out, speculative=False) and with it, group by group in turn; seconds are the sum of the run's "
        "own steps, prefill included. Same-run ratios. Outputs with "
        "and without speculation are identical (checked by the script). Step ms: median decode step without "
        "drafts (plain run) and with drafts (n-gram run).",
        "",
        "| workload | batch | run | tokens | seconds | tok/s | engine steps | tokens / step | tokens / verification "
        "| acceptance by position | step ms | speedup |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for workload, base, spec in rows:
        per_pos = ", ".join(f"{r:.2f}" for r in spec.acceptance_per_position or [])
        lines.append(f"| {workload} | {base.batch} | plain | {base.tokens} | {base.seconds:.1f} | {base.tok_s:.1f} "
                     f"| {base.steps} | {base.tokens_per_step:.2f} | - | - | {1000 * _median(base.plain_step_s):.1f} "
                     "| 1.00x |")
        lines.append(f"| {workload} | {spec.batch} | n-gram | {spec.tokens} | {spec.seconds:.1f} | {spec.tok_s:.1f} "
                     f"| {spec.steps} | {spec.tokens_per_step:.2f} | {spec.accepted_per_step:.2f} | {per_pos} "
                     f"| {1000 * _median(spec.verify_step_s):.1f} ({_step_ratio(base, spec):.2f}x) "
                     f"| {spec.tok_s / base.tok_s:.2f}x |")
    if mtp_rows:
        lines += ["", "## MTP on a tiny random DeepSeek-V3 (make-tiny, seed 7, one MTP layer)", "",
                  "Random weights: the MTP module has not learned to predict the main model, so acceptance is "
                  "expected to be near zero; reported as measured (4 prompts of 16 random tokens, 48 new tokens).",
                  "", "| drafts | draft tokens accepted | acceptance by position | tokens / verification |",
                  "|---|---|---|---|"]
    for k, res in mtp_rows:
        per_pos = ", ".join(f"{r:.3f}" for r in res.acceptance_per_position or [])
        lines.append(f"| {k} | {res.acceptance_rate:.3f} | {per_pos} | {res.accepted_per_step:.2f} |")
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 3.5))
    labels = [f"{workload}\nbatch {base.batch}" for workload, base, _ in rows]
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], [b.tok_s for _, b, _ in rows], width=0.4, label="no speculation")
    ax.bar([i + 0.2 for i in x], [s.tok_s for _, _, s in rows], width=0.4, label=f"n-gram, k={args.k}")
    for i, (_, b, s) in enumerate(rows):
        ax.text(i + 0.2, s.tok_s, f"{s.tok_s / b.tok_s:.2f}x\n{s.tokens_per_step:.2f} tok/step", ha="center",
                va="bottom", fontsize=8)
    ax.set_xticks(list(x), labels)
    ax.set_ylabel("output tokens / s")
    ax.set_title("SmolLM2-135M, copy-heavy prompts (one engine, same run)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(stem.with_suffix(".png"), dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())
