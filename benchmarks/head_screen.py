"""The greedy head of SmolLM2: every logit and its argmax against the screened heads (kernels/head_screen.py:
a bf16 copy of an fp32 head; kernels/int8_head_screen.py: an int8 copy of an fp32 or bf16 head, up to 6 / 4 rows),
each an error bound and the exact kernel on the tiles the bound leaves.

SmolLM2-135M-Instruct, fp32 and bf16 (head 49152 x 576: 113 MB fp32, 56 MB bf16, 28 MB int8). The head inputs are
real ones: the final normed hidden rows of the shared workload's greedy decode (the engine runs it and keeps what
reaches the head). For 1, 2, 4, 8 and 32 rows the forms take turns call by call (a shared machine's load hits all
alike); each prints its median and fastest call. Candidate tiles per row (median, 90th percentile, most) for each
screen. Every screened token is checked against the full argmax. Writes benchmarks/results/<stem>.md and .png.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
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
from kernels.gemv import blocked_linear_float  # noqa: E402
from kernels.sampling import row_argmax  # noqa: E402

ROWS = (1, 2, 4, 8, 32)


def head_inputs(llm: LLM, prompts, steps: int) -> list[torch.Tensor]:
    """The rows the engine's greedy steps hand the head (32 streams), captured on their way."""
    model = llm.engine.model
    captured: list[torch.Tensor] = []
    screen = model.greedy_token_ids

    def keep(hidden: torch.Tensor) -> torch.Tensor | None:
        captured.append(hidden.clone())
        return screen(hidden)

    model.greedy_token_ids = keep
    llm.generate(prompts, SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True))
    model.greedy_token_ids = screen
    return [h for h in captured if h.shape[0] == len(prompts)]


def candidate_tiles(model, hidden: torch.Tensor, form: str) -> list[int]:
    """Per row, the tiles whose bound interval reaches the row's best lower bound (the screen's exact work)."""
    if form == "int8":
        screen = model.int8_screen
        approx = torch.ops.deepinfer.int8_head_logits(hidden, model.screen_int8_blocked_head, screen.scales,
                                                      screen.vocab_size, screen.levels)
        reach, _ = torch.ops.deepinfer.screen_tiles(approx, hidden.float(), screen.column_bounds, 1.0)
        return reach.sum(dim=1).tolist()
    screen = model.head_screen
    approx = blocked_linear_float(hidden.to(torch.bfloat16), model.screen_blocked_head, screen.vocab_size)
    reach, _ = torch.ops.deepinfer.screen_tiles(approx, hidden, screen.row_norms, screen.coefficient)
    return reach.sum(dim=1).tolist()


