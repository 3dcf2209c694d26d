"""Context parallelism on this host: time to first token of long prompts, CP=1 against CP=2, side by side in one run.

SmolLM2-135M (bundled GGUF, fp32; ``max_model_len`` raised past its 8k training length: RoPE computes any position,
and both sides run the same positions) and optionally tiny DeepSeek-V3 (MLA). Prompts of 1k / 4k / 16k tokens
(natural text: docs/ARCHITECTURE.md's tokens, repeated), prefilled in 2,048-token chunks; CP=1 is one process on
one core with one thread, CP=2 two ranks, each pinned to its own core with one thread. Also: the decode step at the
longest context (one request), whether the first tokens are identical, and the KV capacity per rank (CP=2 holds
half of every request's blocks per rank, so the same per-rank pool serves twice the context).
Writes benchmarks/results/context_parallel.md and .png.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.machine import describe  # noqa: E402
from benchmarks.plots import paired_bars  # noqa: E402
from backend_lib.core.sampling_params import SamplingParams  # noqa: E402
from backend_lib.engine.offline import LLM  # noqa: E402
from backend_lib.engine.tokenizer import Tokenizer  # noqa: E402
from backend_lib.core.model_path import resolve_model_path  # noqa: E402

BLOCK = 16
CHUNK = 2048


@dataclass
class Run:
    model: str
    tokens: int
    cp: int
    ttft_s: float
    decode_ms: float
    first_ids: list[int]
    gather_s: float = 0.0  # CP=2: the driver's time in all-gathers during the prefill (a profiled repeat)


def prompt_ids(model: str, length: int) -> list[int]:
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    ids = Tokenizer.load(resolve_model_path(model)).encode(text, add_special_tokens=False)
    return (ids * (length // len(ids) + 1))[:length]


def timed_request(llm: LLM, ids: list[int], decode_steps: int) -> tuple[float, float, list[int]]:
    """(time to first token s, ms per decode step after it, the first tokens) of one request alone."""
    engine = llm.engine
    engine.add_request("timed", ids, SamplingParams(max_tokens=decode_steps + 1, temperature=0.0, ignore_eos=True))
    tokens: list[int] = []
    start = time.perf_counter()
    while not tokens:
        tokens += [t for out in engine.step() for t in out.new_token_ids]
    first = time.perf_counter()
    while engine.has_unfinished_requests():
        tokens += [t for out in engine.step() for t in out.new_token_ids]
    decode_ms = (time.perf_counter() - first) / decode_steps * 1e3 if decode_steps else 0.0
    return first - start, decode_ms, tokens[:4]


def gather_seconds(llm: LLM, ids: list[int]) -> float:
    """The driver's seconds inside all-gathers (q/k/v rows, partial outputs; waits for the other rank included)
    over one more prefill of ``ids``, profiled."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        timed_request(llm, ids, 0)
    return sum(e.self_cpu_time_total for e in prof.key_averages() if "allgather" in e.key) / 1e6


def measure(model: str, cp: int, lengths: list[int], decode_steps: int) -> list[Run]:
    """TTFT per length (one request alone, prefix caching off), then decode steps at the longest context."""
    longest = max(lengths)
    blocks = -(-(longest + decode_steps + 64) // BLOCK) + 8
    settings = {"max_model_len": longest + decode_steps + 64, "max_num_batched_tokens": CHUNK, "max_num_seqs": 4,
                "num_blocks": -(-blocks // cp), "enable_prefix_caching": False, "num_threads": 1}
    if cp > 1:
        settings |= {"context_parallel_size": cp}
    cores = os.sched_getaffinity(0)
    if cp == 1:
        os.sched_setaffinity(0, {min(cores)})  # one core, one thread: each CP=2 rank has the same
    try:
        with LLM(model, **settings) as llm:
            llm.generate([prompt_ids(model, 64)], SamplingParams(max_tokens=2, temperature=0.0))  # warm-up
            runs = []
            for length in lengths:
                steps = decode_steps if length == longest else 0
                ttft, decode_ms, ids = timed_request(llm, prompt_ids(model, length), steps)
                gather = gather_seconds(llm, prompt_ids(model, length)) if cp > 1 and length == min(lengths) else 0.0
                runs.append(Run(Path(model).name, length, cp, ttft, decode_ms, ids, gather))
                print(f"  {Path(model).name} {length} tokens CP={cp}: TTFT {ttft:.2f} s"
                      + (f", decode {decode_ms:.1f} ms/step" if decode_ms else ""), flush=True)
            return runs
    finally:
        os.sched_setaffinity(0, cores)


def write_report(runs: list[Run], out: Path, machine: str) -> None:
    lines = ["# Context parallelism: time to first token of long prompts", "",
             f"Machine: {machine}. CP=1: one process, one core, one thread; CP=2: two ranks, one core and one thread "
             f"each (gloo on localhost). Prefill in {CHUNK}-token chunks (CP=2 splits each chunk's rows and all-gathers "
             "q/k/v, every rank attends the blocks it holds, partials merged by log-sum-exp); prefix caching off; "
             "decode: one request at the longest context, ms per step (its prefill subtracted).", "",
             "| model | prompt tokens | TTFT CP=1 s | TTFT CP=2 s | CP=2 / CP=1 | decode CP=1 ms | decode CP=2 ms | "
             "first tokens equal | CP=2 all-gathers s |", "|---|---|---|---|---|---|---|---|---|"]
    pairs = [(a, b) for a in runs for b in runs if a.model == b.model and a.tokens == b.tokens and a.cp == 1
             and b.cp == 2]
    for a, b in pairs:
        decode = f"{a.decode_ms:.1f} | {b.decode_ms:.1f}" if a.decode_ms else "- | -"
        lines.append(f"| {a.model} | {a.tokens} | {a.ttft_s:.2f} | {b.ttft_s:.2f} | {b.ttft_s / a.ttft_s:.2f}x | "
                     f"{decode} | {'yes' if a.first_ids == b.first_ids else 'NO'} | "
                     f"{f'{b.gather_s:.2f} (profiled repeat)' if b.gather_s else '-'} |")
    longest = max(r.tokens for r in runs)
    lines += ["", f"KV capacity: a rank's pool of N blocks holds N x {BLOCK} tokens of one request at CP=1 and "
              f"2 x N x {BLOCK} at CP=2 (each rank holds every other block); e.g. the {longest}-token context above "
              f"took {-(-longest // BLOCK)} blocks on the CP=1 rank and about half that on each CP=2 rank."]
    text = "\n".join(lines) + "\n"
    print(text)
    out.mkdir(parents=True, exist_ok=True)
    (out / "context_parallel.md").write_text(text)
    labels = [f"{a.model} {a.tokens}" for a, _ in pairs]
    paired_bars(out / "context_parallel.png", labels,
                [("CP=1", [a.ttft_s for a, _ in pairs], "tab:gray"), ("CP=2", [b.ttft_s for _, b in pairs],
                                                                         "tab:blue")],
                "time to first token (s)", "Context parallelism, one core per rank")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", action="append", help="model paths (default: the bundled SmolLM2)")
    parser.add_argument("--lengths", default="1024,4096,16384")
    parser.add_argument("--decode-steps", type=int, default=16)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = parser.parse_args()
    machine = describe().line()
    print(f"machine: {machine}", flush=True)
    lengths = [int(n) for n in args.lengths.split(",")]
    runs = []
    for model in args.model or [resolve_model_path("")]:
        for cp in (1, 2):
            runs += measure(model, cp, lengths, args.decode_steps)
    write_report(runs, Path(args.out), machine)


if __name__ == "__main__":
    main()
