"""The peer engines on the shared workload, run from the anchors ../shared/bench/anchors/setup.sh prepared under
/tmp/anchors: vLLM's CPU backend (fp32) and llama.cpp (F32 and Q4_1 GGUF of the same SmolLM2). Each returns the
generated tokens and the seconds they took, prefill included: the unit our own benchmarks use."""
from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

ANCHORS = Path("/tmp/anchors")
# The shared bench kit (its anchors/setup.sh builds the peers into ANCHORS): beside the checkout on the team's
# machines; DEEPINFER_PEERS_KIT names it elsewhere.
PEERS_KIT = Path(os.environ.get("DEEPINFER_PEERS_KIT", Path(__file__).resolve().parents[2] / "shared" / "bench"))


@dataclass
class PeerRun:
    name: str
    streams: int
    tokens: int
    seconds: float


def anchors_missing(bench_dir: Path) -> str | None:
    """Why the peers cannot run here, or None."""
    needed = [ANCHORS / "run_vllm_anchor.sh", ANCHORS / "llama.cpp/build/bin/llama-batched-bench",
              bench_dir / "anchors" / "vllm_bench.py"]
    missing = [str(p) for p in needed if not p.exists()]
    if not missing:
        return None
    return (f"missing {', '.join(missing)}: to add vLLM and llama.cpp, run {bench_dir}/anchors/setup.sh (the shared "
            "bench kit; DEEPINFER_PEERS_KIT=DIR where it lives elsewhere) first")


def run_vllm(bench_dir: Path, streams: int, timeout_s: float = 1800) -> PeerRun:
    """vLLM CPU: all 32 prompts with max_num_seqs=streams (32), or the first 4 one at a time (1)."""
    done = subprocess.run([str(ANCHORS / "run_vllm_anchor.sh"), str(bench_dir / "anchors" / "vllm_bench.py"),
                           str(streams)], capture_output=True, text=True, timeout=timeout_s)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"vLLM anchor failed ({done.returncode}): {done.stderr[-2000:]}")
    result = json.loads(lines[-1])
    return PeerRun("vLLM CPU 0.32 fp32", streams, int(result["tokens"]), float(result["seconds"]))


def run_llama_cpp(quant: str, streams: int, new_tokens: int, threads: int, timeout_s: float = 1800) -> PeerRun:
    """llama-batched-bench with `streams` parallel sequences of 64 prompt tokens and `new_tokens` generated each;
    its total time (prefill included) is what we divide the generated tokens by."""
    model = ANCHORS / "models" / f"SmolLM2-135M-Instruct.{quant}.gguf"
    done = subprocess.run([str(ANCHORS / "llama.cpp/build/bin/llama-batched-bench"), "-m", str(model), "-c", "16384",
                           "-b", "2048", "-ub", "512", "-npp", "64", "-ntg", str(new_tokens), "-npl", str(streams),
                           "-t", str(threads)], capture_output=True, text=True, timeout=timeout_s)
    for line in done.stdout.splitlines():
        cells = [c.strip() for c in line.split("|")]
        if len(cells) > 10 and cells[1].isdigit():  # | PP | TG | B | N_KV | T_PP | S_PP | T_TG | S_TG | T | S |
            return PeerRun(f"llama.cpp {quant}", streams, streams * new_tokens, float(cells[9]))
    raise RuntimeError(f"llama-batched-bench printed no result ({done.returncode}): {done.stderr[-2000:]}")
