"""Serving benchmark: the shared workload through a real tritonserver, gRPC streaming, closed loop.

For each concurrency C, C client workers each send their next prompt as soon as their previous request
finished (like perf_analyzer --concurrency-range C). Per request: time to first token (first streamed
response), time per output token after it, end-to-end latency (p50 / p90 / p99). Per level: output tokens/s,
next to the offline engine (backend_lib.engine.offline.LLM, max_num_seqs = C, the server's other engine settings) on
the SAME prompts, in alternating rounds (offline, Triton, offline, ...) so both see similar machine load, tok/s
over all rounds; the ratio Triton / offline is the serving overhead (target: >= 0.85 at concurrency 16).
The load generator runs in its own process at a lower CPU priority (--client-nice, default 10): on a machine
whose cores the server uses, it then takes idle cycles instead of preempting the engine's OpenMP workers, as a
client on another machine would (0 measures a client that competes with the server on equal terms). It drives
every stream from one asyncio event loop on the raw KServe gRPC protocol and names the two outputs it reads
(text_output, num_output_tokens): half the CPU per response of tritonclient's thread-per-stream client, CPU
that a client on the server's own cores takes from the engine.
Starts its own server (bundled SmolLM2, fp32) unless --url points at one. Writes
benchmarks/results/serving.md and serving.png.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import multiprocessing
import os
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from backend_lib.core.processes import free_port  # noqa: E402
from backend_lib.frontend.triton.server import TritonServer  # noqa: E402
from benchmarks.workload import FLOAT_WEIGHTS, WORKLOAD_FILE  # noqa: E402

MODEL = "deepinfer"
# The server's engine settings; the offline runs use the same, with max_num_seqs = the level's concurrency.
ENGINE_SETTINGS = {"max_num_seqs": 32, "max_model_len": 1024}


@dataclass
class Sample:
    ttft: float
    tpot: float | None
    e2e: float
    tokens: int


@dataclass
class Offline:
    """The offline engine on a level's prompts: all submitted at once, max_num_seqs = concurrency."""

    tokens: int
    seconds: float

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds


@dataclass
class Level:
    concurrency: int
    samples: list[Sample]
    seconds: float
    offline: Offline | None = None
    stream_interval: int = 1

    @property
    def tokens(self) -> int:
        return sum(s.tokens for s in self.samples)

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds

    @property
    def ratio(self) -> float:
        return self.tok_s / self.offline.tok_s if self.offline else float("nan")

    def pct(self, attr: str, q: float) -> float:
        values = [getattr(s, attr) for s in self.samples if getattr(s, attr) is not None]
        return float(np.percentile(values, q)) if values else float("nan")


def run_offline(prompts: list, new_tokens: int, concurrency: int, settings: dict[str, int]) -> Offline:
    """Same prompts, sampling and engine settings through backend_lib.engine.offline.LLM in this process.

    Model load and a short warm-up are not timed (the server is warmed up the same way)."""
    import gc

    from backend_lib.core.sampling_params import SamplingParams
    from backend_lib.engine.offline import LLM

    llm = LLM("", **{**settings, **FLOAT_WEIGHTS, "max_num_seqs": concurrency})
    llm.generate(prompts[:1], SamplingParams(max_tokens=4, temperature=0.0))
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    results = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    errors = [r.error for r in results if r.error]
    if errors:
        raise RuntimeError(f"offline concurrency {concurrency}: {len(errors)} request(s) failed: {errors[0]}")
    del llm
    gc.collect()  # its KV cache goes before the next level's engine is built
    return Offline(tokens=sum(len(r.token_ids) for r in results), seconds=seconds)


