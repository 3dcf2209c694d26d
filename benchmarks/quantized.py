"""Quantized SmolLM2 on the shared workload, side by side in one run: ``weight_format=packed`` (the GEMMs read the
GGUF blocks; ``packed_gemm_path`` auto = int8 activations, and fp32 widening) vs ``weight_format=dequantize``
(fp32 weights) vs llama.cpp on the same GGUF (../shared/bench/anchors, prepared under /tmp/anchors by setup.sh),
at 32 streams (all 32 prompts) and 1 stream (the first ``--single`` prompts one at a time), 128 new tokens each,
greedy, EOS ignored. Formats: the bundled Q4_1 and a Q8_0 converted from it with the ``gguf`` package's own
quantizer (``--formats``). Tokens/s count generated tokens over the whole run, prefill included (as
benchmarks/offline_throughput.py and the anchors' run.sh do). Also states the resident bytes per weight of each
engine and how many greedy continuations of each packed mode equal dequantize's.

Targets (issue 37): packed Q4_1 >= 1.2x llama.cpp Q4_1 at one stream, >= 1.3x at 32 streams. Not covered yet: the
tiny DeepSeek-V3 fp8 / V4 fp8 + fp4 rows (weight_format=packed is not wired into the DeepSeek models).
Run it on a quiet machine only (other processes stall both engines' threads). Writes
benchmarks/results/quantized.md.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter  # noqa: E402
from gguf.quants import dequantize, quantize  # noqa: E402

from benchmarks.machine import describe  # noqa: E402
from benchmarks.offline_throughput import load_workload, run_engine  # noqa: E402
from benchmarks.peers import ANCHORS, PEERS_KIT, PeerRun, run_llama_cpp  # noqa: E402
from benchmarks.perplexity import (LICENSE_TEXTS, WINDOW, corpus_text, engine_perplexity,  # noqa: E402
                                   llama_cpp_perplexity, token_windows)
from backend_lib.core.config import EngineConfig  # noqa: E402
from backend_lib.core.sampling_params import SamplingParams  # noqa: E402
from backend_lib.engine.offline import LLM  # noqa: E402
from backend_lib.models.layers import resident_weight_bytes  # noqa: E402
from backend_lib.core.model_path import default_model_path  # noqa: E402
from benchmarks.workload import WORKLOAD_FILE  # noqa: E402

MODES = {  # label -> engine settings
    "dequantize (fp32)": {"weight_format": "dequantize"},
    "packed (int8 activations; the default)": {},  # weight_format auto on a quantized file
    "packed (fp32 widening)": {"weight_format": "packed", "packed_gemm_path": "fp32"},
}


def convert_to_q8_0(source: Path, target: Path) -> None:
    """Every quantized 2-D tensor of ``source`` dequantized and requantized to Q8_0 by gguf's own quantizer; the
    metadata and the other tensors copied as they are."""
    reader = GGUFReader(str(source))
    arch = reader.fields["general.architecture"].contents()
    writer = GGUFWriter(str(target), arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), kind, sub_type=sub)
    for tensor in reader.tensors:
        data, qtype = np.asarray(tensor.data), tensor.tensor_type
        if qtype not in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            values = dequantize(data, qtype)
            data, qtype = quantize(values, GGMLQuantizationType.Q8_0), GGMLQuantizationType.Q8_0
            shape = values.shape
        else:
            shape = data.shape
        writer.add_tensor(tensor.name, data, raw_shape=shape if qtype != GGMLQuantizationType.Q8_0 else None,
                          raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def model_path(quant: str) -> Path:
    """The GGUF of ``quant`` (Q4_1 bundled; Q8_0 converted once next to the anchors' models, else under /tmp)."""
    if quant == "Q4_1":
        return Path(default_model_path())
    directory = ANCHORS / "models" if (ANCHORS / "models").is_dir() else Path("/tmp")
    path = directory / f"SmolLM2-135M-Instruct.{quant}.gguf"
    if not path.exists():
        print(f"converting {quant} -> {path}", flush=True)
        convert_to_q8_0(Path(default_model_path()), path)
    return path


def our_runs(path: Path, quant: str, prompts, new_tokens: int, single: int, ppl_windows: int):
    """(runs, resident bytes per weight by mode, greedy ids at 32 streams by mode, perplexity by mode)."""
    runs, bytes_per_weight, ids, ppl = [], {}, {}, {}
    for label, settings in MODES.items():
        llm = LLM(config=EngineConfig.from_flat({"model": str(path), "max_num_seqs": 32,
                                                 "max_num_batched_tokens": 512, "enable_prefix_caching": False,
                                                 **settings}))
        weights, resident = resident_weight_bytes(llm.engine.model)
        bytes_per_weight[label] = resident / weights
        llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0.0))  # warm-up
        tokens, seconds, ids[label] = run_engine(llm, prompts, new_tokens)
        runs.append(PeerRun(f"deepinfer {quant} {label}", len(prompts), tokens, seconds))
        one = [run_engine(llm, [p], new_tokens)[:2] for p in prompts[:single]]
        runs.append(PeerRun(f"deepinfer {quant} {label}", 1, sum(t for t, _ in one), sum(s for _, s in one)))
        print("\n".join(map(str, runs[-2:])), flush=True)
        ppl[label] = engine_perplexity(llm, token_windows(llm, corpus_text(), ppl_windows))
        print(f"{label}: perplexity {ppl[label].value:.4f} over {ppl[label].tokens} tokens", flush=True)
        llm.close()
    return runs, bytes_per_weight, ids, ppl


