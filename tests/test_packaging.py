"""Packaging invariants that other tools depend on, and what a non-editable install (the Dockerfile's
`pip install .`) ships: every file the C++ host kernels build from."""
from __future__ import annotations

import ast
import re
from fnmatch import fnmatch
from pathlib import Path

from kernels.cpu_kernels import _SOURCES

ROOT = Path(__file__).resolve().parents[1]
CSRC = ROOT / "kernels" / "csrc"


def test_our_kernels_package_does_not_look_like_hf_kernels():
    # transformers probes for Hugging Face's kernel-hub library under the same import name `kernels`;
    # if the probe says yes, transformers tries to use it and the oracle runs break.
    import kernels  # noqa: F401  (ours is importable ...)
    from transformers.utils.import_utils import is_kernels_available
    assert not is_kernels_available()  # (... but is not mistaken for the hub library)


def test_package_data_ships_every_kernel_source_and_header():
    # A regex, not tomllib: the project supports Python 3.10, which has no tomllib.
    section = (ROOT / "pyproject.toml").read_text().split("[tool.setuptools.package-data]", 1)[1]
    patterns = ast.literal_eval(re.search(r"^kernels = (\[[^\]]*\])", section, re.M).group(1))
    files = [path.relative_to(ROOT / "kernels").as_posix() for path in CSRC.iterdir() if path.is_file()]
    missing = [name for name in files if not any(fnmatch(name, pattern) for pattern in patterns)]
    assert any(name.endswith(".h") for name in files) and not missing, missing


def test_every_kernel_source_is_built():
    assert set(_SOURCES) == {path.name for path in CSRC.glob("*.cpp")}
