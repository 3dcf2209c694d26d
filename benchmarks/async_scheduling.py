"""Zero-overhead scheduling (``async_scheduling``) on and off: the shared offline workload at 32 streams and 1,
with the real forward and with a simulated device.

Rows, for each torch thread count of ``--threads`` (0 = torch's default, every core):
  real forward        the engine as it serves on the host: SmolLM2-135M fp32, greedy, EOS ignored
  simulated device    the model's forward replaced by a timed sleep of the step length measured in the real-forward
                      run with async_scheduling off at that stream count (the head and the sampler still run): the
                      host part of each step (scheduling, input preparation, commit, detokenization) is what is
                      left, as on a device whose forward does not use the host's cores; the sleep releases the GIL
                      the way a device wait does
Each row: generated tokens/s over the run (prefill included), the mean step time, and on == off (every sequence's
ids identical; the simulated rows compare with each other). Every engine runs on a thread of its own (AsyncEngine's
loop), never the main thread. Writes benchmarks/results/<stem>.md and .png.
"""
from __future__ import annotations

import argparse
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from backend_lib.core.config import EngineConfig  # noqa: E402
from backend_lib.core.model_path import default_model_path  # noqa: E402
from backend_lib.core.sampling_params import SamplingParams  # noqa: E402
from backend_lib.engine.offline import LLM  # noqa: E402
from benchmarks.machine import describe  # noqa: E402
from benchmarks.offline_throughput import load_workload  # noqa: E402
from benchmarks.workload import FLOAT_WEIGHTS, WORKLOAD_FILE  # noqa: E402


class SimulatedDevice(torch.nn.Module):
    """The model with its forward replaced by a sleep of ``seconds`` (zeros as the hidden states); the head is the
    model's."""

    def __init__(self, model: torch.nn.Module, seconds: float, hidden_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.inner, self.seconds, self.hidden_size, self.dtype = model, seconds, hidden_size, dtype

    def forward(self, input_ids, positions, kv_caches, meta):  # input_ids [T] int64
        time.sleep(self.seconds)
        return torch.zeros(input_ids.shape[0], self.hidden_size, dtype=self.dtype)

    def compute_logits(self, hidden):  # [N, hidden]
        return self.inner.compute_logits(hidden)


@dataclass
class Run:
    forward: str  # "real" or "simulated"
    threads: int
    streams: int
    async_on: bool
    tokens: int
    seconds: float
    steps: int
    ids: list[list[int]]

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds

    @property
    def step_ms(self) -> float:
        return 1e3 * self.seconds / self.steps


def generate(llm: LLM, prompts, new_tokens: int) -> tuple[int, float, int, list[list[int]]]:
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    steps = llm.engine.num_steps
    start = time.perf_counter()
    results = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    assert all(len(r.token_ids) == new_tokens for r in results)
    return sum(len(r.token_ids) for r in results), seconds, llm.engine.num_steps - steps, [r.token_ids for r in results]


def runs_for(args, prompts, new_tokens: int, threads: int, async_on: bool,
             sleep_s: dict[int, float] | None) -> list[Run]:
    flat = {"model": default_model_path(), **FLOAT_WEIGHTS, "max_num_seqs": 32, "max_num_batched_tokens": 512,
            "enable_prefix_caching": False, "num_threads": threads, "async_scheduling": async_on}
    llm = LLM(config=EngineConfig.from_flat(flat))
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0.0))  # warm-up
    runner = llm.engine.runner
    real_model = runner.model
    out = []
    for streams, batch in ((32, prompts), (1, prompts[:args.single])):
        if sleep_s is not None:
            runner.model = SimulatedDevice(real_model, sleep_s[streams], llm.engine.model.arch.hidden_size,
                                           llm.engine.dtype)
        parts = [generate(llm, batch if streams > 1 else [p], new_tokens) for p in (batch if streams == 1 else [0])]
        tokens, seconds, steps = (sum(p[i] for p in parts) for i in range(3))
        ids = [i for p in parts for i in p[3]]
        run = Run("simulated" if sleep_s is not None else "real", threads or torch.get_num_threads(), streams,
                  async_on, tokens, seconds, steps, ids)
        print(f"{run.forward} threads={run.threads} streams={streams} async={'on' if async_on else 'off'}: "
              f"{run.tok_s:.1f} tokens/s, {run.step_ms:.2f} ms a step", flush=True)
        out.append(run)
        runner.model = real_model
    llm.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", default=str(WORKLOAD_FILE))
    parser.add_argument("--new-tokens", type=int, default=0, help="0 = the workload's")
    parser.add_argument("--single", type=int, default=2, help="prompts for the one-stream rows")
    parser.add_argument("--threads", default="0,1", help="torch thread counts, comma-separated (0 = default)")
    parser.add_argument("--async-scheduling", default="off,on", help="the settings to run, comma-separated")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    parser.add_argument("--stem", default="async_scheduling")
    parser.add_argument("--forward", default="real,simulated", help="real, simulated or both")
    parser.add_argument("--device-step-ms", default="",
                        help="the simulated step at 32 and 1 streams, e.g. '32,8.8' (default: this run's measured "
                             "real step with async_scheduling off)")
    parser.add_argument("--note", default="", help="a line about the machine's load, printed under the table")
    args = parser.parse_args()
    machine = describe().line()
    print(machine, flush=True)
    prompts, new_tokens = load_workload(Path(args.workload))
    new_tokens = args.new_tokens or new_tokens
    settings = [s == "on" for s in args.async_scheduling.split(",")]
    runs: list[Run] = []
    # Each engine is built and driven on a thread of its own, as AsyncEngine's loop is: on the host, GNU OpenMP
    # work started from the main thread runs measurably slower than from another thread under load, which would
    # otherwise count for async_scheduling (its forward runs on the device thread).
    loop = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine-loop")

    def on_loop(*job_args) -> list[Run]:
        return loop.submit(runs_for, *job_args).result()

    forwards = args.forward.split(",")
    given = [float(ms) / 1e3 for ms in args.device_step_ms.split(",")] if args.device_step_ms else None
    for threads in (int(t) for t in args.threads.split(",")):
        real = ([r for on in settings for r in on_loop(args, prompts, new_tokens, threads, on, None)]
                if "real" in forwards else [])
        if "simulated" in forwards:
            base = {r.streams: r for r in real if not r.async_on} or {r.streams: r for r in real}
            sleep_s = dict(zip((32, 1), given)) if given else {n: r.seconds / r.steps for n, r in base.items()}
            real += [r for on in settings for r in on_loop(args, prompts, new_tokens, threads, on, sleep_s)]
        runs += real
    loop.shutdown()
    write_report(runs, machine, new_tokens, len(prompts), args.single, Path(args.out), args.stem, args.note,
                 args.device_step_ms)


