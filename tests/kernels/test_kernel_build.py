"""The C++ host kernels' build at install (kernels/build.py, kernels/extension_build.py): a library's name follows
every input, a built one loads without compiler or ninja, and a machine without a compiler is told what is missing."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from kernels.cpu_kernels import CPU_KERNELS, PACKED_KERNELS, load_cpu_kernels, load_packed_kernels
from kernels.extension_build import ExtensionSpec, library_path

ROOT = Path(__file__).resolve().parents[2]


def test_a_source_edit_names_another_library(tmp_path):
    source, header = tmp_path / "op.cpp", tmp_path / "op.h"
    source.write_text("int f() { return 1; }\n")
    header.write_text("#pragma once\n")
    spec = ExtensionSpec("deepinfer_test", (source,), (header,))
    first = spec.name
    header.write_text("#pragma once\n// edited\n")
    assert spec.name != first
    assert spec.name.startswith("deepinfer_test_")


def test_built_libraries_load_without_compiler_or_ninja():
    assert load_cpu_kernels() and load_packed_kernels()  # builds here if the install did not
    assert library_path(CPU_KERNELS).is_file() and library_path(PACKED_KERNELS).is_file()
    env = {**os.environ, "PATH": "/nonexistent", "CXX": "/nonexistent/c++"}
    code = ("from kernels.cpu_kernels import load_cpu_kernels, load_packed_kernels; import torch; "
            "assert load_cpu_kernels() and load_packed_kernels(); "
            "assert hasattr(torch.ops.deepinfer, 'packed_linear') and hasattr(torch.ops.deepinfer, 'row_argmax')")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]


def test_build_without_a_compiler_names_what_is_missing(tmp_path):
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path), "CXX": "/nonexistent/c++"}
    done = subprocess.run([sys.executable, "-m", "kernels.build"], env=env, capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
    assert done.returncode == 1
    assert "cannot build the C++ host kernels" in done.stderr and "'/nonexistent/c++' is not on PATH" in done.stderr
    assert not any(tmp_path.rglob("*.so"))
