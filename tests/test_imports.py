"""The import contract: layers (import-linter, configured in pyproject.toml), no import cycles
anywhere in materl (function-local imports included), and tool servers that use nothing of
materl's internals."""

import ast
import itertools
import subprocess
import sys
from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parents[1]


def test_layers_contract_is_kept():
    out = subprocess.run([str(Path(sys.executable).with_name("lint-imports"))], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert "Contracts: 1 kept, 0 broken." in out.stdout


def cycles(graph) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, found, counter = {}, {}, [], set(), [], itertools.count()

    def visit(v):
        index[v] = low[v] = next(counter)
        stack.append(v)
        on.add(v)
        for w in graph.find_modules_directly_imported_by(v):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for module in sorted(graph.modules):
        if module not in index:
            visit(module)
    return found


def test_no_import_cycles():
    graph = grimp.build_graph("materl", include_external_packages=False, exclude_type_checking_imports=True)
    assert cycles(graph) == []


def test_the_cycle_check_finds_a_cycle():
    class Graph:
        modules = {"a", "b", "c"}
        edges = {"a": {"b"}, "b": {"a"}, "c": {"a"}}

        def find_modules_directly_imported_by(self, m):
            return self.edges[m]

    assert cycles(Graph()) == [["a", "b"]]


def test_tool_servers_import_only_materl_tools():
    for path in sorted((ROOT / "tools").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            for name in names:
                assert not name.startswith("materl") or name.startswith("materl.tools"), f"{path.name} imports {name}"


def test_every_package_is_installed():
    """A non-editable install ships only the packages pyproject.toml lists: each folder of materl
    with an ``__init__.py`` must be among them."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "materl").rglob("__init__.py")}
    assert found - listed == set(), f"packages missing from pyproject.toml: {sorted(found - listed)}"
