"""``python -m kernels.build``: builds the C++ host kernels once, at install (``make install``, the Dockerfile), so that
the engine's first start loads them without a compiler (kernels/extension_build.py says where they go and why).

Exits 1 naming what is missing (a C++ compiler, ninja) or with the compiler's error; a second run finds the
libraries and only loads them (about a second).
"""
from __future__ import annotations

import argparse
import sys
import time

from kernels.cpu_kernels import EXTENSIONS
from kernels.extension_build import library_path, load_extension, missing_build_tools


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kernels.build", description=__doc__.split("\n\n")[0])
    parser.parse_args(argv)
    pending = [spec for spec in EXTENSIONS if not library_path(spec).is_file()]
    missing = missing_build_tools() if pending else []
    if missing:
        print("deepinfer: cannot build the C++ host kernels (kernels/csrc): missing " + "; ".join(missing),
              file=sys.stderr)
        return 1
    for spec in EXTENSIONS:
        started = time.perf_counter()
        try:
            path = load_extension(spec)
        except Exception as exc:  # the compiler's own message is the useful part
            print(f"deepinfer: building {spec.name} failed: {exc}", file=sys.stderr)
            return 1
        verb = "built" if spec in pending else "found"
        print(f"deepinfer: {verb} {path} ({time.perf_counter() - started:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
