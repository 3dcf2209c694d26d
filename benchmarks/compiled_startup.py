"""Compiled start-up: time to the first token of the compiled engine, cold (empty compile cache) and warm (a second
process on the same cache directory), each in a fresh subprocess.

Settings: the shared workload's compiled engine (benchmarks/offline_throughput.py --compile inductor): SmolLM2-135M
fp32, max_num_seqs 32, max_num_batched_tokens 512, max_model_len 256, batch buckets 1,32, width buckets 8,16 (or
--width-buckets), prefill bucket 128: 4 decode + 1 prefill + 2 lm_head + 2 greedy sampler graphs at start. An eager start runs
alongside as the floor (no compile at all). The first token is one greedy token of one chat prompt after the
engine is built; every run prints its token ids, which must agree. Both compile scopes run (`--scopes`): "model"
(one graph per bucket over the 30 layers) and "layer" (one graph per bucket shared by every layer), each cold and
warm on its own cache directory.

Prints the machine (CPU model and family) and writes benchmarks/results/compiled_startup.md and .png. Start-up is
compile work (dynamo, AOTAutograd, inductor's codegen, gcc) on the host's cores: on a machine shared with other
jobs the seconds inflate, the cold / warm ratio much less.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPT = [{"role": "user", "content": "What is the capital of France?"}]


@dataclass
class StartRun:
    name: str  # "cold (model)", "warm (layer)", ..., "eager"
    ready_s: float  # process start -> engine built (graphs compiled or loaded)
    first_token_s: float  # process start -> first token returned
    compile_s: float  # the engine's warm-up (compile or cache load), inside ready_s
    cache: str  # the AOTAutograd cache's hits / misses / bypasses over the warm-up
    token_ids: list[int]
    dynamo_s: float = 0.0  # dynamo tracing the regions (runs on every start: the caches start below it)
    backend_s: float = 0.0  # AOTAutograd + inductor: compiling, or loading from the cache
    gcc_s: float = 0.0  # C++ compiles of inductor's kernels, inside backend_s (0 when every graph was cached)


def child(args) -> None:
    """One engine start in this fresh process; prints one JSON line."""
    start = time.perf_counter()
    sys.path.insert(0, str(ROOT))
    from backend_lib.core.config import EngineConfig
    from backend_lib.core.sampling_params import SamplingParams
    from backend_lib.engine.offline import LLM
    from backend_lib.core.model_path import default_model_path
    from benchmarks.workload import FLOAT_WEIGHTS

    flat = {"model": default_model_path(), **FLOAT_WEIGHTS, "max_num_seqs": 32, "max_num_batched_tokens": 512,
            "enable_prefix_caching": False, "max_model_len": 256, "num_threads": args.threads}
    if args.mode != "eager":
        flat.update(compile_backend="inductor", batch_buckets="1,32", width_buckets=args.width_buckets,
                    prefill_buckets=args.prefill_buckets, compile_cache_dir=args.cache_dir,
                    compile_scope=args.scope)
    llm = LLM(config=EngineConfig.from_flat(flat))
    ready = time.perf_counter() - start
    out = llm.generate([PROMPT], SamplingParams(max_tokens=1, temperature=0.0))
    first = time.perf_counter() - start
    stats = getattr(llm.engine.runner.model, "stats", None)
    cache = stats.cache if stats is not None else None
    from torch._dynamo.utils import compilation_time_metrics as phases

    def total(name: str) -> float:
        return sum(phases.get(name, ()))

    backend = total("OutputGraph.call_user_compiler")
    print("RESULT " + json.dumps({
        "ready_s": ready, "first_token_s": first, "compile_s": stats.compile_seconds if stats else 0.0,
        "cache": f"{cache.hits} / {cache.misses} / {cache.bypasses}" if cache else "-",
        "token_ids": out[0].token_ids, "dynamo_s": total("_compile.compile_inner") - backend,
        "backend_s": backend, "gcc_s": total("compile_file")}), flush=True)


def run_child(mode: str, cache_dir: str, args, scope: str = "model") -> StartRun:
    cmd = [sys.executable, __file__, "--child", mode, "--cache-dir", cache_dir, "--threads", str(args.threads),
           "--width-buckets", args.width_buckets, "--prefill-buckets", args.prefill_buckets, "--scope", scope]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    name = mode if mode == "eager" else f"{mode} ({scope})"
    print(f"{name} start ...", flush=True)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"{name} start failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    r = json.loads(lines[-1][len("RESULT "):])
    run = StartRun(name, r["ready_s"], r["first_token_s"], r["compile_s"], r["cache"], r["token_ids"],
                   r["dynamo_s"], r["backend_s"], r["gcc_s"])
    print(f"  {run}", flush=True)
    return run


def write_report(runs: list[StartRun], scopes: list[str], machine_line: str, load_after: float, cache_dir: str,
                 out: Path) -> str:
    by = {r.name: r for r in runs}
    same = len({tuple(r.token_ids) for r in runs}) == 1
    lines = [
        "# Compiled start-up: cold vs warm compile cache, per compile scope (SmolLM2-135M fp32, inductor)", "",
        f"Machine: {machine_line}; 1-min load average {load_after:.1f} at the end.", "",
        "Each start is a fresh process: build the engine (load the model, size the KV cache, compile or load every "
        "graph), then one greedy token of one chat prompt. Cold: an empty `compile_cache_dir`; warm: a second process "
        f"on the same directory ({cache_dir}, one subdirectory per scope). Settings of `benchmarks/offline_throughput.py --compile inductor` "
        "(4 decode, 1 prefill, 2 lm_head and 2 greedy sampler graphs). gcc: summed over inductor's parallel compile "
        "workers, so it can exceed its wall time. Cache column: the AOTAutograd cache's hits / compiled-and-saved / not cacheable during the "
        "warm-up.", "",
        "| start | engine ready (s) | of which graphs (s) | dynamo (s) | AOTAutograd + inductor (s) | of which gcc (s) "
        "| first token (s) | cache hits / saved / bypassed |",
        "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r.name} | {r.ready_s:.1f} | {r.compile_s:.1f} | {r.dynamo_s:.1f} | {r.backend_s:.1f} | "
              f"{r.gcc_s:.1f} | {r.first_token_s:.1f} | {r.cache} |" for r in runs]
    lines.append("")
    for scope in scopes:
        cold, warm = by[f"cold ({scope})"], by[f"warm ({scope})"]
        lines.append(f"- scope {scope}: cold / warm time to the first token {cold.first_token_s / warm.first_token_s:.1f}x "
                     f"({cold.first_token_s:.0f} s -> {warm.first_token_s:.0f} s); graphs alone "
                     f"{cold.compile_s / max(warm.compile_s, 1e-9):.1f}x.")
    lines += ["", f"Same first token in every start: {same}."]
    text = "\n".join(lines) + "\n"
    out.mkdir(parents=True, exist_ok=True)
    (out / "compiled_startup.md").write_text(text)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 3.5))
    names = [r.name for r in runs]
    ax.barh(names, [r.first_token_s - r.compile_s for r in runs], label="load, KV cache, first token")
    ax.barh(names, [r.compile_s for r in runs], left=[r.first_token_s - r.compile_s for r in runs],
            label="graphs (compile or cache load)")
    ax.set_xlabel("seconds from process start to the first token")
    ax.set_title("SmolLM2-135M compiled start-up, host CPU")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "compiled_startup.png", dpi=100)
    return text


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--child", choices=["cold", "warm", "eager"], help=argparse.SUPPRESS)
    parser.add_argument("--cache-dir", default="", help="compile cache directory (default: a new empty one)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = all cores)")
    parser.add_argument("--width-buckets", default="8,16", help="as offline_throughput.py --width-buckets")
    parser.add_argument("--prefill-buckets", default="128", help="as offline_throughput.py (\"\" = no prefill graph)")
    parser.add_argument("--skip-eager", action="store_true")
    parser.add_argument("--scopes", default="model,layer", help="compile scopes to start, comma-separated")
    parser.add_argument("--scope", default="model", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = parser.parse_args()
    if args.child:
        args.mode = args.child
        child(args)
        return 0
    sys.path.insert(0, str(ROOT))
    from benchmarks.machine import describe

    machine = describe()
    print(machine.line(), flush=True)
    with tempfile.TemporaryDirectory(prefix="deepinfer-compile-cache-") as scratch:
        cache_dir = args.cache_dir or scratch
        if any(Path(cache_dir).iterdir()) if Path(cache_dir).exists() else False:
            raise SystemExit(f"--cache-dir {cache_dir} is not empty: a cold start needs an empty one")
        scopes = [scope for scope in args.scopes.split(",") if scope]
        runs = []
        for scope in scopes:
            scope_dir = str(Path(cache_dir) / scope)
            runs += [run_child("cold", scope_dir, args, scope), run_child("warm", scope_dir, args, scope)]
        if not args.skip_eager:
            runs.append(run_child("eager", cache_dir, args))
    print(write_report(runs, scopes, machine.line(), os.getloadavg()[0], cache_dir if args.cache_dir else "a new temp dir",
                       Path(args.out)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