def load_workload(path: Path):
    spec = importlib.util.spec_from_file_location("workload", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.prompts(), module.NEW_TOKENS


def _request(request_id: str, messages: list[dict], new_tokens: int):
    """A ModelInferRequest on the KServe gRPC protocol, naming the two outputs a streaming client reads."""
    from tritonclient.grpc import service_pb2

    params = {"max_tokens": new_tokens, "temperature": 0, "ignore_eos": True}
    request = service_pb2.ModelInferRequest(model_name=MODEL, id=request_id)
    for name, value in (("messages", json.dumps(messages)), ("sampling_parameters", json.dumps(params))):
        request.inputs.add(name=name, datatype="BYTES", shape=[1]).contents.bytes_contents.append(value.encode())
    for name in ("stream", "return_num_output_tokens"):
        request.inputs.add(name=name, datatype="BOOL", shape=[1]).contents.bool_contents.append(True)
    for name in ("text_output", "num_output_tokens"):
        request.outputs.add(name=name)
    request.parameters["triton_enable_empty_final_response"].bool_param = True
    return request


async def _stream_request(call, request) -> Sample:
    """Sends one request on an open ModelStreamInfer stream and reads its responses up to the final one."""
    import grpc

    start = time.perf_counter()
    await call.write(request)
    first, tokens = None, 0
    while True:
        response = await call.read()
        at = time.perf_counter()
        if response is grpc.aio.EOF:
            raise RuntimeError(f"request {request.id}: the server closed the stream")
        if response.error_message:
            raise RuntimeError(f"request {request.id} failed: {response.error_message}")
        result = response.infer_response
        for index, output in enumerate(result.outputs):
            if output.name == "num_output_tokens":
                tokens += int.from_bytes(result.raw_output_contents[index], "little")
                if first is None and tokens:
                    first = at
        if result.parameters["triton_final_response"].bool_param:
            end = at
            break
    tpot = (end - first) / (tokens - 1) if first is not None and tokens > 1 else None
    return Sample(ttft=(first or end) - start, tpot=tpot, e2e=end - start, tokens=tokens)


async def _closed_loop(url: str, prompts: list, new_tokens: int, concurrency: int) -> Level:
    """``concurrency`` streams on one channel, each sending its next prompt when the previous one finished (as
    perf_analyzer's workers do). One event loop drives them all: on a machine it shares with the server, the
    load generator's per-response cost is CPU the engine loses, so it is kept to the protocol's minimum."""
    import asyncio

    import grpc
    from tritonclient.grpc import service_pb2_grpc

    work = list(enumerate(prompts))[::-1]
    async with grpc.aio.insecure_channel(url) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)

        async def stream() -> list[Sample]:
            call = stub.ModelStreamInfer()
            samples = []
            while work:
                index, messages = work.pop()
                samples.append(await _stream_request(call, _request(str(index), messages, new_tokens)))
            await call.done_writing()
            return samples

        start = time.perf_counter()
        per_stream = await asyncio.gather(*(stream() for _ in range(concurrency)))
        seconds = time.perf_counter() - start
    return Level(concurrency, [s for samples in per_stream for s in samples], seconds)


def run_level(url: str, prompts: list, new_tokens: int, concurrency: int) -> Level:
    import asyncio

    return asyncio.run(_closed_loop(url, prompts, new_tokens, concurrency))


def warm_up(url: str, messages: list[dict]) -> None:
    run_level(url, [messages], 4, 1)


def write_results(levels: list[Level], new_tokens: int, out_dir: Path, load: tuple[float, float],
                  num_threads: int, client_nice: int) -> str:
    import torch

    lines = ["# Serving: shared workload through tritonserver (gRPC streaming, closed loop)", "",
             f"Chat prompts from benchmarks/workload.py, {new_tokens} new tokens each, greedy, EOS ignored, "
             f"fp32, SmolLM2-135M-Instruct (bundled GGUF), one Triton model instance (the engine batches). "
             f"Machine: {platform.machine()}, {os.cpu_count()} cores shared with the client (its own process at "
             f"nice {client_nice}: one asyncio loop on raw gRPC, naming the outputs text_output and "
             f"num_output_tokens), torch {torch.__version__}, "
             f"{num_threads or 'all'} engine threads; "
             f"1-min load average {load[0]:.1f} before, {load[1]:.1f} after (other work on the machine skews "
             f"the numbers when it exceeds the core count).", "",
             "Offline: backend_lib.engine.offline.LLM on the same prompts with the same engine settings and max_num_seqs = "
             "concurrency, all prompts submitted at once (the engine keeps at most that many running), in rounds "
             "alternating with the Triton runs (tok/s over all rounds); ratio = Triton tok/s / offline tok/s. With 2 "
             "requests per stream and round, p99 is "
             "close to the maximum.", "",
             "stream_interval: tokens per streamed response after the first (config.pbtxt; 1 = every token).", "",
             "| stream_interval | concurrency | requests | Triton tok/s | offline tok/s | ratio | TTFT p50 (ms) | "
             "TTFT p90 (ms) | TTFT p99 (ms) | TPOT p50 (ms) | TPOT p90 (ms) | TPOT p99 (ms) | e2e p50 (s) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for lv in levels:
        offline = f"{lv.offline.tok_s:.1f} | {lv.ratio:.2f}" if lv.offline else "- | -"
        lines.append(f"| {lv.stream_interval} | {lv.concurrency} | {len(lv.samples)} | {lv.tok_s:.1f} | {offline} | "
                     f"{1e3 * lv.pct('ttft', 50):.0f} | {1e3 * lv.pct('ttft', 90):.0f} | "
                     f"{1e3 * lv.pct('ttft', 99):.0f} | {1e3 * lv.pct('tpot', 50):.1f} | "
                     f"{1e3 * lv.pct('tpot', 90):.1f} | {1e3 * lv.pct('tpot', 99):.1f} | {lv.pct('e2e', 50):.2f} |")
    text = "\n".join(lines) + "\n"
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "serving.md").write_text(text)

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for interval in sorted({lv.stream_interval for lv in levels}):
        group = [lv for lv in levels if lv.stream_interval == interval]
        xs = [lv.concurrency for lv in group]
        ax1.plot(xs, [lv.tok_s for lv in group], marker="o", label=f"Triton, stream_interval {interval}")
        ax2.plot(xs, [1e3 * lv.pct("ttft", 50) for lv in group], marker="o", label=f"TTFT p50, interval {interval}")
        ax2.plot(xs, [1e3 * lv.pct("tpot", 50) for lv in group], marker="s", label=f"TPOT p50, interval {interval}")
    offline = {lv.concurrency: lv.offline.tok_s for lv in levels if lv.offline}
    if offline:
        ax1.plot(list(offline), list(offline.values()), marker="s", linestyle="--", label="offline engine")
    ax1.legend()
    ax1.set(xlabel="concurrency", ylabel="output tokens/s", title="Throughput", xscale="log")
    ax2.set(xlabel="concurrency", ylabel="ms", title="Latency", xscale="log")
    ax2.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(out_dir / "serving.png", dpi=100)
    return text


