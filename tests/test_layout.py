"""The package's shape: no import cycles (imports inside functions count), and model-family facts
read from surgeon/families.py only."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Folders installed as surgeon.<name> (pyproject's package-dir) beside surgeon/ itself.
PACKAGE_DIRS = {"surgeon": ROOT / "surgeon", "surgeon.kernels": ROOT / "kernels", "surgeon.demos": ROOT / "demos"}


def _modules() -> dict[str, Path]:
    found = {}
    for prefix, folder in PACKAGE_DIRS.items():
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join([prefix, *parts])] = path
    return found


def _is_package(path: Path) -> bool:
    return path.name == "__init__.py"


def _ancestors(module: str) -> list[str]:
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def import_graph() -> dict[str, set[str]]:
    """Module -> the surgeon modules it imports anywhere in its body. Importing a.b.c also runs the
    packages a.b and a (unless the importer sits inside them); a package that imports its own
    folder's modules by walking it (ops/) imports all of them."""
    modules = _modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        source = path.read_text()
        package = name if _is_package(path) else name.rpartition(".")[0]
        targets: set[str] = set()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")
                    base = base[: len(base) - (node.level - 1)]
                    origin = ".".join(base + ([node.module] if node.module else []))
                else:
                    origin = node.module or ""
                targets.add(origin)
                targets.update(f"{origin}.{alias.name}" for alias in node.names)
        if _is_package(path) and "iter_modules" in source:
            targets.update(m for m in modules if m.rpartition(".")[0] == name)
        for target in {t for t in targets if t in modules}:
            for step in (target, *_ancestors(target)):
                if step in modules and step != name and step not in _ancestors(name):
                    graph[name].add(step)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_checker_sees_a_function_local_cycle(tmp_path):
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]


def test_the_graph_holds_function_local_and_package_imports():
    graph = import_graph()
    assert "surgeon.ops.heal" in graph["surgeon.ops"]  # ops/ imports its folder by walking it
    assert "surgeon.demos.chat" in graph["surgeon.cli"]  # imported inside a function


def test_no_import_cycles():
    assert cycles(import_graph()) == []
