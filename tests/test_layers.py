"""Layers point one way and no modules import each other in a loop, read from the code's imports
(every ``import`` and ``from ... import`` of the four packages, type-checking ones included)."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("codec", "transport", "storage", "bench")
# what each package may import of the others
ALLOWED = {
    "codec": set(),
    "transport": set(),
    "storage": {"codec", "transport"},
    "bench": {"codec", "transport", "storage"},
}


def imports() -> dict[str, set[str]]:
    """Module -> the modules of the four packages it imports."""
    graph: dict[str, set[str]] = {}
    for pkg in PACKAGES:
        for path in sorted((REPO / pkg).glob("*.py")):
            name = f"{pkg}.{path.stem}" if path.stem != "__init__" else pkg
            found: set[str] = set()
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    found |= {a.name for a in node.names}
                elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    found.add(node.module)
                    found |= {f"{node.module}.{a.name}" for a in node.names}
            graph[name] = {m for m in found if m.split(".")[0] in PACKAGES}
    modules = set(graph)
    return {m: {d for d in deps if d in modules and d != m} for m, deps in graph.items()}


def test_layers_point_one_way() -> None:
    bad = [
        f"{m} imports {d}"
        for m, deps in imports().items()
        for d in deps
        if d.split(".")[0] != m.split(".")[0] and d.split(".")[0] not in ALLOWED[m.split(".")[0]]
    ]
    assert not bad, bad


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every loop a depth-first walk of ``graph`` closes, as the modules along it."""
    state: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for d in sorted(graph.get(m, ())):
            if state.get(d) == 1:
                found.append([*stack[stack.index(d) :], d])
            elif d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
    return found


def test_no_import_cycles() -> None:
    # a package's __init__ hands names on; an import of the package is one of its modules
    graph = {m: {d for d in deps if d not in PACKAGES} for m, deps in imports().items()}
    assert not cycles(graph), cycles(graph)


def test_the_walk_finds_a_cycle() -> None:
    assert cycles({"a.x": {"a.y"}, "a.y": {"a.z"}, "a.z": {"a.x"}}) == [
        ["a.x", "a.y", "a.z", "a.x"]
    ]
    assert cycles({"a.x": {"a.y"}, "a.y": set()}) == []
