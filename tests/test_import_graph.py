"""amct_ext's import graph has no circle, lazy imports (inside functions) included.

A circle that only lazy imports close still bites: whichever module of it is imported first
decides whether a name exists yet (base.py -> distributed.py -> workflow.py -> ptq_spec.py ->
base.py was one, issue 37). The graph is read from the source (``ast``), so no module is run."""
from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def module_names(root: Path) -> dict[str, Path]:
    mods = {}
    for path in (root / "amct_ext").rglob("*.py"):
        parts = path.relative_to(root).with_suffix("").parts
        mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return mods


def imported(name: str, path: Path, node: ast.AST, mods: dict[str, Path]) -> set[str]:
    """The amct_ext modules an import statement of module ``name`` names (a package's
    ``from . import x`` names the submodule x)."""
    if isinstance(node, ast.Import):
        return {a.name for a in node.names if a.name in mods}
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    base = ".".join(package[:len(package) - node.level + 1] + ([node.module] if node.module else [])) \
        if node.level else node.module
    return {m for m in [base, *(f"{base}.{a.name}" for a in node.names)] if m in mods}


def import_graph(root: Path = REPO) -> dict[str, set[str]]:
    mods = module_names(root)
    graph = {}
    for name, path in mods.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        deps = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                deps |= imported(name, path, node, mods)
        graph[name] = deps - {name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle of ``graph`` as [a, b, ..., a], or None (depth-first search, three colours)."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(v: str) -> list[str] | None:
        state[v] = 1
        stack.append(v)
        for w in sorted(graph[v]):
            if state.get(w) == 1:
                return stack[stack.index(w):] + [w]
            if w not in state:
                found = visit(w)
                if found:
                    return found
        stack.pop()
        state[v] = 2
        return None

    for v in sorted(graph):
        if v not in state:
            found = visit(v)
            if found:
                return found
    return None


def test_graph_reader_sees_lazy_and_relative_imports():
    graph = import_graph()
    # a top-level relative import, a lazy import inside a function, a package-relative one
    assert "amct_ext.pipeline.ptq_units" in graph["amct_ext.base"]
    assert "amct_ext.pipeline.layer_cost" in graph["amct_ext.base"]
    assert "amct_ext.runtime.device" in graph["amct_ext.base"]
    assert len(graph) > 60


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_amct_ext_has_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle)
