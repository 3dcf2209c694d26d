"""Offline throughput on the shared workload: our engine, the peers (vLLM CPU, llama.cpp) and transformers'
generate, side by side in one run on the machine it runs on.

The workload (benchmarks/workload.py): 32 chat prompts, 128 new tokens each, greedy, EOS ignored; the unit is
generated tokens per second over the whole run, prefill included. Runs, one after the other:
  deepinfer (per --dtypes)  32 streams: all prompts as one continuous batch; 1 stream: the first --single prompts
                            one at a time
  vLLM CPU 0.32 fp32        the same (../shared/bench/anchors/vllm_bench.py)
  llama.cpp F32 / Q4_1      llama-batched-bench, 32 or 1 sequences of 64 prompt tokens (anchors/run.sh's method)
  transformers generate     one left-padded generate() over all 32 prompts; the first --single one at a time
Prints the machine (CPU, family, flags, measured read bandwidth and GEMM peak) and a table with ratios against
each peer at the same stream count; writes benchmarks/results/<stem>.md and .png.
--rounds N repeats the whole sequence N times and keeps each engine's fastest round, with the range beside it: on
a shared VM whose memory bandwidth moves by tens of percent from minute to minute (seen on Zen 4), a single
sequence can time one engine in a slow minute and its peer in a fast one; a neighbour only ever slows a run.
Run nothing else meanwhile: a busy neighbour stalls every engine's OpenMP barriers.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from backend_lib.core.config import EngineConfig  # noqa: E402
from backend_lib.core.sampling_params import SamplingParams  # noqa: E402
from backend_lib.engine.offline import LLM  # noqa: E402
from backend_lib.core.model_path import default_model_path  # noqa: E402
from benchmarks.machine import describe, measure_limits  # noqa: E402
from benchmarks.peers import PEERS_KIT, PeerRun, anchors_missing, run_llama_cpp, run_vllm  # noqa: E402
from benchmarks.workload import FLOAT_WEIGHTS, WORKLOAD_FILE  # noqa: E402

PEERS = ("vLLM CPU 0.32 fp32", "llama.cpp F32", "transformers generate")


def tok_s(run: PeerRun) -> float:
    return run.tokens / run.seconds


def load_workload(path: Path):
    spec = importlib.util.spec_from_file_location("workload", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.prompts(), module.NEW_TOKENS


def run_engine(llm: LLM, prompts, new_tokens: int) -> tuple[int, float, list[list[int]]]:
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    results = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    assert all(len(r.token_ids) == new_tokens for r in results)
    return sum(len(r.token_ids) for r in results), seconds, [r.token_ids for r in results]


def engine_runs(args, prompts, new_tokens: int, dtype: str) -> tuple[list[PeerRun], list[list[int]]]:
    flat = {"model": default_model_path(), **FLOAT_WEIGHTS, "max_num_seqs": 32, "max_num_batched_tokens": 512,
            "enable_prefix_caching": False, "dtype": dtype}
    if args.compile != "none":
        # Workload contexts stay below 256 tokens (16 blocks); 32 streams or 1; one-chunk prefills.
        flat.update(compile_backend=args.compile, max_model_len=256, batch_buckets="1,32",
                    width_buckets=args.width_buckets, prefill_buckets="128")
    start = time.perf_counter()
    llm = LLM(config=EngineConfig.from_flat(flat))  # compiles every region at start when asked to
    print(f"engine ({dtype}) ready in {time.perf_counter() - start:.0f} s", flush=True)
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0.0))  # warm-up
    label = f"deepinfer {dtype}" + ("" if args.compile == "none" else f" compiled ({args.compile})")
    tokens, seconds, ids = run_engine(llm, prompts, new_tokens)
    runs = [PeerRun(label, len(prompts), tokens, seconds)]
    single = [run_engine(llm, [p], new_tokens)[:2] for p in prompts[:args.single]]
    runs.append(PeerRun(label, 1, sum(t for t, _ in single), sum(s for _, s in single)))
    print("\n".join(map(str, runs)), flush=True)
    llm.close()
    return runs, ids


def transformers_runs(args, prompts, new_tokens: int) -> tuple[list[PeerRun], list[list[int]]]:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    directory, name = os.path.split(default_model_path())
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32).eval()
    tokenizer.padding_side = "left"
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token

    def generate(batch_prompts) -> tuple[int, float, list[list[int]]]:
        texts = [tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True) for p in batch_prompts]
        batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(**batch, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                                 pad_token_id=tokenizer.pad_token_id)
        new = out[:, batch["input_ids"].shape[1]:]
        return new.numel(), time.perf_counter() - start, new.tolist()

    tokens, seconds, ids = generate(prompts)
    single = [generate([p])[:2] for p in prompts[:args.single]]
    return [PeerRun("transformers generate", len(prompts), tokens, seconds),
            PeerRun("transformers generate", 1, sum(t for t, _ in single), sum(s for _, s in single))], ids


def peer_runs(args, new_tokens: int) -> tuple[list[PeerRun], list[str]]:
    """The peers' runs, and a line for each peer run that failed (a peer's crash must not lose the others')."""
    bench_dir = PEERS_KIT
    why = anchors_missing(bench_dir)
    if why:
        print(f"peers skipped: {why}", flush=True)
        return [], [f"peers skipped: {why}"]
    jobs = [(f"vLLM, {s} stream(s)", lambda s=s: run_vllm(bench_dir, s)) for s in (32, 1)]
    jobs += [(f"llama.cpp {q}, {s} stream(s)",
              lambda q=q, s=s: run_llama_cpp(q, s, new_tokens, threads=torch.get_num_threads()))
             for q in ("F32", "Q4_1") for s in (32, 1)]
    runs, failures = [], []
    for label, job in jobs:
        try:
            runs.append(job())
            print(f"{runs[-1]}", flush=True)
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            failures.append(f"{label} failed: {str(exc).strip()[:300]}")
            print(failures[-1], flush=True)
    return runs, failures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", default=str(WORKLOAD_FILE))
    parser.add_argument("--single", type=int, default=4, help="prompts for the one-stream runs")
    parser.add_argument("--dtypes", default="float32", help="our engine's dtypes, comma-separated")
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--skip-peers", action="store_true", help="leave out vLLM and llama.cpp")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    parser.add_argument("--stem", default="", help="result file name (default: offline or offline_compiled)")
    parser.add_argument("--compile", default="none", choices=["none", "inductor", "aot_eager"],
                        help="run the engine with compiled regions (backend_lib/neuron/regions.py)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    parser.add_argument("--rounds", type=int, default=1, help="repeat every run; each engine's fastest counts")
    parser.add_argument("--width-buckets", default="8,16",
                        help="block-table width buckets of the compiled decode graphs (16-token blocks)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    machine = describe()
    print(machine.line(), flush=True)
    limits = measure_limits()
    print(limits.line(), flush=True)

    prompts, new_tokens = load_workload(Path(args.workload))
    runs: list[PeerRun] = []
    ours: dict[str, list[list[int]]] = {}
    hf_ids: list[list[int]] | None = None
    failures: list[str] = []
    for round_index in range(args.rounds):
        if args.rounds > 1:
            print(f"round {round_index + 1} of {args.rounds}", flush=True)
        for dtype in args.dtypes.split(","):
            dtype_runs, ids = engine_runs(args, prompts, new_tokens, dtype)
            ours.setdefault(dtype, ids)
            runs += dtype_runs
        if not args.skip_peers:
            peers, peer_failures = peer_runs(args, new_tokens)
            runs += peers
            failures += peer_failures
        if not args.skip_transformers:
            hf_runs, ids = transformers_runs(args, prompts, new_tokens)
            runs += hf_runs
            hf_ids = hf_ids or ids
    agree = None
    if hf_ids is not None and "float32" in ours:  # left padding changes fp32 rounding: count identical sequences
        agree = sum(a == b for a, b in zip(ours["float32"], hf_ids))
    stem = args.stem or ("offline" if args.compile == "none" else "offline_compiled")
    write_report(runs, agree, len(prompts), new_tokens, args.single, machine.line(), limits.line(),
                 Path(args.out), stem, failures, args.rounds)


def fastest_rounds(runs: list[PeerRun]) -> tuple[list[PeerRun], dict[tuple[str, int], tuple[float, float]]]:
    """Each (engine, streams)'s fastest run, in first-seen order, and its (slowest, fastest) tokens/s."""
    groups: dict[tuple[str, int], list[PeerRun]] = {}
    for r in runs:
        groups.setdefault((r.name, r.streams), []).append(r)
    best = [max(group, key=tok_s) for group in groups.values()]
    spread = {key: (min(map(tok_s, group)), max(map(tok_s, group))) for key, group in groups.items()}
    return best, spread


def write_report(runs: list[PeerRun], agree: int | None, num_prompts: int, new_tokens: int, single: int,
                 machine: str, limits: str, out: Path, stem: str, failures: list[str], rounds: int = 1) -> None:
    runs, spread = fastest_rounds(runs)
    peers = {(r.name, r.streams): r for r in runs if r.name in PEERS}
    range_head, range_rule = (f" tokens/s, {rounds} rounds |", "---|") if rounds > 1 else ("", "")
    lines = ["# Offline throughput: shared workload, side by side", "",
             f"{num_prompts} chat prompts x {new_tokens} new tokens, greedy, EOS ignored, SmolLM2-135M-Instruct; "
             f"generated tokens/s over the whole run, prefill included. One-stream rows: the first {single} prompts "
             "one at a time (llama.cpp: llama-batched-bench with 64-token prompts). Our engine runs its defaults: "
             "greedy steps take the head's argmax through a screened head (kernels/int8_head_screen.py up to 4 / 6 "
             "rows, bf16 / fp32; kernels/head_screen.py past that, fp32: the same tokens as every logit)."
             + (f" Every run repeated in {rounds} rounds; each row is its fastest round." if rounds > 1 else ""), "",
             f"Machine: {machine}; {limits}.", "",
             "| engine | streams | tokens | seconds | tokens/s |" + range_head + " "
             + " | ".join(f"vs {p}" for p in PEERS) + " |",
             "|---|---|---|---|---|" + range_rule + "---|" * len(PEERS)]
    for r in runs:
        ratios = [f"{tok_s(r) / tok_s(peers[(p, r.streams)]):.2f}x" if (p, r.streams) in peers else "-"
                  for p in PEERS]
        low, high = spread[(r.name, r.streams)]
        lines.append(f"| {r.name} | {r.streams} | {r.tokens} | {r.seconds:.1f} | {tok_s(r):.1f} | "
                     + (f"{low:.1f}-{high:.1f} | " if rounds > 1 else "") + " | ".join(ratios) + " |")
    if agree is not None:
        lines += ["", f"Greedy sequences identical to transformers' batched generate: {agree}/{num_prompts} "
                      "(left padding changes fp32 rounding in transformers, so near-ties may differ)."]
    lines += [""] + [f"- {line}" for line in failures] if failures else []
    text = "\n".join(lines) + "\n"
    print(text)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.md").write_text(text)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    for ax, streams in zip(axes, (32, 1)):
        these = [r for r in runs if r.streams == streams][::-1]
        ax.barh([r.name for r in these], [tok_s(r) for r in these],
                color=["#4c72b0" if r.name.startswith("deepinfer") else "#999999" for r in these])
        ax.set_title(f"{streams} stream{'s' * (streams > 1)}")
        ax.set_xlabel("generated tokens / s (higher is better)")
    fig.suptitle(f"Shared offline workload, SmolLM2-135M: {machine.split(',')[0]}", fontsize=9)
    fig.tight_layout()
    fig.savefig(out / f"{stem}.png", dpi=120)


if __name__ == "__main__":
    main()
