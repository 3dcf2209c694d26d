"""Quantized SmolLM2 on the shared workload, side by side in one run: ``weight_format=packed`` (the GEMMs read the
GGUF blocks; ``packed_gemm_path`` auto = int8 activations, and fp32 widening) vs ``weight_format=dequantize``
(fp32 weights) vs llama.cpp on the same GGUF (../shared/bench/anchors, prepared under /tmp/anchors by setup.sh),
at 32 streams (all 32 prompts) and 1 stream (the first ``--single`` prompts one at a time), 128 new tokens each,
greedy, EOS ignored. Formats: the bundled Q4_1 and a Q8_0 converted from it with the ``gguf`` package's own
quantizer (``--formats``). Tokens/s count generated tokens over the whole run, prefill included (as
benchmarks/offline_throughput.py and the anchors' run.sh do). Also states the resident bytes per weight of each
engine and how many greedy continuations of each packed mode equal dequantize's, and each mode's teacher-forced
perplexity beside llama.cpp's ``llama-perplexity`` on the same text, file and windows where the anchors built it
(benchmarks/perplexity.py says how the two are made comparable; ``--perplexity-only`` skips the speed runs).

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
from benchmarks.perplexity import (FIRST_SCORED, LICENSE_TEXTS, WINDOW, Perplexity,  # noqa: E402
                                   WindowScores, corpus_ids, corpus_text, engine_perplexity,
                                   llama_cpp_perplexity, llama_cpp_tokens, token_windows, write_text)
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


def our_runs(path: Path, quant: str, prompts, new_tokens: int, single: int, ppl_windows: int, speed: bool,
             their_ids: list[int] | None):
    """(runs, resident bytes per weight by mode, greedy ids at 32 streams by mode, perplexity by mode, the text's
    token ids); no runs and no greedy ids without ``speed``."""
    runs, bytes_per_weight, ids, ppl = [], {}, {}, {}
    for label, settings in MODES.items():
        llm = LLM(config=EngineConfig.from_flat({"model": str(path), "max_num_seqs": 32,
                                                 "max_num_batched_tokens": 512, "enable_prefix_caching": False,
                                                 **settings}))
        weights, resident = resident_weight_bytes(llm.engine.model)
        bytes_per_weight[label] = resident / weights
        if speed:
            llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0.0))  # warm-up
            tokens, seconds, ids[label] = run_engine(llm, prompts, new_tokens)
            runs.append(PeerRun(f"deepinfer {quant} {label}", len(prompts), tokens, seconds))
            one = [run_engine(llm, [p], new_tokens)[:2] for p in prompts[:single]]
            runs.append(PeerRun(f"deepinfer {quant} {label}", 1, sum(t for t, _ in one), sum(s for _, s in one)))
            print("\n".join(map(str, runs[-2:])), flush=True)
        text_ids = corpus_ids(llm, corpus_text())
        ppl[label] = engine_perplexity(llm, token_windows(text_ids, ppl_windows),
                                       None if their_ids is None else token_windows(their_ids, ppl_windows))
        print(f"{label}: perplexity {ppl[label].every.value:.4f} over {ppl[label].every.tokens} tokens, second "
              f"halves {ppl[label].second_half.value:.4f} over {ppl[label].second_half.tokens}", flush=True)
        llm.close()
    return runs, bytes_per_weight, ids, ppl, text_ids


def llama_cpp_ids(quant: str) -> tuple[list[int] | None, list[str]]:
    """llama-tokenize's ids of the text (llama-perplexity's tokens), where built."""
    binary = ANCHORS / "llama.cpp/build/bin/llama-tokenize"
    if not binary.exists():
        return None, [f"llama.cpp {quant} tokens not compared: {binary} is missing (cmake --build build --target "
                      "llama-tokenize in /tmp/anchors/llama.cpp)"]
    try:
        return llama_cpp_tokens(binary, model_path(quant), write_text(corpus_text(), ANCHORS)), []
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        return None, [f"llama.cpp {quant} tokens not compared: {str(exc).strip()[:300]}"]


def tokens_note(quant: str, theirs: list[int], ours: list[int], scored: int) -> str:
    differ = next((i for i, (a, b) in enumerate(zip(theirs[:scored], ours[:scored])) if a != b), None)
    return (f"llama.cpp {quant} tokenization: {len(theirs)} tokens of the text against our {len(ours)}; " +
            ("the same ids in the scored windows" if differ is None else
             f"the first differing id at token {differ}, so the last column runs ours on llama.cpp's ids"))


def llama_cpp_ppl(quant: str, windows: int) -> tuple[Perplexity | None, list[str]]:
    binary = ANCHORS / "llama.cpp/build/bin/llama-perplexity"
    if not binary.exists():
        return None, [f"llama.cpp {quant} perplexity skipped: {binary} is missing (run "
                      f"{PEERS_KIT}/anchors/setup.sh 3)"]
    try:
        return llama_cpp_perplexity(binary, model_path(quant), write_text(corpus_text(), ANCHORS), windows,
                                    torch.get_num_threads()), []
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


def perplexity_table(quant: str, runs: list[PeerRun], peers: list[PeerRun], ppl: dict[str, WindowScores],
                     peer_ppl: Perplexity | None) -> list[str]:
    """One row per run (a row per mode without speed runs); llama.cpp's perplexity in the column of its own tokens."""
    some = next(iter(ppl.values()))
    theirs = some.second_half_theirs
    lines = [f"| engine | streams | tokens/s | vs llama.cpp | perplexity ({some.every.tokens} tokens) | "
             f"second halves ({some.second_half.tokens} tokens, llama-perplexity's scoring) | second halves on "
             f"llama.cpp's tokens ({'-' if theirs is None else theirs.tokens} tokens, the same windows) |",
             "|---|---|---|---|---|---|---|"]
    anchor = {r.streams: r.tokens / r.seconds for r in peers}
    peer_cell = "skipped" if peer_ppl is None else f"{peer_ppl.value:.4f}"
    rows = runs + peers or [PeerRun(f"deepinfer {quant} {label}", 0, 0, 0.0) for label in ppl]
    for run in rows:
        mode = run.name.removeprefix(f"deepinfer {quant} ")
        speed = ("- | - | -" if not run.seconds else f"{run.streams} | {run.tokens / run.seconds:.1f} | " + (
            f"{run.tokens / run.seconds / anchor[run.streams]:.2f}x" if run.streams in anchor else "n/a"))
        if mode in ppl:
            on_theirs = ppl[mode].second_half_theirs
            scores = (f"{ppl[mode].every.value:.4f} | {ppl[mode].second_half.value:.4f} | "
                      f"{'not run' if on_theirs is None else f'{on_theirs.value:.4f}'}")
        else:
            scores = f"- | - | {peer_cell}"
        lines.append(f"| {run.name} | {speed} | {scores} |")
    if not peers:
        lines.append(f"| llama.cpp {quant} (llama-perplexity, -ctk / -ctv f32) | - | - | - | - | - | {peer_cell} |")
    return lines


