"""``deepinfer lint-graphs``: every compiled region of the tiny models checked, one line a region (and a rank)."""
from __future__ import annotations

import argparse
import sys

from backend_lib.tools.lint.ranks import lint_with_ranks
from backend_lib.tools.lint.regions import lint_all_regions


ARCHS = ("llama", "llama_fp8", "deepseek_v3", "deepseek_v3_fp8", "deepseek_v4", "deepseek_v4_fp8")


def _archs(value: str) -> list[str]:
    archs = list(ARCHS) if value == "all" else value.split(",")
    unknown = [a for a in archs if a not in ARCHS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown arch {unknown[0]!r}: 'all' or a comma-separated list of "
                                         f"{', '.join(ARCHS)}")
    return archs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="deepinfer lint-graphs",
                                     description="Lint every compiled region of a tiny Llama, a tiny "
                                                 "DeepSeek-V3 and a tiny DeepSeek-V4 (each also with an fp8 KV cache) "
                                                 "for what neuronx-cc rejects or runs slowly.")
    parser.add_argument("--arch", default="all", type=_archs,
                        help=f"'all' or a comma-separated list of {', '.join(ARCHS)}")
    parser.add_argument("--tensor-parallel-size", type=int, default=1,
                        help="lint each rank's shard with the collectives in its graphs (gloo ranks on this host)")
    args = parser.parse_args(argv)
    archs = args.arch
    if args.tensor_parallel_size > 1:
        results = [(f"rank {r.rank}: {r.region}", r.error)
                   for r in lint_with_ranks(archs, args.tensor_parallel_size)]
    else:
        results = lint_all_regions(archs)
    failures = 0
    for region, error in results:
        status = "ok" if error is None else "FAIL"
        print(f"{status:4} {region}")
        if error is not None:
            failures += 1
            print(f"     {error}")
    print(f"{failures} region(s) failed" if failures else "all regions pass")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
