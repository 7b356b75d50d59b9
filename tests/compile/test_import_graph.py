"""The package's import graph: no circles between modules, and the runtime never reaches into the compiler.

Every import counts, at the top of a module, inside a function or under TYPE_CHECKING: a lazy import is still a
dependency, and a circle of lazy imports is one refactor away from an import-time failure. The plan, spec and run
file formats the two halves share live in `rlc.schemas`.
"""

from __future__ import annotations

import ast
import tomllib
from collections.abc import Iterator
from pathlib import Path

from paths import REPO


def _modules() -> dict[str, Path]:
    """Every module of the installed package, by dotted name, from pyproject's package-dir mapping."""
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    dirs = config["package-dir"]
    modules = {}
    for package, folder in dirs.items():
        for path in (REPO / folder).rglob("*.py"):
            parts = [p for p in path.relative_to(REPO / folder).with_suffix("").parts if p != "__init__"]
            modules[".".join([package, *parts])] = path
    return modules


def _imported(name: str, path: Path, modules: dict[str, Path]) -> Iterator[str]:
    """The package modules `name` imports (a `from package import module` names the module)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - (node.level - 1)] if node.level else []
            source = ".".join([*base, node.module] if node.module else base) if node.level else node.module or ""
            targets = [f"{source}.{alias.name}" for alias in node.names] + [source]
        elif isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                yield target
                break


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: set(_imported(name, path, modules)) for name, path in modules.items()}


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_walk_sees_the_package() -> None:
    graph = _graph()
    assert {"rlc.cli", "rlc.compiler.planner", "rlc.runtime.controller", "rlc.schemas.plan"} <= set(graph)
    assert "rlc.schemas.plan" in graph["rlc.compiler.planner"]
    assert "rlc.runtime.workflows.generate" in graph["rlc.runtime.controller"]  # a `from x.y import Name` edge


def test_no_module_imports_itself_through_others() -> None:
    assert _circles(_graph()) == []


def test_a_circle_is_found() -> None:
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_runtime_never_imports_the_compiler() -> None:
    graph = _graph()
    edges = [
        (source, target)
        for source, targets in graph.items()
        if source.startswith("rlc.runtime")
        for target in targets
        if target.startswith("rlc.compiler")
    ]
    assert edges == []
