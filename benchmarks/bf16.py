"""bf16 against fp32 on the host, side by side in one run, and bf16's greedy agreement with transformers in bf16.

The shared workload (benchmarks/workload.py: 32 chat prompts x 128 new tokens, greedy, EOS ignored, bundled
SmolLM2-135M GGUF) at 32 streams and at one stream, for ``dtype`` float32 and bfloat16 (both with the host kernels:
packed oneDNN GEMMs, the C++ decode attention). Both engines live in one process and take turns, round after
round, in alternating order (fp32 first, then bf16 first): on a shared machine a slow minute then hits both, and
the per-round ratio is what the report leads with.

Near-ties: transformers in bf16 decodes the 32 prompts as one left-padded ``generate`` (as
benchmarks/offline_throughput.py runs it); for every continuation of ours that differs, the first differing step
and transformers' logit gap there between its token and ours (tests/helpers/greedy_agreement.py: a near-tie when within
NEAR_TIE_ULPS bf16 ulps of transformers' top logit). Writes benchmarks/results/bf16.md and .png.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.machine import describe  # noqa: E402
from benchmarks.offline_throughput import load_workload  # noqa: E402
from benchmarks.plots import paired_bars  # noqa: E402
from backend_lib.core.config import EngineConfig  # noqa: E402
from backend_lib.core.sampling_params import SamplingParams  # noqa: E402
from backend_lib.engine.offline import LLM  # noqa: E402
from backend_lib.core.model_path import default_model_path  # noqa: E402
from benchmarks.workload import FLOAT_WEIGHTS, WORKLOAD_FILE  # noqa: E402
from kernels.onednn_gemm import native_bf16_gemm, onednn_gemm_available  # noqa: E402
from tests.helpers.greedy_agreement import NEAR_TIE_ULPS, Divergence, first_divergence  # noqa: E402

DTYPES = ("float32", "bfloat16")


@dataclass
class Timings:
    """tokens/s of each round, per dtype and stream count; decode step ms, steps of the two engines interleaved."""
    streams32: dict[str, list[float]] = field(default_factory=lambda: {d: [] for d in DTYPES})
    stream1: dict[str, list[float]] = field(default_factory=lambda: {d: [] for d in DTYPES})
    step_ms: dict[int, dict[str, list[float]]] = field(default_factory=dict)  # batch -> dtype -> step ms (wall)
    step_cpu_ms: dict[int, dict[str, list[float]]] = field(default_factory=dict)  # the same, process CPU time


def interleaved_decode_steps(engines: dict[str, LLM], prompts,
                             steps: int) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Decode step times (wall, process CPU) of each engine with ``len(prompts)`` running requests, one engine's
    step after the other's: on a shared machine neighbouring steps see the same load, so their ratio holds when
    totals drift. CPU time leaves out the time the process waited for a core (with one thread it is the step's
    own work; with more it also counts OpenMP spin-waits)."""
    params = SamplingParams(max_tokens=steps + 16, temperature=0.0, ignore_eos=True)
    for dtype, llm in engines.items():
        for i, prompt in enumerate(prompts):
            llm.engine.add_request(f"steps-{i}", prompt, params)
        while llm.engine.scheduler.waiting or any(r.num_output_tokens < 2 for r in llm.engine.scheduler.running):
            llm.engine.step()  # past every prefill: only decode steps are timed
    times: dict[str, list[float]] = {dtype: [] for dtype in engines}
    cpu_times: dict[str, list[float]] = {dtype: [] for dtype in engines}
    for step in range(steps):
        for dtype in (DTYPES if step % 2 == 0 else DTYPES[::-1]):
            start, start_cpu = time.perf_counter(), time.process_time()
            engines[dtype].engine.step()
            times[dtype].append((time.perf_counter() - start) * 1e3)
            cpu_times[dtype].append((time.process_time() - start_cpu) * 1e3)
    for llm in engines.values():
        while llm.engine.has_unfinished_requests():
            llm.engine.step()
    return times, cpu_times


def _generate(llm: LLM, prompts, new_tokens: int) -> tuple[float, list[list[int]]]:
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    results = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    return sum(len(r.token_ids) for r in results) / seconds, [r.token_ids for r in results]


def _one_stream(llm: LLM, prompts, new_tokens: int) -> float:
    tokens, seconds = 0, 0.0
    for prompt in prompts:
        rate, ids = _generate(llm, [prompt], new_tokens)
        tokens += len(ids[0])
        seconds += len(ids[0]) / rate
    return tokens / seconds


