"""OpenAI front (AIPerf) vs gRPC (benchmarks/serving.py's client) on one server, in one run, on the shared workload.

Started by benchmarks/aiperf.sh, which installs AIPerf into its own venv and passes its `aiperf` binary. One
`deepinfer serve --openai-port` server (the serving benchmark's engine settings); for each concurrency level the
gRPC closed loop of benchmarks/serving.py (its own process at nice 10) and then `aiperf profile` on
/v1/chat/completions (streaming, the same 32 chat prompts, 128 new tokens, greedy, EOS ignored, token counts from
the server's usage; AIPerf still loads a tokenizer: the bundled model's, saved as a Hugging Face directory).
Writes benchmarks/results/openai.md and openai.png.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import serving  # noqa: E402  (benchmarks/serving.py: the gRPC client and the workload loader)

from backend_lib.core.processes import free_port  # noqa: E402
from backend_lib.frontend.triton.server import TritonServer  # noqa: E402
from benchmarks.workload import WORKLOAD_FILE  # noqa: E402


@dataclass
class Row:
    path: str  # "gRPC" or "OpenAI (AIPerf)"
    concurrency: int
    requests: int
    tok_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    itl_p50_ms: float


def export_tokenizer(directory: Path) -> Path:
    """The bundled model's tokenizer as a Hugging Face directory: AIPerf loads one even when the server counts the
    tokens, and this machine cannot download any (AIPerf's "builtin" tokenizer downloads its encoding)."""
    from backend_lib.engine.tokenizer import Tokenizer
    from backend_lib.core.model_path import default_model_path

    Tokenizer.load(default_model_path()).save_pretrained(str(directory))
    return directory


def write_dataset(prompts: list, new_tokens: int, path: Path) -> Path:
    """AIPerf's single_turn JSONL: the workload's single user message and its output length per line."""
    lines = []
    for messages in prompts:
        if len(messages) != 1 or messages[0]["role"] != "user":
            raise ValueError(f"the workload's prompts must be one user message each, got {messages!r}")
        lines.append(json.dumps({"text": messages[0]["content"], "output_length": new_tokens}))
    path.write_text("\n".join(lines) + "\n")
    return path


def aiperf_level(aiperf: str, url: str, tokenizer: Path, dataset: Path, concurrency: int, requests: int,
                 out: Path, client_nice: int) -> Row:
    # At the gRPC client's priority: both load generators take the engine's idle cycles, not its running ones.
    command = ["nice", "-n", str(client_nice), aiperf, "profile", "--model", "deepinfer", "--tokenizer", str(tokenizer),
               "--url", url,
               "--endpoint-type", "chat", "--streaming", "--input-file", str(dataset),
               "--custom-dataset-type", "single_turn", "--concurrency", str(concurrency),
               "--request-count", str(requests), "--warmup-request-count", "1", "--use-server-token-count",
               "--extra-inputs", "ignore_eos:true",
               "--extra-inputs", "temperature:0", "--ui-type", "none", "--artifact-dir", str(out)]
    subprocess.run(command, check=True)
    exports = sorted(out.rglob("profile_export_aiperf.json"))
    if not exports:
        raise RuntimeError(f"AIPerf wrote no profile_export_aiperf.json under {out}")
    data = json.loads(exports[-1].read_text())
    metrics = data.get("records", data)

    def stat(name: str, field: str) -> float:
        if name not in metrics or field not in metrics[name]:
            raise KeyError(f"AIPerf's export has no {name}.{field} (keys: {sorted(metrics)[:20]})")
        return float(metrics[name][field])

    return Row("OpenAI (AIPerf)", concurrency, int(stat("request_count", "avg")),
               stat("output_token_throughput", "avg"), stat("time_to_first_token", "p50"),
               stat("time_to_first_token", "p99"), stat("inter_token_latency", "p50"))


def grpc_level(grpc_url: str, prompts: list, new_tokens: int, concurrency: int, client_nice: int) -> Row:
    pool = multiprocessing.get_context("spawn").Pool(1, initializer=os.nice, initargs=(client_nice,))
    try:
        level = pool.apply(serving.run_level, (grpc_url, prompts, new_tokens, concurrency))
    finally:
        pool.terminate()
    return Row("gRPC", concurrency, len(level.samples), level.tok_s, 1e3 * level.pct("ttft", 50),
               1e3 * level.pct("ttft", 99), 1e3 * level.pct("tpot", 50))


def write_results(rows: list[Row], new_tokens: int, out_dir: Path, load: tuple[float, float]) -> str:
    lines = ["# OpenAI front (AIPerf) vs gRPC, one server, one run", "",
             f"Shared workload (benchmarks/workload.py): chat prompts, {new_tokens} new tokens, greedy, EOS "
             f"ignored; SmolLM2-135M fp32, {os.cpu_count()} cores shared by the server, its OpenAI front and the "
             f"load generators. gRPC: benchmarks/serving.py's closed loop (raw gRPC, nice 10). OpenAI: `aiperf "
             f"profile` on /v1/chat/completions, streaming, server token counts. 1-min load average {load[0]:.1f} "
             f"before, {load[1]:.1f} after (numbers are not valid when other work shares the machine).", "",
             "| path | concurrency | requests | output tok/s | TTFT p50 (ms) | TTFT p99 (ms) | ITL p50 (ms) | "
             "OpenAI / gRPC tok/s |", "|---|---|---|---|---|---|---|---|"]
    grpc = {r.concurrency: r for r in rows if r.path == "gRPC"}
    for r in rows:
        ratio = f"{r.tok_s / grpc[r.concurrency].tok_s:.2f}" if r.path != "gRPC" and r.concurrency in grpc else ""
        lines.append(f"| {r.path} | {r.concurrency} | {r.requests} | {r.tok_s:.1f} | {r.ttft_p50_ms:.0f} | "
                     f"{r.ttft_p99_ms:.0f} | {r.itl_p50_ms:.1f} | {ratio} |")
    text = "\n".join(lines) + "\n"
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "openai.md").write_text(text)

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for path in ("gRPC", "OpenAI (AIPerf)"):
        group = [r for r in rows if r.path == path]
        xs = [r.concurrency for r in group]
        ax1.plot(xs, [r.tok_s for r in group], marker="o", label=path)
        ax2.plot(xs, [r.ttft_p50_ms for r in group], marker="o", label=f"TTFT p50, {path}")
        ax2.plot(xs, [r.itl_p50_ms for r in group], marker="s", label=f"ITL p50, {path}")
    ax1.set(xlabel="concurrency", ylabel="output tokens/s", title="Throughput", xscale="log")
    ax2.set(xlabel="concurrency", ylabel="ms", title="Latency", xscale="log")
    ax1.legend()
    ax2.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(out_dir / "openai.png", dpi=100)
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--aiperf", required=True, help="the aiperf binary (its own venv)")
    parser.add_argument("--concurrency", default="1,8,32")
    parser.add_argument("--requests-per-stream", type=int, default=2)
    parser.add_argument("--workload", type=Path, default=WORKLOAD_FILE)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--work", type=Path, default=Path("/tmp/deepinfer-aiperf"))
    parser.add_argument("--client-nice", type=int, default=10)
    args = parser.parse_args(argv)

    load_before = os.getloadavg()[0]
    prompts, new_tokens = serving.load_workload(args.workload)
    args.work.mkdir(parents=True, exist_ok=True)
    dataset = write_dataset(prompts, new_tokens, args.work / "workload.jsonl")
    tokenizer = export_tokenizer(args.work / "tokenizer")
    server = TritonServer(http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(),
                          openai_port=free_port(), overrides={k: str(v) for k, v in serving.ENGINE_SETTINGS.items()})
    rows = []
    server.start()
    try:
        serving.warm_up(server.grpc_url, prompts[0])
        for c in (int(x) for x in args.concurrency.split(",")):
            n = min(len(prompts), c * args.requests_per_stream)
            rows.append(grpc_level(server.grpc_url, prompts[:n], new_tokens, c, args.client_nice))
            rows.append(aiperf_level(args.aiperf, f"localhost:{server.openai_port}", tokenizer, dataset, c, n,
                                     args.work / f"aiperf-c{c}", args.client_nice))
            print(f"concurrency {c}: gRPC {rows[-2].tok_s:.1f} tok/s, OpenAI {rows[-1].tok_s:.1f} tok/s", flush=True)
    finally:
        server.stop()
    print(write_results(rows, new_tokens, args.out, (load_before, os.getloadavg()[0])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
