"""Tensor parallelism on this host: one rank against N ranks with the same total threads, side by side in one run.

The shared workload (benchmarks/workload.py: 32 chat prompts x 128 new tokens, greedy, EOS ignored, fp32,
bundled SmolLM2) at 32 streams and at one stream, for ``tensor_parallel_size`` 1 and N (each of the N ranks pinned
to its share of the cores with as many torch threads). For the N-rank engine the driver is profiled over a few
decode steps at 32 streams: how many collectives a step makes, how many bytes they move, and how long the driver
spends in them (waits for the slower rank included). Writes benchmarks/results/tensor_parallel.md and .png.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.machine import describe  # noqa: E402
from benchmarks.offline_throughput import load_workload  # noqa: E402
from backend_lib.core.sampling_params import SamplingParams  # noqa: E402
from backend_lib.engine.offline import LLM  # noqa: E402
from benchmarks.workload import FLOAT_WEIGHTS, WORKLOAD_FILE  # noqa: E402

COLLECTIVES = ("all_reduce", "allgather", "all_gather", "broadcast")  # gloo's, and the shared-memory all-reduce


@dataclass
class Result:
    tp: int
    streams32: float  # tokens/s
    stream1: float
    step_ms: float = 0.0  # driver decode step at 32 streams (profiled)
    collective_ms: float = 0.0  # of which in collectives
    collectives_per_step: float = 0.0
    collective_bytes_per_step: float = 0.0


def tokens_per_s(llm: LLM, prompts, new_tokens: int) -> float:
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    results = llm.generate(prompts, params)
    return sum(len(r.token_ids) for r in results) / (time.perf_counter() - start)


def profile_decode(llm: LLM, prompts, steps: int) -> tuple[float, float, float, float]:
    """(step ms, collective ms, collectives per step, bytes per step) over ``steps`` decode steps at full batch."""
    engine = llm.engine
    params = SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"profile-{i}", prompt, params)
    while any(r.num_output_tokens < 2 for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()  # past every prefill: the profiled steps are decodes only
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        seconds = time.perf_counter() - start
    while engine.has_unfinished_requests():
        engine.step()
    count, busy_us, nbytes = 0, 0.0, 0
    for event in prof.events():
        name = event.name.lower()
        if event.device_type.name == "CPU" and name.startswith(("gloo:", "c10d::", "deepinfer::shm")) and any(
                c in name for c in COLLECTIVES):
            count += 1
            busy_us += event.cpu_time_total
            for shape in event.input_shapes or []:
                if shape:
                    nbytes += 4 * int(torch.Size(shape).numel())
    return 1000 * seconds / steps, busy_us / 1000 / steps, count / steps, nbytes / steps


def run(tp: int, prompts, new_tokens: int, single: int, profile_steps: int) -> Result:
    llm = LLM("", **FLOAT_WEIGHTS, tensor_parallel_size=tp, max_num_seqs=32, max_num_batched_tokens=512, enable_prefix_caching=False)
    try:
        llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0.0))  # warm-up
        streams32 = tokens_per_s(llm, prompts, new_tokens)
        stream1 = sum(tokens_per_s(llm, [p], new_tokens) for p in prompts[:single]) / single
        result = Result(tp, streams32, stream1)
        if tp > 1:
            (result.step_ms, result.collective_ms, result.collectives_per_step,
             result.collective_bytes_per_step) = profile_decode(llm, prompts, profile_steps)
        return result
    finally:
        llm.close()


def write_report(results: list[Result], out: Path) -> None:
    base = results[0]
    lines = ["# Tensor parallelism on the host: shared workload", "",
             f"Machine: {describe().line()}. SmolLM2-135M fp32 "
             "(3 KV heads: two ranks hold 2 + 1 KV-head groups); all-reduces through shared memory, step inputs "
             "(broadcast) and logits (all-gather) over gloo; each rank pinned to its share of the cores with as "
             "many threads; one rank uses every core. Collective time is the driver's, waits for the slower rank "
             "included; bytes are the collectives' inputs on the driver.", "",
             "| ranks | 32 streams tok/s | vs 1 rank | 1 stream tok/s | vs 1 rank | decode step (32) ms | "
             "in collectives ms | collectives / step | KB moved / step |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        prof = (f"{r.step_ms:.1f} | {r.collective_ms:.1f} | {r.collectives_per_step:.0f} | "
                f"{r.collective_bytes_per_step / 1024:.0f}") if r.tp > 1 else "- | - | - | -"
        lines.append(f"| {r.tp} | {r.streams32:.1f} | {r.streams32 / base.streams32:.2f}x | {r.stream1:.1f} | "
                     f"{r.stream1 / base.stream1:.2f}x | {prof} |")
    text = "\n".join(lines) + "\n"
    print(text)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tensor_parallel.md").write_text(text)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 3.2))
    labels = [f"TP={r.tp}" for r in results]
    x = range(len(results))
    ax.bar([i - 0.2 for i in x], [r.streams32 for r in results], width=0.4, label="32 streams")
    ax.bar([i + 0.2 for i in x], [r.stream1 for r in results], width=0.4, label="1 stream")
    ax.set_xticks(list(x), labels)
    ax.set_ylabel("output tokens / s")
    ax.set_title(f"Shared workload, SmolLM2 fp32, {os.cpu_count()} cores")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "tensor_parallel.png", dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", default=str(WORKLOAD_FILE))
    parser.add_argument("--tp", type=int, default=2, help="ranks of the parallel engine")
    parser.add_argument("--single", type=int, default=2, help="prompts for the one-stream runs")
    parser.add_argument("--profile-steps", type=int, default=10)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = parser.parse_args()
    prompts, new_tokens = load_workload(Path(args.workload))
    print(f"machine: {describe().line()}", flush=True)
    results = [run(tp, prompts, new_tokens, args.single, args.profile_steps) for tp in (1, args.tp)]
    write_report(results, Path(args.out))


if __name__ == "__main__":
    main()
