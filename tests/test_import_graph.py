"""The import graph of backend_lib and kernels: no cycles, and imports only go down the layers.

Layers, top to bottom (a module may import its own layer and any layer below it):
    frontend -> tools -> engine -> worker -> models -> neuron -> core -> structured_output -> kernels
(neuron, what is specific to the device and its compiler, sits below the models, whose static MoE it provides, and
imports neither them nor the engine; structured_output imports only kernels: it sits below the core, whose requests
carry its constraints.)
Edges are read with ``ast``, not by importing: module-level and function-level imports, and string constants that
name one of our modules exactly (``importlib.import_module`` targets, the model registry, ``python -m`` commands);
imports under ``if TYPE_CHECKING:`` are left out (they never run). The checker itself is tested on small synthetic
graphs, so a broken checker cannot pass silently.
"""
from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("backend_lib", "kernels")
LAYERS = ("backend_lib.frontend", "backend_lib.tools", "backend_lib.engine", "backend_lib.worker",
          "backend_lib.models", "backend_lib.neuron", "backend_lib.core", "backend_lib.structured_output",
          "kernels")  # top first
UNLAYERED = {"backend_lib"}  # the root package's __init__ (imports nothing)


# ---------------------------------------------------------------------------------------------- the checker

def module_files(root: Path, packages: tuple[str, ...] = PACKAGES) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file under the packages (``pkg/__init__.py`` is ``pkg``)."""
    found = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imported_names(node: ast.Import | ast.ImportFrom, module: str, is_package: bool) -> list[str]:
    """Candidate dotted names an import statement loads (``from a import b`` -> ``a.b``, resolved later)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if node.level:  # relative: from the module's package, up level - 1
        base = module.split(".") if is_package else module.split(".")[:-1]
        base = base[:len(base) - (node.level - 1)]
        prefix = ".".join(base + ([node.module] if node.module else []))
    else:
        prefix = node.module or ""
    return [f"{prefix}.{alias.name}" for alias in node.names] + [prefix]


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The longest known module that ``name`` is or lies inside (``a.b.func`` -> ``a.b``)."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def imports_of(module: str, path: Path, modules: dict[str, Path]) -> dict[str, int]:
    """Our modules that ``module`` imports (at any depth but under ``if TYPE_CHECKING:``) -> the first line."""
    edges: dict[str, int] = {}
    is_package = path.name == "__init__.py"

    def add(target: str | None, line: int) -> None:
        if target is not None and target != module:
            edges.setdefault(target, line)

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = _imported_names(node, module, is_package)
            if isinstance(node, ast.ImportFrom):  # `from pkg import mod` loads pkg.mod; `from mod import f`, mod
                names = [n for n in names[:-1] if n in modules] or names[-1:]
            for name in names:
                add(_resolve(name, modules), node.lineno)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in modules:
            add(node.value, node.lineno)  # a module named in a string: importlib, the registry, `python -m`
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(), filename=str(path)))
    return edges


def import_graph(root: Path = ROOT, packages: tuple[str, ...] = PACKAGES) -> dict[str, dict[str, int]]:
    modules = module_files(root, packages)
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def find_cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Each strongly connected component with more than one module, as a cycle through it (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        components.append(_cycle_through(set(component), graph))
    return components


def _cycle_through(component: set[str], graph: dict[str, dict[str, int]]) -> list[str]:
    """One closed path inside a strongly connected component, for the failure message: [a, b, ..., a]."""
    start = min(component)
    paths = {start: [start]}
    frontier = [start]
    while frontier:  # breadth-first, so the path printed is a shortest one
        following = []
        for node in frontier:
            for child in sorted(graph.get(node, ())):
                if child == start:
                    return paths[node] + [start]
                if child in component and child not in paths:
                    paths[child] = paths[node] + [child]
                    following.append(child)
        frontier = following
    raise AssertionError(f"{sorted(component)} is not strongly connected")


def layer_of(module: str, layers: tuple[str, ...] = LAYERS) -> int | None:
    """The layer's depth (0 = top); None for a module outside every layer."""
    for depth, prefix in enumerate(layers):
        if module == prefix or module.startswith(prefix + "."):
            return depth
    return None


def upward_edges(graph: dict[str, dict[str, int]], layers: tuple[str, ...] = LAYERS) -> list[str]:
    """Every import from a lower layer into a higher one, as 'importer:line -> imported'."""
    found = []
    for module, targets in sorted(graph.items()):
        depth = layer_of(module, layers)
        for target, line in sorted(targets.items()):
            target_depth = layer_of(target, layers)
            if depth is not None and target_depth is not None and target_depth < depth:
                found.append(f"{module}:{line} -> {target}  ({layers[depth]} must not import {layers[target_depth]})")
    return found


def _is_test_module(name: str) -> bool:
    leaf = name.rpartition(".")[2]
    return leaf.startswith("test_") or leaf == "conftest"


def imports_between_tests(root: Path) -> list[str]:
    """Every import, in tests/, of a test module or a conftest (shared code belongs in tests/helpers/), as
    'importer:line -> imported'; a bare ``from test_x import`` (a rootdir-relative import) counts too."""
    modules = module_files(root, ("tests",))
    found = []
    for module, path in sorted(modules.items()):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for name in _imported_names(node, module, path.name == "__init__.py"):
                target = _resolve(name, modules) or name.partition(".")[0]
                if target != module and _is_test_module(target):
                    found.append(f"{module}:{node.lineno} -> {target}")
    return sorted(set(found))


# ---------------------------------------------------------------------------------------------- the code base

def test_no_import_cycles():
    cycles = find_cycles(import_graph())
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(cycle) for cycle in cycles)