def write_report(runs: list[Run], machine: str, new_tokens: int, num_prompts: int, single: int, out: Path,
                 stem: str, note: str, device_step_ms: str) -> None:
    off = {(r.forward, r.threads, r.streams): r for r in runs if not r.async_on}
    lines = ["# Zero-overhead scheduling (async_scheduling) on and off", "",
             f"{num_prompts} chat prompts x {new_tokens} new tokens (32 streams: one batch; 1 stream: the first "
             f"{single} prompts one at a time), greedy, EOS ignored, SmolLM2-135M fp32; generated tokens/s over the "
             "run, prefill included. Simulated device: the forward replaced by a sleep of "
             + (f"{device_step_ms} ms at 32 and 1 streams" if device_step_ms else
                "the step length measured with the real forward and async_scheduling off")
             + "; the head and the sampler still run (benchmarks/async_scheduling.py).", "",
             f"Machine: {machine}." + (f" {note}" if note else ""), "",
             "| forward | torch threads | streams | async_scheduling | tokens/s | ms a step | vs off | ids == off |",
             "|---|---|---|---|---|---|---|---|"]
    for r in runs:
        ref = off.get((r.forward, r.threads, r.streams))
        ratio = f"{r.tok_s / ref.tok_s:.2f}x" if ref is not None else "-"
        same = "-" if ref is None or ref is r else ("yes" if ref.ids == r.ids else "NO")
        lines.append(f"| {r.forward} | {r.threads} | {r.streams} | {'on' if r.async_on else 'off'} | "
                     f"{r.tok_s:.1f} | {r.step_ms:.2f} | {ratio} | {same} |")
    text = "\n".join(lines) + "\n"
    print(text)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.md").write_text(text)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, streams in zip(axes, (32, 1)):
        these = [r for r in runs if r.streams == streams][::-1]
        ax.barh([f"{r.forward}, {r.threads} thr, {'on' if r.async_on else 'off'}" for r in these],
                [r.tok_s for r in these], color=["#4c72b0" if r.async_on else "#999999" for r in these])
        ax.set_title(f"{streams} stream{'s' * (streams > 1)} (blue: async_scheduling on)")
        ax.set_xlabel("generated tokens / s (higher is better)")
    fig.suptitle(f"async_scheduling, SmolLM2-135M: {machine.split(',')[0]}", fontsize=9)
    fig.tight_layout()
    fig.savefig(out / f"{stem}.png", dpi=120)


if __name__ == "__main__":
    main()
