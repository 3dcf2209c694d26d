"""Host paged decode attention (deepinfer::cpu_paged_decode_attention) at SmolLM2-135M's head layout.

9 query heads, 3 KV heads, head_dim 64, block_size 16; batch 1, 8, 32 x contexts 128, 512, 2048, plus the engine's
case (batch 32, contexts 100-150 at random); fp32 and bf16; each request's blocks adjacent in the pool or scattered
at random. The pool is ``--pool-mib`` per cache and every timed sweep walks calls whose tables cover it, so the
KV rows come from DRAM as they do in a decode step (30 layers' caches between two reads of one layer), except
where the configuration is so small that the sweep's call cap leaves it cache-resident.

``--baseline REV``: also builds the kernel of git revision REV (its paged_decode_attention.cpp and headers, under
the op namespace deepinfer_base) and times both, alternating rep by rep so a shared machine's load hits both
alike; a rep's time is its median call, and the best rep counts. Writes benchmarks/results/decode_attention.md.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.machine import describe  # noqa: E402
from kernels.cpu_kernels import _ISA_FLAGS, load_cpu_kernels  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
BATCHES, CONTEXTS = (1, 8, 32), (128, 512, 2048)
ENGINE = (32, "100-150")
MAX_CALLS = 64  # per timed sweep: small configurations stay cheap (and cache-resident)


def build_baseline(rev: str) -> None:
    """The kernel as of ``rev``, registered as torch.ops.deepinfer_base.cpu_paged_decode_attention."""
    from torch.utils import cpp_extension

    work = Path(tempfile.mkdtemp(prefix="decode_attention_base_"))
    csrc = "kernels/csrc"
    names = subprocess.run(["git", "-C", str(ROOT), "ls-tree", "--name-only", f"{rev}:{csrc}"], check=True,
                           capture_output=True, text=True).stdout.split()
    for name in [n for n in names if n.endswith(".h")] + ["paged_decode_attention.cpp"]:
        text = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:{csrc}/{name}"], check=True,
                              capture_output=True, text=True).stdout
        if name.endswith(".cpp"):
            text = text.replace("TORCH_LIBRARY_FRAGMENT(deepinfer,", "TORCH_LIBRARY_FRAGMENT(deepinfer_base,")
            text = text.replace("TORCH_LIBRARY_IMPL(deepinfer,", "TORCH_LIBRARY_IMPL(deepinfer_base,")
        (work / name).write_text(text)
    flags = _ISA_FLAGS.get(torch.backends.cpu.get_cpu_capability(), [])
    cpp_extension.load(name=f"deepinfer_base_attention_{rev.replace('/', '_')}",
                       sources=[str(work / "paged_decode_attention.cpp")], is_python_module=False, verbose=False,
                       build_directory=str(work), extra_cflags=["-O3", "-fopenmp", *flags],
                       extra_ldflags=["-fopenmp"])


def tables_for(batch: int, lens: list[int], pool_blocks: int, scattered: bool, gen: torch.Generator,
               calls: int) -> list[torch.Tensor]:
    width = -(-max(lens) // BLOCK)
    out = []
    for c in range(calls):
        if scattered:
            ids = torch.randperm(pool_blocks, generator=gen)[: batch * width].view(batch, width)
        else:  # request b's blocks consecutive, the calls walking the pool
            start = (c * batch * width) % max(pool_blocks - batch * width + 1, 1)
            ids = torch.arange(start, start + batch * width).view(batch, width)
        out.append(ids.to(torch.int32))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", help="git revision whose kernel to time alongside")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--pool-mib", type=int, default=512)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "decode_attention.md"))
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    assert load_cpu_kernels(), "the C++ host kernels did not build"
    ops = {"new": torch.ops.deepinfer.cpu_paged_decode_attention}
    if args.baseline:
        build_baseline(args.baseline)
        ops = {"base": torch.ops.deepinfer_base.cpu_paged_decode_attention, **ops}
    machine = describe().line()
    print(machine, flush=True)
    gen = torch.Generator().manual_seed(0)
    pool_blocks = args.pool_mib * 2 ** 20 // (BLOCK * KV_HEADS * HEAD_DIM * 4)
    k_pool = torch.randn(pool_blocks * BLOCK, KV_HEADS, HEAD_DIM, generator=gen)
    v_pool = torch.randn(pool_blocks * BLOCK, KV_HEADS, HEAD_DIM, generator=gen)
    configs = [(b, c) for b in BATCHES for c in CONTEXTS] + [ENGINE]
    header = f"| dtype | blocks | batch | context | {' | '.join(f'{n} us' for n in ops)} |" + (
        " speedup |" if len(ops) == 2 else "")
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    print(header, flush=True)
    for dtype in [getattr(torch, d) for d in args.dtypes.split(",")]:
        k_cache, v_cache = k_pool.to(dtype), v_pool.to(dtype)
        for scattered in (False, True):
            for batch, context in configs:
                if isinstance(context, str):
                    low, high = map(int, context.split("-"))
                    lens = torch.randint(low, high + 1, (batch,), generator=gen).tolist()
                else:
                    lens = [context] * batch
                width = -(-max(lens) // BLOCK)
                calls = max(1, min(MAX_CALLS, pool_blocks // (batch * width)))
                tables = tables_for(batch, lens, pool_blocks, scattered, gen, calls)
                seq_lens = torch.tensor(lens, dtype=torch.int32)
                q = torch.randn(batch, HEADS, HEAD_DIM, generator=gen).to(dtype)
                best = {name: float("inf") for name in ops}
                for _ in range(args.reps):
                    for name, op in ops.items():  # alternating: load hits both alike
                        times = []
                        for table in tables:
                            start = time.perf_counter()
                            op(q, k_cache, v_cache, table, seq_lens, 1, BLOCK, HEAD_DIM ** -0.5)
                            times.append(time.perf_counter() - start)
                        # The median call of a sweep: on a shared machine one preempted thread stalls a whole call.
                        best[name] = min(best[name], sorted(times)[len(times) // 2])
                if len(ops) == 2:
                    want = ops["base"](q, k_cache, v_cache, tables[0], seq_lens, 1, BLOCK, HEAD_DIM ** -0.5)
                    got = ops["new"](q, k_cache, v_cache, tables[0], seq_lens, 1, BLOCK, HEAD_DIM ** -0.5)
                    assert (got.float() - want.float()).abs().max().item() <= (1e-5 if dtype == torch.float32
                                                                                else 1e-2)
                row = (f"| {str(dtype).removeprefix('torch.')} | {'scattered' if scattered else 'adjacent'} | "
                       f"{batch} | {context} | " + " | ".join(f"{best[n] * 1e6:.0f}" for n in ops) + " |")
                if len(ops) == 2:
                    row += f" {best['base'] / best['new']:.2f}x |"
                lines.append(row)
                print(row, flush=True)
    load = " ".join(f"{x:.2f}" for x in __import__("os").getloadavg())
    text = (f"# Host paged decode attention, SmolLM2-135M heads\n\n{machine}; load average {load} at the end; "
            f"{args.reps} reps, best rep's median call; pool {args.pool_mib} MiB per cache"
            + (f"; base = {args.baseline}" if args.baseline else "") + "\n\n" + "\n".join(lines) + "\n")
    Path(args.out).write_text(text)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
