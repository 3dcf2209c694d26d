"""The environment is read in one module (backend_lib/core/envs.py), and each variable it reads is documented."""
import ast
import os
import re
from pathlib import Path

import pytest

from backend_lib.core import envs

ROOT = Path(__file__).resolve().parents[2]
ENV_MODULE = ROOT / "backend_lib" / "core" / "envs.py"
_OS_ENV_NAMES = {"environ", "environb", "getenv", "getenvb", "putenv", "unsetenv"}


def _env_accesses(path: Path) -> list[int]:
    """Lines of ``path`` that touch the process environment: ``os.environ`` / ``os.getenv`` / ... or an import of
    one of them from os."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if (isinstance(node, ast.Attribute) and node.attr in _OS_ENV_NAMES
                and isinstance(node.value, ast.Name) and node.value.id == "os"):
            lines.append(node.lineno)
        elif (isinstance(node, ast.ImportFrom) and node.module == "os"
              and any(alias.name in _OS_ENV_NAMES for alias in node.names)):
            lines.append(node.lineno)
    return lines


def test_only_the_env_module_reads_the_environment():
    offenders = [f"{path.relative_to(ROOT)}:{line}"
                 for folder in ("backend_lib", "kernels") for path in sorted((ROOT / folder).rglob("*.py"))
                 if path != ENV_MODULE for line in _env_accesses(path)]
    assert not offenders, f"read the environment through backend_lib/core/envs.py, not here: {offenders}"
    assert _env_accesses(ENV_MODULE), "the scan no longer recognises envs.py's own reads"


def test_every_variable_is_documented_in_configuration_md():
    text = (ROOT / "docs" / "CONFIGURATION.md").read_text()
    table = text[text.index("## Environment variables"):]
    first_cells = re.findall(r"^\| ([^|]+) \|", table, re.MULTILINE)
    documented = {name for cell in first_cells for name in re.findall(r"`([A-Z0-9_]+)`", cell)}
    missing = [var.name for var in envs.VARIABLES if var.name not in documented]
    assert not missing, f"docs/CONFIGURATION.md#environment-variables lacks {missing}"


def test_read_parses_each_kind_and_names_a_bad_value():
    assert envs.read("DEEPINFER_ENFORCE_EAGER", {"DEEPINFER_ENFORCE_EAGER": " yes "}) is True
    assert envs.read("DEEPINFER_FAULT_STEP", {"DEEPINFER_FAULT_STEP": "7"}) == 7
    assert envs.read("DEEPINFER_NEURON_FP8_MAX", {}) is None  # unset: the table's default
    with pytest.raises(ValueError, match="DEEPINFER_NEURON_FP8_MAX must be a number, got 'big'"):
        envs.read("DEEPINFER_NEURON_FP8_MAX", {"DEEPINFER_NEURON_FP8_MAX": "big"})
    with pytest.raises(KeyError, match="DEEPINFER_NOT_A_SETTING"):
        envs.read("DEEPINFER_NOT_A_SETTING", {})


def test_child_env_puts_the_project_first_on_pythonpath():
    env = envs.child_env({"PYTHONPATH": "/theirs", "HOME": "/h"}, pythonpath_first=("/ours",), EXTRA="1")
    assert env == {"PYTHONPATH": os.pathsep.join(("/ours", "/theirs")), "HOME": "/h", "EXTRA": "1"}