def test_imports_only_go_down_the_layers():
    edges = upward_edges(import_graph())
    assert not edges, "imports into a higher layer:\n" + "\n".join(edges)


def test_no_test_imports_another_test_module():
    found = imports_between_tests(ROOT)
    assert not found, "tests importing test modules (move what they share to tests/helpers/):\n" + "\n".join(found)


def test_every_module_belongs_to_a_layer():
    stray = [m for m in module_files(ROOT) if layer_of(m) is None and m not in UNLAYERED]
    assert not stray, f"modules outside every layer (add them to a layer package): {stray}"


def test_the_graph_sees_function_level_and_string_imports():
    graph = import_graph()
    assert "backend_lib.engine.llm_engine" in graph["backend_lib.frontend.cli.main"]  # inside _generate
    assert "backend_lib.models.llama.model" in graph["backend_lib.models.registry"]  # a string for importlib
    assert "backend_lib.frontend.openai" in graph["backend_lib.frontend.triton.server"]  # `python -m`


def test_core_imports_no_torch():
    core = [m for m in module_files(ROOT) if layer_of(m) == LAYERS.index("backend_lib.core")]
    code = (f"import sys\nfor name in {core!r}:\n    __import__(name)\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\nprint(len(" + repr(core) + "))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) >= 9



def test_the_openai_front_imports_no_torch():
    """The OpenAI front is its own process next to tritonserver: it resolves the model path and renders chat
    templates without the engine's torch (core/model_path.py)."""
    code = ("import sys\nimport backend_lib.frontend.openai.app\n"
            "assert 'torch' not in sys.modules, 'torch was imported'")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr

# ---------------------------------------------------------------------------------------------- the checker fails

def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))


def test_checker_finds_a_cycle_hidden_in_a_function(tmp_path):
    _write(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/a.py": "from pkg.b import g\n",
        "pkg/b.py": "def g():\n    from pkg import c\n",
        "pkg/c.py": "import pkg.a\n",
        "pkg/d.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.a import x\n",
    })
    graph = import_graph(tmp_path, ("pkg",))
    assert find_cycles(graph) == [["pkg.a", "pkg.b", "pkg.c", "pkg.a"]]
    assert graph["pkg.d"] == {}  # a TYPE_CHECKING import is no edge


def test_checker_finds_a_test_importing_a_test(tmp_path):
    _write(tmp_path, {
        "tests/__init__.py": "",
        "tests/conftest.py": "X = 1\n",
        "tests/helpers/__init__.py": "",
        "tests/helpers/shared.py": "def test_like_name():\n    pass\n",
        "tests/a/__init__.py": "",
        "tests/a/test_one.py": "from tests.helpers.shared import test_like_name\nfrom tests.a.test_two import f\n",
        "tests/a/test_two.py": "def f():\n    from test_one import g\n    from tests.conftest import X\n",
    })
    assert imports_between_tests(tmp_path) == ["tests.a.test_one:2 -> tests.a.test_two",
                                                "tests.a.test_two:2 -> test_one", "tests.a.test_two:3 -> tests.conftest"]


def test_checker_finds_a_relative_import_cycle(tmp_path):
    _write(tmp_path, {"pkg/__init__.py": "", "pkg/a.py": "from . import b\n", "pkg/b.py": "from .a import f\n"})
    assert find_cycles(import_graph(tmp_path, ("pkg",))) == [["pkg.a", "pkg.b", "pkg.a"]]


def test_checker_finds_an_upward_edge_and_passes_a_downward_one(tmp_path):
    _write(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/top/__init__.py": "",
        "pkg/top/x.py": "from pkg.low import y\n",
        "pkg/low/__init__.py": "",
        "pkg/low/y.py": "import importlib\nTARGET = 'pkg.top.x'\n",
    })
    graph = import_graph(tmp_path, ("pkg",))
    layers = ("pkg.top", "pkg.low")
    assert upward_edges(graph, layers) == ["pkg.low.y:2 -> pkg.top.x  (pkg.low must not import pkg.top)"]
    del graph["pkg.low.y"]["pkg.top.x"]
    assert upward_edges(graph, layers) == []
    assert find_cycles({"a": {"b": 1}, "b": {}}) == []
