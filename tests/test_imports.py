"""No import cycles among parc's modules, lazy (function-level) imports included.

Each module's imports are read with `ast` from its source (the packages
pyproject.toml lists, found where the import system finds them): `import a.b`,
`from a import b` (the submodule `a.b` when there is one, else the package `a`)
and relative imports, at any depth in the file. Imports under `if TYPE_CHECKING:`
never run, so they are left out. A cycle means none of its modules can be
understood, tested or imported without the others; break it by moving the
shared piece to a leaf module.
"""

from __future__ import annotations

import ast
import importlib.util
import re
from collections.abc import Iterator
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parent.parent


def _packages() -> list[str]:
    """The packages pyproject.toml installs (its `packages = [...]` line)."""
    text = (ROOT / "pyproject.toml").read_text()
    line = re.search(r"^packages = \[(.*)\]$", text, re.MULTILINE)
    assert line is not None, "pyproject.toml lists no packages"
    return re.findall(r'"([\w.]+)"', line[1])


def _modules() -> dict[str, Path]:
    """Every module of the installed packages: dotted name -> source file."""
    found = {}
    for package in _packages():
        spec = importlib.util.find_spec(package)
        assert spec is not None and spec.submodule_search_locations, package
        for folder in map(Path, spec.submodule_search_locations):
            for path in sorted(folder.glob("*.py")):
                name = package if path.stem == "__init__" else f"{package}.{path.stem}"
                found[name] = path
    return found


def _type_checking_only(tree: ast.Module) -> set[int]:
    """Ids of the import nodes under an `if TYPE_CHECKING:` block."""
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for stmt in node.body:
                skipped.update(id(inner) for inner in ast.walk(stmt))
    return skipped


def _imports(name: str, path: Path, modules: dict[str, Path]) -> Iterator[str]:
    """The parc modules `name` imports, anywhere in its file."""
    tree = ast.parse(path.read_text(), str(path))
    skipped = _type_checking_only(tree)
    package = name if path.stem == "__init__" else name.rpartition(".")[0]
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names if a.name in modules)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            for alias in node.names:
                if f"{base}.{alias.name}" in modules:
                    yield f"{base}.{alias.name}"
                elif base in modules:
                    yield base


def import_graph() -> nx.DiGraph:
    """parc's modules and who imports whom (an edge a -> b: a imports b)."""
    modules = _modules()
    graph = nx.DiGraph()
    graph.add_nodes_from(modules)
    for name, path in modules.items():
        graph.add_edges_from((name, dep) for dep in _imports(name, path, modules) if dep != name)
    return graph


def test_the_import_graph_sees_lazy_and_relative_imports() -> None:
    graph = import_graph()
    assert ("parc.commands", "parc.demo") in graph.edges  # inside cmd_demo
    assert ("parc.compiler.planner.format", "parc.compiler.planner.spec_out") in graph.edges
    assert len(graph) > 100  # every package: parc, dsl, compiler (and its passes), runtime
    assert ("parc.runtime.checkpoint.store", "parc.runtime.checkpoint.entries") in graph.edges


def test_parc_has_no_import_cycles() -> None:
    cycles = sorted(sorted(c) for c in nx.simple_cycles(import_graph()))
    assert cycles == [], "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)
