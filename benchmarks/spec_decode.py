"""Speculative decoding benchmark: n-gram drafts on a copy-heavy workload, and MTP acceptance on a tiny DeepSeek-V3.

n-gram (SmolLM2-135M-Instruct GGUF, fp32, greedy, EOS ignored): prompts that ask to repeat or lightly edit a given
text. For batch 1 (the first prompts one at a time) and batch 8 (eight prompts as one continuous batch) it runs the
engine without speculation and with n-gram drafts, checks that the tokens are identical, and reports tokens/s,
engine steps, accepted tokens per verification step and the per-position acceptance rate.
MTP: a tiny random DeepSeek-V3 (make-tiny, one MTP layer) with 1 and 3 drafts; random weights, so the measured
acceptance rate is whatever it is (reported, not tuned).
Writes benchmarks/results/spec_decode.md and spec_decode.png.
"""
from __future__ import annotations

import argparse
import platform
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from backend_lib.config import EngineConfig  # noqa: E402
from backend_lib.engine import LLMEngine  # noqa: E402
from backend_lib.models.loader import default_model_path  # noqa: E402
from backend_lib.sampling_params import SamplingParams  # noqa: E402
from backend_lib.tiny import make_tiny  # noqa: E402

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
    tokens: int
    seconds: float
    steps: int
    token_ids: list[list[int]]
    accepted_per_step: float = 0.0  # mean emitted tokens per verification step (1 + accepted / drafts-steps)
    acceptance_per_position: list[float] | None = None
    acceptance_rate: float = 0.0

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds


