"""functopk.sparse as a package: its modules import one way (no cycle, lazy imports included)."""

from __future__ import annotations

import ast
from pathlib import Path

import functopk

SPARSE = Path(functopk.__file__).parent / "sparse"


def _module(path: Path) -> str:
    parts = path.relative_to(SPARSE.parent.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The modules of ``modules`` that ``path`` imports anywhere (top level or inside a function)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:  # ``from pkg import submodule`` imports the submodule
                sub = f"{node.module}.{alias.name}"
                found.add(sub if sub in modules else node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found & modules


def test_sparse_modules_import_without_a_cycle():
    paths = {_module(p): p for p in SPARSE.rglob("*.py")}
    graph = {m: _imports(p, set(paths)) - {m} for m, p in paths.items()}
    done: set[str] = set()

    def visit(m: str, stack: list[str]) -> None:
        assert m not in stack, "import cycle: " + " -> ".join(stack[stack.index(m):] + [m])
        if m not in done:
            for dep in sorted(graph[m]):
                visit(dep, [*stack, m])
            done.add(m)

    for m in sorted(graph):
        visit(m, [])