def time_forms(model, inputs: list[torch.Tensor], calls: int) -> list[tuple[int, dict[str, list[float]]]]:
    """Per row count, each form's call times in ms (forms taking turns); raises if a screened token differs."""
    vocab = model._head_weight().shape[0]
    forms = {"full": lambda h: row_argmax(blocked_linear_float(h, model.blocked_head, vocab))}
    if model.head_screen is not None:
        forms["bf16 copy"] = lambda h: model.head_screen.argmax(h, model.screen_blocked_head, model.blocked_head)
    if model.int8_screen is not None:
        forms["int8 copy"] = lambda h: model.int8_screen.argmax(h, model.screen_int8_blocked_head, model.blocked_head)
    out = []
    for rows in ROWS:
        times: dict[str, list[float]] = {name: [] for name in forms}
        for call in range(calls):
            hidden = inputs[call % len(inputs)][:rows].contiguous()
            tokens = {}
            for name, form in forms.items():
                start = time.perf_counter()
                tokens[name] = form(hidden)
                times[name].append((time.perf_counter() - start) * 1e3)
            for name, got in tokens.items():
                if got is None or not torch.equal(got, tokens["full"]):
                    raise SystemExit(f"{name} tokens differ from the full head's at {rows} rows: {got}")
        out.append((rows, times))
        print(f"{rows} rows: " + ", ".join(f"{name} {statistics.median(t):.2f} ms" for name, t in times.items()),
              flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", default=str(WORKLOAD_FILE))
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--steps", type=int, default=48, help="decode steps whose head inputs are kept")
    parser.add_argument("--calls", type=int, default=30, help="timed calls per form and row count")
    parser.add_argument("--stem", default="head_screen")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = parser.parse_args()
    machine = describe().line()
    print(machine, flush=True)
    prompts, _ = load_workload(Path(args.workload))
    results = []
    for dtype in args.dtypes.split(","):
        llm = LLM(config=EngineConfig.from_flat({
            "model": default_model_path(), **FLOAT_WEIGHTS, "dtype": dtype, "max_num_seqs": 32,
            "max_num_batched_tokens": 512, "enable_prefix_caching": False, "num_blocks": 640, "num_threads": torch.get_num_threads()}))
        model = llm.engine.model
        if model.head_screen is None and model.int8_screen is None:
            raise SystemExit("no screened head here (greedy_head_screen off, no AVX2 / VNNI, or no C++ kernels)")
        inputs = head_inputs(llm, prompts, args.steps)
        tiles = {name: [t for hidden in inputs for t in candidate_tiles(model, hidden, form)]
                 for name, form, screen in (("bf16 copy", "bf16", model.head_screen),
                                            ("int8 copy", "int8", model.int8_screen)) if screen is not None}
        print(dtype, flush=True)
        results.append((dtype, time_forms(model, inputs, args.calls), tiles, len(inputs)))
        llm.close()
    write_report(machine, results, Path(args.out), args.stem)


def write_report(machine: str, results, out: Path, stem: str) -> None:
    lines = ["# Greedy head of SmolLM2: every logit against the screened heads", "",
             "Head inputs: the shared workload's batch-32 decode steps (real final hidden rows; fewer rows: the "
             "first ones of a step). The forms take turns call by call; every screened token equals the full "
             "head's argmax. The engine takes the int8 copy up to 4 rows (bf16) or 6 (fp32), the bf16 copy (fp32 "
             "heads) past that. "
             f"Machine: {machine}.", ""]
    labels, series = [], {}
    for dtype, timed, tiles, steps in results:
        names = list(timed[0][1])
        lines += [f"## {dtype} head", "",
                  "| rows | " + " | ".join(f"{name}, ms (median, fastest)" for name in names) + " | "
                  + " | ".join(f"{name} / full" for name in names[1:]) + " |",
                  "|---|" + "---|" * (2 * len(names) - 1)]
        for rows, times in timed:
            full = statistics.median(times["full"])
            lines.append(f"| {rows} | " + " | ".join(f"{statistics.median(times[n]):.2f}, {min(times[n]):.2f}"
                                                      for n in names) + " | "
                         + " | ".join(f"{statistics.median(times[n]) / full:.2f}x" for n in names[1:]) + " |")
            labels.append(f"{dtype} {rows}")
            for n in ("full", "bf16 copy", "int8 copy"):
                series.setdefault(n, []).append(statistics.median(times[n]) if n in times else 0.0)
        lines.append("")
        for name, counts in tiles.items():
            ranked = sorted(counts)
            lines.append(f"Candidate tiles (16 columns) per row, {name}, of 3072: median "
                         f"{statistics.median(ranked):.0f}, 90th percentile {ranked[int(0.9 * len(ranked))]}, "
                         f"most {ranked[-1]} ({len(ranked)} rows of {steps} steps).")
        lines.append("")
    text = "\n".join(lines)
    print(text)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.md").write_text(text)
    colors = {"full": "#999999", "bf16 copy": "#4c72b0", "int8 copy": "#dd8452"}
    paired_bars(out / f"{stem}.png", labels, [(n, v, colors[n]) for n, v in series.items()],
                "ms per call (lower is better)", "SmolLM2-135M greedy head: full vs screened")


if __name__ == "__main__":
    main()
