"""The house shows its parts: the packages' imports point one way (no module imports one that imports it
back, directly or through others; lazy imports inside functions count, since a reader must hold those
circles in their head too; imports under `if TYPE_CHECKING:` do not, since they never run), and no
function is too tangled to read (radon's D grade or worse)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.conftest import ROOT

PACKAGES = ("node", "p2p", "trainer", "rewards")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for package in PACKAGES for p in sorted((ROOT / package).rglob("*.py"))}


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The project modules `name` imports: `from a import b` names the module a.b where b is one, else a."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def add(target: str) -> None:
        while target and target not in known:
            target = target.rpartition(".")[0]
        if target and target != name:
            found.add(target)

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            for alias in node.names:
                add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text()))
    return found


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            connect(v)
    return found


def test_no_module_imports_one_that_imports_it_back():
    mods = modules()
    graph = {name: imports_of(name, path, set(mods)) for name, path in mods.items()}
    assert sum(map(len, graph.values())) > 50  # the walk found the imports
    assert circles(graph) == []


def test_the_walk_finds_a_circle_through_a_lazy_import():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(graph) == [["a", "b", "c"]]
    assert imports_of("trainer.tiny", ROOT / "trainer" / "tiny.py", set(modules())) >= {"trainer.policy", "trainer.rollout"}


def test_no_function_rates_d_or_worse():
    """radon's cyclomatic complexity: A-C (up to 20) reads on one screen; D and worse hide the data flow. The
    benchmarks and tests are read too (a test is how a reader learns what the code promises)."""
    try:
        from radon.complexity import cc_visit
    except ImportError:
        pytest.skip("no radon: pip install -e '.[dev]'")
    sources = sorted(p for folder in (*PACKAGES, "scripts", "tests", "docker") for p in (ROOT / folder).rglob("*.py"))
    tangled = [f"{path.relative_to(ROOT)}:{block.lineno} {block.fullname} ({block.complexity})"
               for path in sources for block in cc_visit(path.read_text()) if block.complexity > 20]
    assert len(sources) > 100 and tangled == []


def test_the_gossip_layer_parses_no_answers():
    """Whether a group can teach anyone is the node's verifier's call, handed to p2p as a function: no
    module of the p2p layer imports rewards/ (the lab probe that forwards as a node does lives in scripts/bench/lab/)."""
    mods = modules()
    leaks = {name: sorted(d for d in imports_of(name, path, set(mods)) if d.split(".")[0] == "rewards")
             for name, path in mods.items() if name.startswith("p2p")}
    assert {name: deps for name, deps in leaks.items() if deps} == {}


def test_scripts_import_no_tests_and_edit_no_sys_path():
    """Benchmarks and tools stand on the installed packages and their own lab (scripts/bench/lab), never on
    the test suite, and find them without rewriting the interpreter's path."""
    found = []
    for path in sorted((ROOT / "scripts").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            if any(n == "tests" or n.startswith("tests.") for n in names):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} imports the tests")
            if isinstance(node, ast.Attribute) and ast.unparse(node).startswith("sys.path."):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} edits sys.path")
    assert found == []