def run_levels(url: str | None, stream_interval: int, args: argparse.Namespace, prompts: list, new_tokens: int,
               settings: dict[str, int]) -> list[Level]:
    """Every concurrency level against one server (started here unless ``url`` is given)."""
    server = None
    if url is None:
        overrides = {**{k: str(v) for k, v in settings.items()}, "stream_interval": str(stream_interval)}
        server = TritonServer(http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(),
                              overrides=overrides)
        server.start()
        url = server.grpc_url
    levels = []
    # The client's own process, at its own priority (spawned: no copy of this process's torch threads).
    client = multiprocessing.get_context("spawn").Pool(1, initializer=os.nice, initargs=(args.client_nice,))
    try:
        client.apply(warm_up, (url, prompts[0]))
        for c in (int(x) for x in args.concurrency.split(",")):
            n = min(len(prompts), c * args.requests_per_stream)
            # Offline first, while the server idles: the two never compete for the cores.
            level = Level(c, [], 0.0, Offline(0, 0.0) if args.offline else None, stream_interval)
            for _ in range(args.rounds):  # alternating rounds: a load change on the machine hits both sides
                if level.offline:
                    offline = run_offline(prompts[:n], new_tokens, c, settings)
                    level.offline.tokens += offline.tokens
                    level.offline.seconds += offline.seconds
                served = client.apply(run_level, (url, prompts[:n], new_tokens, c))
                level.samples += served.samples
                level.seconds += served.seconds
            offline = level.offline
            versus = f" (offline {offline.tok_s:.1f} tok/s, ratio {level.ratio:.2f})" if offline else ""
            print(f"stream_interval {stream_interval}, concurrency {c}: {len(level.samples)} requests, "
                  f"{level.tok_s:.1f} tok/s{versus}, "
                  f"TTFT p50/p99 {1e3 * level.pct('ttft', 50):.0f}/{1e3 * level.pct('ttft', 99):.0f} ms, "
                  f"TPOT p50/p99 {1e3 * level.pct('tpot', 50):.1f}/{1e3 * level.pct('tpot', 99):.1f} ms", flush=True)
            levels.append(level)
    finally:
        client.terminate()
        if server is not None:
            server.stop()
    return levels


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default=None, help="gRPC url of a running server (default: start one)")
    parser.add_argument("--concurrency", default="1,4,16,32")
    parser.add_argument("--requests-per-stream", type=int, default=2,
                        help="requests per level = concurrency x this, capped at the workload's 32 prompts")
    parser.add_argument("--new-tokens", type=int, default=None, help="default: the workload's")
    parser.add_argument("--workload", type=Path, default=WORKLOAD_FILE)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--num-threads", type=int, default=0,
                        help="torch threads of the server's and the offline engine (0 = all cores); 1 avoids "
                             "OpenMP stalls when other processes hold cores")
    parser.add_argument("--rounds", type=int, default=2,
                        help="alternating offline / Triton rounds per level; tok/s over all rounds")
    parser.add_argument("--stream-intervals", default="1",
                        help="the server's stream_interval values to run, each on its own server (e.g. 1,4)")
    parser.add_argument("--client-nice", type=int, default=10,
                        help="niceness of the load generator's process (0: it competes with the server on equal "
                             "terms for this machine's cores)")
    parser.add_argument("--offline", action=argparse.BooleanOptionalAction, default=True,
                        help="also run the offline engine on each level's prompts (default: on)")
    args = parser.parse_args(argv)

    load_before = os.getloadavg()[0]
    settings = {**ENGINE_SETTINGS, "num_threads": args.num_threads}
    prompts, new_tokens = load_workload(args.workload)
    new_tokens = args.new_tokens or new_tokens
    url = args.url
    if url is not None and args.offline:
        print(f"note: the offline runs use {settings} (max_num_seqs = concurrency); the server at {url} "
              "should have the same settings for the ratio to mean anything", file=sys.stderr)
    levels = []
    for interval in (int(x) for x in args.stream_intervals.split(",")):
        levels += run_levels(url, interval, args, prompts, new_tokens, settings)
    print(write_results(levels, new_tokens, args.out, (load_before, os.getloadavg()[0]), args.num_threads,
                        args.client_nice))
    return 0


if __name__ == "__main__":
    sys.exit(main())
