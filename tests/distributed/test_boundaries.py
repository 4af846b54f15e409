"""The package's walls: modules of ``functopk.distributed`` share public names only, and import without cycles."""

from __future__ import annotations

import ast
import pathlib

import functopk.distributed

PACKAGE = pathlib.Path(functopk.distributed.__file__).parent


def _imports() -> dict[str, list[tuple[str, str]]]:
    """Each module's ``(module, name)`` imports from ``functopk.distributed.*``, ``TYPE_CHECKING`` ones too (an
    annotation that names another module is a dependency on it)."""
    out = {}
    for path in sorted(PACKAGE.glob("*.py")):
        tree = ast.parse(path.read_text())
        found = []
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("functopk.distributed."):
                found += [(node.module, a.name) for a in node.names]
        out[f"functopk.distributed.{path.stem}"] = found
    return out


def test_no_module_imports_another_ones_private_names():
    private = [f"{m} imports {name} from {src}" for m, names in _imports().items() for src, name in names
               if name.startswith("_")]  # fmt: skip
    assert not private, private


def test_the_modules_import_each_other_without_cycles():
    graph = {m: {src for src, _ in names} for m, names in _imports().items()}
    done: set[str] = set()

    def visit(module: str, path: tuple[str, ...]) -> None:
        assert module not in path, " -> ".join((*path, module))
        if module not in done:
            for dep in sorted(graph.get(module, ())):
                visit(dep, (*path, module))
            done.add(module)

    for module in graph:
        visit(module, ())
