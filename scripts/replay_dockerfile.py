"""Replays the Dockerfile's steps that can run without Docker (``make replay-docker``), TARGET=cpu, in a scratch venv:
the pip installs, the C++ kernel build, and ``deepinfer serve --help`` in place of the CMD.

It reads the Dockerfile itself, so an edit there is what runs here: ARG defaults and ENV values become the
environment, WORKDIR / COPY / ENV paths of the image (/opt/deepinfer, /models, /tmp/requirements.txt) land under the
scratch directory, ``python3`` is the scratch venv's. What it cannot replay it says it skipped: the base image (its
Python and Triton), RUN steps with apt-get (root on the image's Ubuntu; the compiler they install must be on this
machine), and pip's ``--index-url`` to download.pytorch.org (this machine reaches PyPI, whose torch the Makefile
installs too). Takes minutes: the torch install and a kernel build from scratch (TORCH_EXTENSIONS_DIR is the
image's, under the scratch directory).

    python scripts/replay_dockerfile.py [--keep] [--scratch DIR] [--reuse-kernel-cache]

``--reuse-kernel-cache`` leaves TORCH_EXTENSIONS_DIR as this machine has it, so the kernel step finds the libraries
a ``make install`` built (the same names: they follow the sources, not the checkout) instead of compiling again.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
IMAGE_PATHS = ("/opt/deepinfer", "/models", "/tmp/requirements.txt")  # the image's paths this replay relocates
TORCH_INDEX = re.compile(r"--index-url\s+https://download\.pytorch\.org/whl/cpu\s+")


@dataclass(frozen=True)
class Instruction:
    keyword: str  # FROM, ARG, ENV, RUN, ...
    text: str  # the rest, continuation lines joined


def instructions(dockerfile: Path) -> list[Instruction]:
    """The Dockerfile's instructions, comments and blank lines dropped, ``\\`` continuations joined."""
    out, pending = [], ""
    for line in dockerfile.read_text().splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.endswith("\\"):  # Docker drops the backslash and the newline: a redirect on the next line still applies
            pending += line[:-1]
            continue
        whole = (pending + line).strip()
        pending = ""
        keyword, _, rest = whole.partition(" ")
        out.append(Instruction(keyword.upper(), rest.strip()))
    return out


class Replay:
    def __init__(self, scratch: Path, reuse_kernel_cache: bool) -> None:
        self.scratch = scratch
        self.reuse_kernel_cache = reuse_kernel_cache
        self.venv = scratch / "venv"
        self.env = {**os.environ, "TARGET": "cpu"}
        self.env.pop("VIRTUAL_ENV", None)
        self.env["PATH"] = f"{self.venv / 'bin'}{os.pathsep}{os.environ['PATH']}"
        self.workdir = scratch

    def relocate(self, text: str) -> str:
        for path in IMAGE_PATHS:
            text = text.replace(path, f"{self.scratch}{path}")
        return text

    def expand(self, value: str) -> str:
        return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: self.env.get(m[1] or m[2], ""), value)

    def run_step(self, inst: Instruction) -> None:
        if inst.keyword == "FROM":
            print(f"skipped FROM {inst.text} (the base image): this machine's python3 makes the venv", flush=True)
            subprocess.run([sys.executable, "-m", "venv", str(self.venv)], check=True)
        elif inst.keyword == "ARG":
            name, _, default = inst.text.partition("=")
            if name != "TARGET":  # TARGET=cpu, the one image this machine can replay
                self.env.setdefault(name, default)
        elif inst.keyword == "ENV":
            for name, value in re.findall(r"(\w+)=(\S+)", inst.text):
                if name == "TORCH_EXTENSIONS_DIR" and self.reuse_kernel_cache:
                    print(f"kept this machine's TORCH_EXTENSIONS_DIR (not the image's {value})", flush=True)
                    continue
                self.env[name] = self.relocate(self.expand(value))
            self.env["PATH"] = f"{self.venv / 'bin'}{os.pathsep}{self.env['PATH']}"
        elif inst.keyword == "WORKDIR":
            self.workdir = Path(self.relocate(inst.text))
            self.workdir.mkdir(parents=True, exist_ok=True)
        elif inst.keyword == "COPY":
            *sources, target = inst.text.split()
            destination = Path(self.relocate(target)) if target.startswith("/") else self.workdir / target
            for source in sources:
                path = ROOT / source
                if path.is_dir():
                    shutil.copytree(path, destination if len(sources) == 1 else destination / source,
                                    dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__"))
                else:
                    destination.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(path, destination / path.name)
        elif inst.keyword == "RUN":
            self.run_shell(inst.text)
        elif inst.keyword == "CMD":
            self.run_shell("deepinfer serve --help > /dev/null && echo 'deepinfer serve --help: ok'")
        else:
            print(f"skipped {inst.keyword} {inst.text[:60]}", flush=True)

    def run_shell(self, script: str) -> None:
        if "apt-get" in script:
            print("skipped a RUN with apt-get (root on the image's Ubuntu): " + script.split("\n")[0][:80], flush=True)
            return
        script = TORCH_INDEX.sub("", self.relocate(script))
        print(f"RUN {script[:100]} ...", flush=True)
        started = time.perf_counter()
        subprocess.run(["bash", "-o", "pipefail", "-c", script], cwd=self.workdir, env=self.env, check=True)
        print(f"    ok ({time.perf_counter() - started:.0f} s)", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scratch", type=Path, help="scratch directory (default: a new temporary one)")
    parser.add_argument("--keep", action="store_true", help="leave the scratch directory for a look")
    parser.add_argument("--reuse-kernel-cache", action="store_true",
                        help="find the C++ kernels this machine built instead of building them in the scratch")
    args = parser.parse_args()
    scratch = args.scratch or Path(tempfile.mkdtemp(prefix="deepinfer-replay-"))
    started = time.perf_counter()
    try:
        replay = Replay(scratch.resolve(), args.reuse_kernel_cache)
        (scratch / "tmp").mkdir(parents=True, exist_ok=True)  # the image's /tmp, relocated with its files
        for inst in instructions(ROOT / "Dockerfile"):
            replay.run_step(inst)
    except subprocess.CalledProcessError as exc:
        print(f"replay failed: {exc}", file=sys.stderr)
        return 1
    finally:
        if not args.keep:
            shutil.rmtree(scratch, ignore_errors=True)
    print(f"Dockerfile replayed (TARGET=cpu) in {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