def machine_line() -> str:
    bf16_gemm = ("native" if native_bf16_gemm() else
                 "emulated" if onednn_gemm_available(torch.device("cpu"), torch.bfloat16) else "F.linear")
    return f"{describe().line()}; bf16 GEMM {bf16_gemm}"


def transformers_divergences(prompts, ours: list[list[int]], new_tokens: int) -> list[tuple[int, Divergence]]:
    """transformers' bf16 greedy continuations (one left-padded ``generate`` of the whole batch, as
    benchmarks/offline_throughput.py runs it, with each step's raw logits) against ours: the divergences."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    directory, name = os.path.split(default_model_path())
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.bfloat16).eval()
    texts = [tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True) for p in prompts]
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.inference_mode():
        out = model.generate(**batch, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id, output_logits=True, return_dict_in_generate=True)
    theirs = out.sequences[:, batch["input_ids"].shape[1]:].tolist()
    found = []
    for i, tokens in enumerate(ours):
        divergence = first_divergence(tokens, theirs[i], [step[i].float() for step in out.logits])
        if divergence is not None:
            found.append((i, divergence))
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", default=str(WORKLOAD_FILE))
    parser.add_argument("--rounds", type=int, default=2, help="rounds of (fp32, bf16) runs, order alternating")
    parser.add_argument("--steps", type=int, default=40, help="interleaved decode steps timed per batch size")
    parser.add_argument("--single", type=int, default=2, help="prompts for the one-stream runs of each round")
    parser.add_argument("--new-tokens", type=int, default=0, help="override the workload's new tokens (0 = keep)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    parser.add_argument("--skip-transformers", action="store_true", help="no near-tie report")
    parser.add_argument("--full-head", action="store_true",
                        help="both dtypes compute every logit (greedy_head_screen off): the same head work")
    parser.add_argument("--stem", default="bf16", help="result file name")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    prompts, new_tokens = load_workload(Path(args.workload))
    new_tokens = args.new_tokens or new_tokens
    machine = machine_line()
    print(machine, flush=True)

    engines = {dtype: LLM(config=EngineConfig.from_flat({
        "model": default_model_path(), **FLOAT_WEIGHTS, "dtype": dtype, "max_num_seqs": 32,
        "max_num_batched_tokens": 512, "enable_prefix_caching": False, "num_blocks": 640, "num_threads": torch.get_num_threads(),
        "greedy_head_screen": not args.full_head}))
        for dtype in DTYPES}
    for llm in engines.values():
        _generate(llm, prompts[:2], 4)  # warm-up
    timings, ids = Timings(), {}
    for batch in (32, 1):
        timings.step_ms[batch], timings.step_cpu_ms[batch] = interleaved_decode_steps(engines, prompts[:batch],
                                                                                     args.steps)
        print(f"decode steps at batch {batch}: " + ", ".join(
            f"{d} {statistics.median(t):.1f} ms (fastest {min(t):.1f}, CPU "
            f"{statistics.median(timings.step_cpu_ms[batch][d]):.1f})" for d, t in timings.step_ms[batch].items()),
            flush=True)
    for round_index in range(args.rounds):
        order = DTYPES if round_index % 2 == 0 else DTYPES[::-1]
        for dtype in order:
            rate, ids[dtype] = _generate(engines[dtype], prompts, new_tokens)
            timings.streams32[dtype].append(rate)
            timings.stream1[dtype].append(_one_stream(engines[dtype], prompts[:args.single], new_tokens))
            print(f"round {round_index} {dtype}: 32 streams {rate:.1f} tok/s, 1 stream "
                  f"{timings.stream1[dtype][-1]:.1f} tok/s", flush=True)
    for llm in engines.values():
        llm.close()
    same_as_fp32 = sum(a == b for a, b in zip(ids.get("float32", []), ids.get("bfloat16", [])))
    divergences = None if args.skip_transformers else transformers_divergences(prompts, ids["bfloat16"], new_tokens)
    head = ("every logit computed in both (greedy_head_screen off)" if args.full_head else
            "greedy heads screened (the default: an int8 copy of the head up to 6 rows (fp32) or 4 (bf16), and a bf16 "
            "copy past that for fp32, each plus the exact kernel on the few columns its error bound leaves)")
    write_report(machine + f", {os.getloadavg()[0]:.1f} at the end; {head}", timings, same_as_fp32, divergences,
                 len(prompts), new_tokens, args.single, Path(args.out), args.stem)


def _ratios(rates: dict[str, list[float]]) -> list[float]:
    return [b / f for f, b in zip(rates["float32"], rates["bfloat16"])]


def write_report(machine: str, timings: Timings, same_as_fp32: int, divergences, num_prompts: int,
                 new_tokens: int, single: int, out: Path, stem: str = "bf16") -> None:
    lines = [
        "# bf16 against fp32 on the host: shared workload",
        "",
        f"{num_prompts} chat prompts x {new_tokens} new tokens, greedy, EOS ignored, SmolLM2-135M-Instruct (bundled "
        f"GGUF; fp32 and bf16 weights from the same dequantized values), host kernels on (packed oneDNN GEMM, C++ "
        f"decode attention). One-stream rows: the first {single} prompts one at a time. Both engines in one "
        f"process, taking turns each round. Machine: {machine}.",
        "",
        "| run | fp32 tokens/s | bf16 tokens/s | bf16 / fp32 (median of rounds) | per round |",
        "|---|---|---|---|---|",
    ]
    for label, rates in (("32 streams", timings.streams32), ("1 stream", timings.stream1)):
        ratios = _ratios(rates)
        if not ratios:  # --rounds 0
            continue
        lines.append(f"| {label} | {statistics.median(rates['float32']):.1f} | "
                     f"{statistics.median(rates['bfloat16']):.1f} | {statistics.median(ratios):.2f}x | "
                     f"{', '.join(f'{r:.2f}' for r in ratios)} |")
    lines += ["", "Decode steps alone (all prefills done), the two engines' steps interleaved: median and fastest step, "
                  "wall clock, and median process CPU time (CPU time leaves out waits for a core; on a crowded machine "
                  "the fastest step is the one least disturbed):", "",
              "| batch | fp32 ms / step (median, fastest) | bf16 ms / step (median, fastest) | bf16 speed / fp32 "
              "(median, fastest) | fp32 / bf16 CPU ms | bf16 / fp32 by CPU time |", "|---|---|---|---|---|---|"]
    for batch, times in timings.step_ms.items():
        fp32, bf16 = statistics.median(times["float32"]), statistics.median(times["bfloat16"])
        fp32_min, bf16_min = min(times["float32"]), min(times["bfloat16"])
        cpu = timings.step_cpu_ms[batch]
        fp32_cpu, bf16_cpu = statistics.median(cpu["float32"]), statistics.median(cpu["bfloat16"])
        lines.append(f"| {batch} | {fp32:.1f}, {fp32_min:.1f} | {bf16:.1f}, {bf16_min:.1f} | {fp32 / bf16:.2f}x, "
                     f"{fp32_min / bf16_min:.2f}x | {fp32_cpu:.1f} / {bf16_cpu:.1f} | {fp32_cpu / bf16_cpu:.2f}x |")
    lines += ["", f"bf16 greedy continuations equal to our fp32 ones: {same_as_fp32}/{num_prompts}."]
    if divergences is not None:
        near = sum(d.near_tie for _, d in divergences)
        lines += ["", f"Against transformers in bf16 (one left-padded batched generate): "
                      f"{num_prompts - len(divergences)}/{num_prompts} continuations identical; {len(divergences)} "
                      f"differ, {near} of them starting at a near-tie (transformers' logit of its token minus its "
                      f"logit of ours <= {NEAR_TIE_ULPS} bf16 ulps of its logit: 0.5 for logits in [16, 32))."]
        if divergences:
            lines += ["", "| prompt | first differing token | ours | transformers' | logit gap | bound | near-tie |",
                      "|---|---|---|---|---|---|---|"]
            lines += [f"| {i} | {d.index} | {d.ours} | {d.theirs} | {d.gap:.4f} | {d.bound:.4f} | "
                      f"{'yes' if d.near_tie else 'NO'} |" for i, d in divergences]
    text = "\n".join(lines) + "\n"
    print(text)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.md").write_text(text)
    runs = (timings.streams32, timings.stream1)
    paired_bars(out / f"{stem}.png", ["32 streams", "1 stream"],
                [(dtype, [statistics.median(t[dtype] or [0.0]) for t in runs], color)
                 for dtype, color in (("float32", "#999999"), ("bfloat16", "#4c72b0"))],
                "output tokens / s (higher is better)", "SmolLM2-135M, shared workload: fp32 vs bf16 (same run)")


if __name__ == "__main__":
    main()
