"""Offline throughput on the shared workload: our engine vs transformers' generate, side by side in one run.

The workload (../shared/bench/workload.py): 32 chat prompts, 128 new tokens each, greedy, EOS ignored.
Runs (all fp32, same GGUF file):
  engine, 32 streams     all prompts as one continuous batch
  engine, 1 stream       the first N prompts one at a time
  transformers, batch    one left-padded generate() over all 32 prompts
  transformers, 1 stream the first N prompts one at a time
Prints a table with tokens/s and ratios, writes benchmarks/results/offline.md and offline.png.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from backend_lib.config import EngineConfig  # noqa: E402
from backend_lib.models.loader import default_model_path  # noqa: E402
from backend_lib.offline import LLM  # noqa: E402
from backend_lib.sampling_params import SamplingParams  # noqa: E402


@dataclass
class Run:
    name: str
    tokens: int
    seconds: float

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds


def load_workload(path: Path):
    spec = importlib.util.spec_from_file_location("workload", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.prompts(), module.NEW_TOKENS


def run_engine(llm: LLM, prompts, new_tokens: int, name: str) -> tuple[Run, list[list[int]]]:
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    results = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    assert all(len(r.token_ids) == new_tokens for r in results)
    return Run(name, sum(len(r.token_ids) for r in results), seconds), [r.token_ids for r in results]


def run_transformers(model, tokenizer, prompts, new_tokens: int, name: str) -> tuple[Run, list[list[int]]]:
    texts = [tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True) for p in prompts]
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(**batch, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id)
    seconds = time.perf_counter() - start
    new = out[:, batch["input_ids"].shape[1]:]
    return Run(name, new.numel(), seconds), new.tolist()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", default=str(ROOT.parent / "shared" / "bench" / "workload.py"))
    parser.add_argument("--single", type=int, default=4, help="prompts for the one-stream runs")
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    parser.add_argument("--compile", default="none", choices=["none", "inductor", "aot_eager"],
                        help="run the engine with compiled regions (backend_lib/neuron/regions.py)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    parser.add_argument("--width-buckets", default="8,16",
                        help="block-table width buckets of the compiled decode graphs (16-token blocks)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    prompts, new_tokens = load_workload(Path(args.workload))
    model_path = default_model_path()
    runs: list[Run] = []

    flat = {"model": model_path, "max_num_seqs": 32, "max_num_batched_tokens": 512, "enable_prefix_caching": False}
    if args.compile != "none":
        # Workload contexts stay below 256 tokens (16 blocks); 32 streams or 1; one-chunk prefills.
        flat.update(compile_backend=args.compile, max_model_len=256, batch_buckets="1,32", width_buckets=args.width_buckets,
                    prefill_buckets="128")
    start = time.perf_counter()
    llm = LLM(config=EngineConfig.from_flat(flat))  # compiles every region at start when asked to
    print(f"engine ready in {time.perf_counter() - start:.0f} s", flush=True)
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0.0))  # warm-up
    label = "deepinfer" if args.compile == "none" else f"deepinfer compiled ({args.compile})"
    run, engine_ids = run_engine(llm, prompts, new_tokens, f"{label}, 32 streams")
    runs.append(run)
    single = [run_engine(llm, [p], new_tokens, "")[0] for p in prompts[:args.single]]
    runs.append(Run(f"{label}, 1 stream", sum(r.tokens for r in single), sum(r.seconds for r in single)))
    del llm

    agree = None
    if not args.skip_transformers:
        from transformers import AutoModelForCausalLM, AutoTokenizer
        directory, name = os.path.split(model_path)
        tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32).eval()
        run, hf_ids = run_transformers(model, tokenizer, prompts, new_tokens, "transformers generate, batch 32")
        runs.append(run)
        single = [run_transformers(model, tokenizer, [p], new_tokens, "")[0] for p in prompts[:args.single]]
        runs.append(Run("transformers generate, 1 stream", sum(r.tokens for r in single),
                        sum(r.seconds for r in single)))
        # Left padding changes fp32 rounding, so count identical sequences rather than assert them.
        agree = sum(a == b for a, b in zip(engine_ids, hf_ids))
    write_report(runs, agree, len(prompts), new_tokens, args.single, Path(args.out),
                 "offline" if args.compile == "none" else "offline_compiled")


def write_report(runs: list[Run], agree: int | None, num_prompts: int, new_tokens: int, single: int,
                 out: Path, stem: str = "offline") -> None:
    by_name = {r.name: r for r in runs}
    hf_batch = by_name.get("transformers generate, batch 32")
    hf_single = by_name.get("transformers generate, 1 stream")
    lines = [
        "# Offline throughput: shared workload",
        "",
        f"{num_prompts} chat prompts x {new_tokens} new tokens, greedy, EOS ignored, fp32, SmolLM2-135M-Instruct "
        f"(bundled GGUF). One-stream rows: the first {single} prompts one at a time. "
        f"Machine: {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads.",
        "",
        "| run | tokens | seconds | tokens/s | vs transformers batch | vs transformers 1 stream |",
        "|---|---|---|---|---|---|",
    ]
    for r in runs:
        vs_batch = f"{r.tok_s / hf_batch.tok_s:.2f}x" if hf_batch else "-"
        vs_single = f"{r.tok_s / hf_single.tok_s:.2f}x" if hf_single else "-"
        lines.append(f"| {r.name} | {r.tokens} | {r.seconds:.1f} | {r.tok_s:.1f} | {vs_batch} | {vs_single} |")
    if agree is not None:
        lines += ["", f"Greedy sequences identical to transformers' batched generate: {agree}/{num_prompts} "
                      "(left padding changes fp32 rounding in transformers, so near-ties may differ)."]
    lines += ["", "Reference numbers on this kind of machine (../shared/bench/README.md): transformers 149 tok/s "
                  "(batch 32) / 15.5 (1 stream), vLLM CPU 338, llama.cpp F32 373 / 56."]
    text = "\n".join(lines) + "\n"
    print(text)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.md").write_text(text)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 3.5))
    ax.barh([r.name for r in runs][::-1], [r.tok_s for r in runs][::-1],
            color=["#4c72b0" if r.name.startswith("deepinfer") else "#999999" for r in runs][::-1])
    ax.set_xlabel("output tokens / s (higher is better)")
    ax.set_title("Shared offline workload, SmolLM2-135M fp32, 2 cores")
    fig.tight_layout()
    fig.savefig(out / f"{stem}.png", dpi=120)


if __name__ == "__main__":
    main()
