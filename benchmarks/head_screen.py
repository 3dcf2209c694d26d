"""The greedy head of an fp32 model: every fp32 logit and its argmax against the screened head
(kernels/head_screen.py: a bf16 copy of the head, an error bound, exact fp32 on the tiles the bound leaves).

SmolLM2-135M-Instruct fp32 (head 49152 x 576, 113 MB; the bf16 copy 56 MB). The head inputs are real ones: the
final normed hidden rows of the shared workload's greedy decode (the engine runs it and keeps what reaches the
head). For 1, 8 and 32 rows, the two forms take turns call by call (a shared machine's load hits both alike);
each prints its median and fastest call, and the candidate tiles the screen kept per row (median, 90th
percentile, most). Every screened token is checked against the full argmax. Writes
benchmarks/results/<stem>.md and .png.
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
from backend_lib.config import EngineConfig  # noqa: E402
from backend_lib.models.loader import default_model_path  # noqa: E402
from backend_lib.offline import LLM  # noqa: E402
from backend_lib.sampling_params import SamplingParams  # noqa: E402
from kernels.gemv import blocked_linear, blocked_linear_float  # noqa: E402
from kernels.sampling import row_argmax  # noqa: E402

ROWS = (1, 8, 32)


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


def candidate_tiles(model, hidden: torch.Tensor) -> list[int]:
    """Per row, the tiles whose bound interval reaches the row's best lower bound (the screen's exact work)."""
    screen = model.head_screen
    approx = blocked_linear_float(hidden.to(torch.bfloat16), model.screen_blocked_head, screen.vocab_size)
    bound = screen.coefficient * hidden.norm(dim=1, keepdim=True) * screen.row_norms[None, :]
    reach = (approx + bound) >= (approx - bound).max(dim=1, keepdim=True).values
    padded = torch.nn.functional.pad(reach, (0, -reach.shape[1] % 16))
    return padded.view(reach.shape[0], -1, 16).any(dim=2).sum(dim=1).tolist()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", default=str(ROOT.parent / "shared" / "bench" / "workload.py"))
    parser.add_argument("--steps", type=int, default=48, help="decode steps whose head inputs are kept")
    parser.add_argument("--calls", type=int, default=30, help="timed calls per form and row count")
    parser.add_argument("--stem", default="head_screen")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = parser.parse_args()
    machine = describe().line()
    print(machine, flush=True)
    prompts, _ = load_workload(Path(args.workload))
    llm = LLM(config=EngineConfig.from_flat({
        "model": default_model_path(), "dtype": "float32", "max_num_seqs": 32, "max_num_batched_tokens": 512,
        "enable_prefix_caching": False, "num_blocks": 640, "num_threads": torch.get_num_threads()}))
    model = llm.engine.model
    if model.head_screen is None:
        raise SystemExit("the engine has no screened head here (greedy_head_screen off, no AVX2, or no C++ kernels)")
    inputs = head_inputs(llm, prompts, args.steps)
    vocab = model.head_screen.vocab_size
    tiles = [t for hidden in inputs for t in candidate_tiles(model, hidden)]
    rows_out = []
    for rows in ROWS:
        full_ms, screened_ms = [], []
        for call in range(args.calls):
            hidden = inputs[call % len(inputs)][:rows].contiguous()
            start = time.perf_counter()
            full = row_argmax(blocked_linear(hidden, model.blocked_head, None, vocab))
            full_ms.append((time.perf_counter() - start) * 1e3)
            start = time.perf_counter()
            screened = model.greedy_token_ids(hidden)
            screened_ms.append((time.perf_counter() - start) * 1e3)
            if screened is None or not torch.equal(screened, full):
                raise SystemExit(f"screened tokens differ from the full head's at {rows} rows: {screened} {full}")
        rows_out.append((rows, full_ms, screened_ms))
        print(f"{rows} rows: full {statistics.median(full_ms):.2f} ms, screened {statistics.median(screened_ms):.2f} ms",
              flush=True)
    llm.close()
    write_report(machine, rows_out, tiles, len(inputs), Path(args.out), args.stem)


def write_report(machine: str, rows_out, tiles: list[int], steps: int, out: Path, stem: str) -> None:
    ranked = sorted(tiles)
    lines = ["# Greedy head of SmolLM2 fp32: every logit against the screened head", "",
             f"Head inputs: {steps} batch-32 decode steps of the shared workload (real final hidden rows). The forms "
             "take turns call by call; every screened token equals the full head's argmax. Machine: "
             f"{machine}.", "",
             "| rows | full fp32 head + argmax, ms (median, fastest) | screened, ms (median, fastest) | "
             "screened / full (median) |", "|---|---|---|---|"]
    for rows, full_ms, screened_ms in rows_out:
        lines.append(f"| {rows} | {statistics.median(full_ms):.2f}, {min(full_ms):.2f} | "
                     f"{statistics.median(screened_ms):.2f}, {min(screened_ms):.2f} | "
                     f"{statistics.median(screened_ms) / statistics.median(full_ms):.2f}x |")
    lines += ["", f"Candidate tiles (16 columns) per row, of {-(-49152 // 16)}: median {statistics.median(ranked):.0f}, "
                  f"90th percentile {ranked[int(0.9 * len(ranked))]}, most {ranked[-1]} ({len(ranked)} rows)."]
    text = "\n".join(lines) + "\n"
    print(text)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.md").write_text(text)
    paired_bars(out / f"{stem}.png", [f"{rows} rows" for rows, _, _ in rows_out],
                [("full fp32 head", [statistics.median(r[1]) for r in rows_out], "#999999"),
                 ("screened", [statistics.median(r[2]) for r in rows_out], "#4c72b0")],
                "ms per call (lower is better)", "SmolLM2-135M fp32 head, greedy: full vs screened")


if __name__ == "__main__":
    main()