def run(engine: LLMEngine, name: str, prompts: list, params: SamplingParams, batch: int) -> Result:
    before, steps0 = engine.stats(), engine.num_steps
    token_ids: list[list[int]] = []
    start = time.perf_counter()
    for first in range(0, len(prompts), batch):
        group = prompts[first:first + batch]
        ids = {f"{name}-{first + i}": [] for i in range(len(group))}
        for rid, prompt in zip(ids, group):
            engine.add_request(rid, prompt, params)
        while engine.has_unfinished_requests():
            for out in engine.step():
                ids[out.request_id] += out.new_token_ids
        token_ids += list(ids.values())
    seconds = time.perf_counter() - start
    after = engine.stats()
    steps = after.spec_num_drafts - before.spec_num_drafts
    accepted = after.spec_accepted_tokens - before.spec_accepted_tokens
    drafted = after.spec_draft_tokens - before.spec_draft_tokens
    per_pos = [(a1 - a0) / (d1 - d0) if d1 > d0 else 0.0 for a0, a1, d0, d1 in zip(
        before.spec_accepted_per_position + [0] * 16, after.spec_accepted_per_position,
        before.spec_drafts_per_position + [0] * 16, after.spec_drafts_per_position)]
    return Result(name, batch, sum(map(len, token_ids)), seconds, engine.num_steps - steps0, token_ids,
                  1 + accepted / steps if steps else 1.0, per_pos or None, accepted / drafted if drafted else 0.0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--k", type=int, default=4, help="n-gram drafts per step")
    parser.add_argument("--batch1-prompts", type=int, default=2)
    # 1 by default: on this shared 2-core host, 2 OpenMP threads make every multi-row GEMM ~100x slower (spin
    # contention), which would measure the host, not speculation.
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    flat = {"model": default_model_path(), "num_blocks": 512, "max_num_seqs": 16}
    plain = LLMEngine(EngineConfig.from_flat(flat))
    ngram = LLMEngine(EngineConfig.from_flat({**flat, "method": "ngram", "num_speculative_tokens": args.k}))
    warm = SamplingParams(max_tokens=4, temperature=0.0)
    for engine in (plain, ngram):
        run(engine, "warm", copy_prompts(1), warm, 1)
    rows: list[tuple[Result, Result]] = []
    for batch, n in ((1, args.batch1_prompts), (8, 8)):
        prompts = copy_prompts(n)
        base = run(plain, f"plain-b{batch}", prompts, params, batch)
        spec = run(ngram, f"ngram-b{batch}", prompts, params, batch)
        if spec.token_ids != base.token_ids:
            raise SystemExit(f"batch {batch}: n-gram output differs from plain output")
        rows.append((base, spec))
        print(f"batch {batch}: plain {base.tok_s:.1f} tok/s ({base.steps} steps), n-gram {spec.tok_s:.1f} tok/s "
              f"({spec.steps} steps), {spec.accepted_per_step:.2f} tokens/verification, "
              f"speedup {spec.tok_s / base.tok_s:.2f}x")

    mtp_rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = make_tiny("deepseek_v3", tmp, seed=7, mtp_layers=1)
        prompts = [torch.randint(3, 300, (16,), generator=torch.Generator().manual_seed(i)).tolist() for i in range(4)]
        tiny_params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
        for k in (1, 3):
            engine = LLMEngine(EngineConfig.from_flat({"model": str(path), "max_model_len": 256, "method": "mtp",
                                                       "num_speculative_tokens": k}))
            mtp_rows.append((k, run(engine, f"mtp{k}", prompts, tiny_params, 4)))
            print(f"MTP k={k}: acceptance {mtp_rows[-1][1].acceptance_rate:.3f}")
    write_results(rows, mtp_rows, args)
    return 0


def write_results(rows: list[tuple[Result, Result]], mtp_rows: list[tuple[int, Result]], args) -> None:
    out = ROOT / "benchmarks" / "results"
    out.mkdir(parents=True, exist_ok=True)
    lines = [
        "# Speculative decoding",
        "",
        f"Machine: {platform.machine()}, {torch.get_num_threads()} torch threads, shared with other jobs "
        "(wall-clock numbers are noisy). SmolLM2-135M-Instruct Q4_1 GGUF in fp32, greedy, EOS ignored, "
        f"{args.new_tokens} new tokens per request, n-gram k={args.k} (n in [1, 4]). Copy-heavy prompts: "
        "repeat a paragraph, or copy it with a light edit. Outputs with and without speculation are identical "
        "(checked by the script).",
        "",
        "| batch | run | tokens | seconds | tok/s | engine steps | tokens / verification | acceptance by position | speedup |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for base, spec in rows:
        per_pos = ", ".join(f"{r:.2f}" for r in spec.acceptance_per_position or [])
        lines.append(f"| {base.batch} | plain | {base.tokens} | {base.seconds:.1f} | {base.tok_s:.1f} | {base.steps} "
                     f"| 1.00 | - | 1.00x |")
        lines.append(f"| {spec.batch} | n-gram | {spec.tokens} | {spec.seconds:.1f} | {spec.tok_s:.1f} | {spec.steps} "
                     f"| {spec.accepted_per_step:.2f} | {per_pos} | {spec.tok_s / base.tok_s:.2f}x |")
    lines += ["", "## MTP on a tiny random DeepSeek-V3 (make-tiny, seed 7, one MTP layer)", "",
              "Random weights: the MTP module has not learned to predict the main model, so acceptance is "
              "expected to be near zero; reported as measured (4 prompts of 16 random tokens, 48 new tokens).", "",
              "| drafts | draft tokens accepted | acceptance by position | tokens / verification |", "|---|---|---|---|"]
    for k, res in mtp_rows:
        per_pos = ", ".join(f"{r:.3f}" for r in res.acceptance_per_position or [])
        lines.append(f"| {k} | {res.acceptance_rate:.3f} | {per_pos} | {res.accepted_per_step:.2f} |")
    (out / "spec_decode.md").write_text("\n".join(lines) + "\n")

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 3.5))
    labels = [f"batch {base.batch}" for base, _ in rows]
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], [b.tok_s for b, _ in rows], width=0.4, label="no speculation")
    ax.bar([i + 0.2 for i in x], [s.tok_s for _, s in rows], width=0.4, label=f"n-gram, k={args.k}")
    for i, (b, s) in enumerate(rows):
        ax.text(i + 0.2, s.tok_s, f"{s.tok_s / b.tok_s:.2f}x\n{s.accepted_per_step:.2f} tok/step", ha="center",
                va="bottom", fontsize=8)
    ax.set_xticks(list(x), labels)
    ax.set_ylabel("output tokens / s")
    ax.set_title("SmolLM2-135M, copy-heavy prompts")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "spec_decode.png", dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())