def perplexity_note(ppl: dict[str, WindowScores], peer_ppl: Perplexity | None) -> str:
    reference = ppl[next(iter(MODES))]
    texts = " + ".join(p.name for p in LICENSE_TEXTS)
    note = (f"Perplexity: teacher-forced through prompt_logprobs over {texts} in consecutive {WINDOW}-token windows "
            "(benchmarks/perplexity.py), every token after a window's first, and (second halves) only its tokens "
            f"{FIRST_SCORED + 1}-{WINDOW - 1}, which is what llama-perplexity scores (-c {WINDOW}, the same "
            "consecutive windows, no BOS: the file's add_bos_token is false; its KV cache set to f32 like ours); "
            "vs dequantize (every token / second halves): " + ", ".join(
                f"{label} {100 * (value.every.value / reference.every.value - 1):+.2f}% / "
                f"{100 * (value.second_half.value / reference.second_half.value - 1):+.2f}%"
                for label, value in ppl.items()))
    if peer_ppl is None or reference.second_half_theirs is None:
        return note
    return note + "; on llama.cpp's tokens, llama.cpp against each of ours: " + ", ".join(
        f"{label} {100 * (peer_ppl.value / value.second_half_theirs.value - 1):+.2f}%" for label, value in ppl.items())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", default=str(WORKLOAD_FILE))
    parser.add_argument("--formats", default="Q4_1,Q8_0")
    parser.add_argument("--single", type=int, default=4, help="prompts for the one-stream runs")
    parser.add_argument("--ppl-windows", type=int, default=8, help=f"perplexity windows of {WINDOW} tokens")
    parser.add_argument("--perplexity-only", action="store_true", help="no tokens/s runs: the perplexity columns")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "quantized.md"))
    args = parser.parse_args()
    prompts, new_tokens = load_workload(Path(args.workload))
    machine = describe()
    workload = ("Workload: none (--perplexity-only: no tokens/s runs)." if args.perplexity_only else
                f"Workload: {len(prompts)} prompts at 32 streams, the first {args.single} one at a time at 1 stream, "
                f"{new_tokens} new tokens each, greedy; tokens/s over the whole run, prefill included.")
    lines = ["# Quantized SmolLM2: weight_format=packed vs dequantize vs llama.cpp", "", f"Machine: {machine.line()}",
             "", workload, ""]
    started = time.time()
    for quant in args.formats.split(","):
        their_ids, ppl_notes = llama_cpp_ids(quant)
        runs, bytes_per_weight, ids, ppl, text_ids = our_runs(model_path(quant), quant, prompts, new_tokens,
                                                              args.single, args.ppl_windows, not args.perplexity_only,
                                                              their_ids)
        peers, failures = llama_cpp_runs(quant, new_tokens) if not args.perplexity_only else ([], [])
        peer_ppl, peer_notes = llama_cpp_ppl(quant, args.ppl_windows)
        ppl_notes += peer_notes
        if their_ids is not None:
            ppl_notes.append(tokens_note(quant, their_ids, text_ids, args.ppl_windows * WINDOW))
        lines += [f"## {quant}", "", *perplexity_table(quant, runs, peers, ppl, peer_ppl), ""]
        lines += [perplexity_note(ppl, peer_ppl)]
        lines += [""] + [f"- {label}: {bytes_per_weight[label]:.3f} resident bytes per weight" + (
                         f"; {sum(a == b for a, b in zip(ids[label], ids[next(iter(MODES))]))}/{len(prompts)} "
                         "greedy continuations equal dequantize's" if ids else "") for label in MODES]
        lines += [f"- {f}" for f in failures + ppl_notes] + [""]
    lines.append(f"Load average at the end: {' '.join(f'{v:.2f}' for v in os.getloadavg())}; "
                 f"run took {time.time() - started:.0f} s.")
    text = "\n".join(lines) + "\n"
    print(text)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