def llama_cpp_ppl(quant: str, windows: int) -> tuple[float | None, list[str]]:
    binary = ANCHORS / "llama.cpp/build/bin/llama-perplexity"
    if not binary.exists():
        return None, [f"llama.cpp {quant} perplexity skipped: {binary} is missing (run "
                      f"{PEERS_KIT}/anchors/setup.sh 3)"]
    try:
        return llama_cpp_perplexity(binary, model_path(quant), corpus_text(), windows, torch.get_num_threads(),
                                    ANCHORS), []
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        return None, [f"llama.cpp {quant} perplexity failed: {str(exc).strip()[:300]}"]


def llama_cpp_runs(quant: str, new_tokens: int) -> tuple[list[PeerRun], list[str]]:
    binary = ANCHORS / "llama.cpp/build/bin/llama-batched-bench"
    if not binary.exists():
        return [], [f"llama.cpp {quant} skipped: {binary} is missing (run {PEERS_KIT}/anchors/setup.sh 3)"]
    model_path(quant)  # the Q8_0 conversion, where llama.cpp reads it
    runs, failures = [], []
    for streams in (32, 1):
        try:
            runs.append(run_llama_cpp(quant, streams, new_tokens, threads=torch.get_num_threads()))
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            failures.append(f"llama.cpp {quant}, {streams} stream(s) failed: {str(exc).strip()[:300]}")
    return runs, failures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", default=str(WORKLOAD_FILE))
    parser.add_argument("--formats", default="Q4_1,Q8_0")
    parser.add_argument("--single", type=int, default=4, help="prompts for the one-stream runs")
    parser.add_argument("--ppl-windows", type=int, default=8, help=f"perplexity windows of {WINDOW} tokens")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "quantized.md"))
    args = parser.parse_args()
    prompts, new_tokens = load_workload(Path(args.workload))
    machine = describe()
    lines = ["# Quantized SmolLM2: weight_format=packed vs dequantize vs llama.cpp", "", f"Machine: {machine.line()}",
             "", f"Workload: {len(prompts)} prompts at 32 streams, the first {args.single} one at a time at 1 stream, "
             f"{new_tokens} new tokens each, greedy; tokens/s over the whole run, prefill included.", ""]
    started = time.time()
    for quant in args.formats.split(","):
        runs, bytes_per_weight, ids, ppl = our_runs(model_path(quant), quant, prompts, new_tokens, args.single,
                                                    args.ppl_windows)
        peers, failures = llama_cpp_runs(quant, new_tokens)
        peer_ppl, ppl_failures = llama_cpp_ppl(quant, args.ppl_windows)
        failures += ppl_failures
        anchor = {r.streams: r.tokens / r.seconds for r in peers}
        scored = next(iter(ppl.values())).tokens
        lines += [f"## {quant}", "", f"| engine | streams | tokens/s | vs llama.cpp | perplexity ({scored} tokens) |",
                  "|---|---|---|---|---|"]
        for run in runs + peers:
            tok_s = run.tokens / run.seconds
            ratio = f"{tok_s / anchor[run.streams]:.2f}x" if run.streams in anchor else "n/a"
            mode = run.name.removeprefix(f"deepinfer {quant} ")
            perplexity = (f"{ppl[mode].value:.4f}" if mode in ppl
                          else f"{peer_ppl:.4f} (llama-perplexity)" if peer_ppl is not None else "skipped")
            lines.append(f"| {run.name} | {run.streams} | {tok_s:.1f} | {ratio} | {perplexity} |")
        if not peers and peer_ppl is not None:
            lines.append(f"| llama.cpp {quant} | - | - | - | {peer_ppl:.4f} (llama-perplexity) |")
        reference_ppl = ppl[next(iter(MODES))].value
        lines += ["", "Perplexity: teacher-forced through prompt_logprobs over "
                  f"{' + '.join(p.name for p in LICENSE_TEXTS)} in {WINDOW}-token windows "
                  "(benchmarks/perplexity.py); vs dequantize: " + ", ".join(
                      f"{label} {100 * (value.value / reference_ppl - 1):+.2f}%" for label, value in ppl.items())]
        reference = ids[next(iter(MODES))]
        lines += [""] + [f"- {label}: {bytes_per_weight[label]:.3f} resident bytes per weight; "
                         f"{sum(a == b for a, b in zip(ids[label], reference))}/{len(reference)} greedy "
                         f"continuations equal dequantize's" for label in MODES] + [f"- {f}" for f in failures] + [""]
    lines.append(f"Load average at the end: {' '.join(f'{v:.2f}' for v in os.getloadavg())}; "
                 f"run took {time.time() - started:.0f} s.")
    text = "\n".join(lines) + "\n"
    print(text)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
