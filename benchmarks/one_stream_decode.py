"""One-stream SmolLM2-135M decode, tokens/s per host GEMM (``ModelConfig.host_gemm``), side by side in one run.

Each mode gets its own engine (fp32, the bundled GGUF); the first N prompts of the shared workload run one at a
time, alternating engines prompt by prompt so a shared machine's load hits every mode alike. "onednn" is the host
default before the blocked few-row kernel (kernels/gemv.py), "auto" the default with it (blocked kernel up to
GemvPolicy.max_rows rows, oneDNN above), "gemv" the blocked kernel alone, "mkl" torch's F.linear. Also reports
whether every mode's greedy tokens equal the first mode's. Writes benchmarks/results/one_stream_decode.md.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.offline_throughput import load_workload, run_engine  # noqa: E402
from backend_lib.core.config import EngineConfig  # noqa: E402
from backend_lib.core.sampling_params import SamplingParams  # noqa: E402
from backend_lib.engine.offline import LLM  # noqa: E402
from backend_lib.core.model_path import default_model_path  # noqa: E402
from benchmarks.workload import FLOAT_WEIGHTS, WORKLOAD_FILE  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", default="onednn,auto,gemv")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=0, help="0 = the workload's")
    parser.add_argument("--workload", default=str(WORKLOAD_FILE))
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = parser.parse_args()
    prompts, new_tokens = load_workload(Path(args.workload))
    new_tokens = args.new_tokens or new_tokens
    prompts = prompts[:args.prompts]
    modes = args.modes.split(",")
    engines = {}
    for mode in modes:
        start = time.perf_counter()
        engines[mode] = LLM(config=EngineConfig.from_flat({"model": default_model_path(), **FLOAT_WEIGHTS, "max_num_seqs": 1,
                                                           "enable_prefix_caching": False, "host_gemm": mode}))
        engines[mode].generate(prompts[:1], SamplingParams(max_tokens=4, temperature=0.0))  # warm-up
        print(f"{mode}: engine ready in {time.perf_counter() - start:.0f} s", flush=True)
    tokens = {mode: 0 for mode in modes}
    seconds = {mode: 0.0 for mode in modes}
    ids = {mode: [] for mode in modes}
    for prompt in prompts:
        for mode in modes:
            count, elapsed, out = run_engine(engines[mode], [prompt], new_tokens)
            tokens[mode] += count
            seconds[mode] += elapsed
            ids[mode] += out
    first = modes[0]
    lines = [f"SmolLM2-135M fp32, one stream: {len(prompts)} prompts one at a time, {new_tokens} new tokens each, "
             "greedy, modes alternating prompt by prompt.", "",
             f"| host_gemm | tokens/s | vs {first} | greedy ids equal {first}'s |", "|---|---|---|---|"]
    for mode in modes:
        tok_s = tokens[mode] / seconds[mode]
        same = sum(a == b for a, b in zip(ids[mode], ids[first]))
        lines.append(f"| {mode} | {tok_s:.1f} | {tok_s / (tokens[first] / seconds[first]):.2f}x | "
                     f"{same}/{len(prompts)} |")
    text = "\n".join(lines) + "\n"
    print(text)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "one_stream_decode.md").write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
