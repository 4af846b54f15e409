"""docs/design.md's layout table and rules, checked against the code.

The table lists every module of ``functopk/`` (and only modules that exist); every module is at
most 500 lines and every function at most 80; a module imports only from its own layer and the
layers above it in the table; no import cycles; no underscore name imported from another module.
Every import counts, wherever it is written: in a function, or under ``TYPE_CHECKING``.
"""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "functopk"
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 80

# Violations of the rules that exist today, each to be removed by the restructuring that fixes it.
# The list can only shrink: a test fails when an entry no longer occurs, so delete it then.
KNOWN_EXCEPTIONS: dict[str, set] = {
    "long_functions": set(),  # functions over MAX_FUNCTION_LINES, as "module path: qualified name"
    "long_modules": set(),  # modules over MAX_MODULE_LINES, as paths
    "cycles": set(),  # import cycles, as sorted tuples of the modules of one strongly connected component
    "layer_imports": set(),  # imports against the layer rule, as "importer -> imported"
    "underscore_imports": set(),  # underscore names imported across modules, as "importer: module.name"
}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def layout_table() -> list[tuple[str, str]]:
    """(layer, module path) for each module design.md's layout table names, in table order.

    A row names modules as `functopk/x.py`, or names a package `functopk/x/` whose modules its
    cells name as `y.py`. An empty layer cell continues the layer above.
    """
    text = (ROOT / "docs" / "design.md").read_text()
    section = text.split("## Layout", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ")][2:]
    named, layer = [], ""
    for row in rows:
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        layer = cells[0] or layer
        package = ""
        for token in re.findall(r"`([\w/.]+)`", " | ".join(cells[1:])):
            if token.startswith("functopk/") and token.endswith("/"):
                package = token
            elif token.startswith("functopk/") and token.endswith(".py"):
                named.append((layer, token))
            elif token.endswith(".py") and package:
                named.append((layer, package + token))
    return named


def test_layout_table_lists_exactly_the_modules_of_the_package():
    named = [path for _, path in layout_table()]
    on_disk = sorted(str(p.relative_to(ROOT)) for p in MODULES.values() if p.name != "__init__.py")
    missing = sorted(set(on_disk) - set(named))
    unknown = sorted(set(named) - set(on_disk))
    diff = [f"+ {path} (add it to docs/design.md's layout table)" for path in missing]
    diff += [f"- {path} (named in docs/design.md's layout table but not on disk)" for path in unknown]
    assert not diff, "docs/design.md's layout table and functopk/ differ:\n" + "\n".join(diff)
    assert len(named) == len(set(named)), "a module is named twice in docs/design.md's layout table"


def functions(tree: ast.AST, prefix: str = ""):
    """(qualified name, node) of every function, methods and nested functions included."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield prefix + node.name, node
            yield from functions(node, prefix + node.name + ".")
        elif isinstance(node, ast.ClassDef):
            yield from functions(node, prefix + node.name + ".")
        else:
            yield from functions(node, prefix)


def test_modules_and_functions_are_short():
    long_functions, long_modules = set(), set()
    for path in MODULES.values():
        rel, text = str(path.relative_to(ROOT)), path.read_text()
        if len(text.splitlines()) > MAX_MODULE_LINES:
            long_modules.add(rel)
        for name, node in functions(ast.parse(text)):
            if node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES:
                long_functions.add(f"{rel}: {name}")
    assert_as_known("long_functions", long_functions)
    assert_as_known("long_modules", long_modules)


def assert_as_known(kind: str, found: set) -> None:
    known = KNOWN_EXCEPTIONS[kind]
    new, gone = sorted(found - known), sorted(known - found)
    assert not new, f"{kind}: against docs/design.md's rules (fix them; KNOWN_EXCEPTIONS only shrinks): {new}"
    assert not gone, f"{kind}: fixed, so delete them from KNOWN_EXCEPTIONS in tests/test_design.py: {gone}"


def imports(name: str):
    """(imported module, imported name or None) for each functopk import of a module, wherever it is."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from ((alias.name, None) for alias in node.names if alias.name.startswith("functopk"))
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - max(node.level - 1, 0)] if node.level else []
            source = ".".join(base + ([node.module] if node.module else []))
            if source.startswith("functopk"):
                yield from ((source, alias.name) for alias in node.names)


def defining_module(source: str, name: str | None) -> str:
    """The module an import really depends on: a submodule, or where a re-exported function or class lives."""
    if name is None:
        return source
    if f"{source}.{name}" in MODULES:
        return f"{source}.{name}"
    owner = getattr(getattr(importlib.import_module(source), name, None), "__module__", None)
    return owner if owner in MODULES else source


def dependencies() -> dict[str, set[str]]:
    graph = {}
    for name in MODULES:
        graph[name] = {defining_module(source, imported) for source, imported in imports(name)} - {name}
    return graph


def test_modules_import_only_from_their_layer_and_the_layers_above():
    order = {}
    for layer, _path in layout_table():
        order.setdefault(layer, len(order))
    layer_of = {module_name(ROOT / path): order[layer] for layer, path in layout_table()}
    against = set()
    for importer, imported in dependencies().items():
        for module in imported:
            # package __init__ files only re-export: they belong to no layer
            if importer in layer_of and module in layer_of and layer_of[module] > layer_of[importer]:
                against.add(f"{importer} -> {module}")
    assert_as_known("layer_imports", against)


def test_no_import_cycles():
    graph = dependencies()
    cycles = {tuple(sorted(component)) for component in strongly_connected(graph) if len(component) > 1}
    assert_as_known("cycles", cycles)


def strongly_connected(graph: dict[str, set[str]]) -> list[set[str]]:
    """Tarjan's algorithm, recursive (the graph has under a hundred modules)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    components = []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        for succ in graph.get(node, ()):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = set()
            while True:
                top = stack.pop()
                component.add(top)
                if top == node:
                    break
            components.append(component)

    for node in graph:
        if node not in index:
            visit(node)
    return components


def test_no_underscore_names_imported_across_modules():
    found = set()
    for importer in MODULES:
        for source, name in imports(importer):
            if name and name.startswith("_") and not name.startswith("__"):
                found.add(f"{importer}: {source}.{name}")
    assert_as_known("underscore_imports", found)


def test_the_checks_see_violations():
    """The parsers find what they look for: a cycle, a long function, an underscore import."""
    assert strongly_connected({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [{"a", "b"}, {"c"}]
    long = "def f():\n" + "    x = 1\n" * MAX_FUNCTION_LINES
    assert [(n, node.end_lineno) for n, node in functions(ast.parse(long))] == [("f", MAX_FUNCTION_LINES + 1)]
    assert ("functopk.distributed.wire", "pack") in set(imports("functopk.distributed.tree"))
    assert "functopk/_checks.py" in [path for _, path in layout_table()]


def test_the_public_front_is_counted_right():
    """design.md's count of the names ``functopk/__init__.py`` exports is the count of ``ft.__all__``."""
    import functopk as ft

    text = (ROOT / "docs" / "design.md").read_text()
    assert f"`functopk/__init__.py` exports {len(ft.__all__)} names" in text


STATE_KERNELS = ("_foreach_lerp_", "_foreach_maximum_", "_foreach_addcmul_", "_foreach_clamp_min_")


def test_one_engine_and_one_writing_of_each_optimizer():
    """No second in-place engine: no ``inplace*`` module but ``functopk/inplace.py``; the in-place kernels that
    turn a state field into its new value run only in the writer and the foreach layer (an optimizer's formula
    calls them through the writer); ``adapter/`` holds no optimizer maths (no foreach kernel but the adds
    into the parameters and ``TorchOptimizer``'s group factors)."""
    engines = [rel for rel in map(str, (p.relative_to(ROOT) for p in MODULES.values()))
               if Path(rel).name.startswith("inplace")]  # fmt: skip
    assert engines == ["functopk/inplace.py"], engines
    for path in MODULES.values():
        rel, text = str(path.relative_to(ROOT)), path.read_text()
        if rel not in ("functopk/tree/writer.py", "functopk/tree/foreach.py"):
            assert not [k for k in STATE_KERNELS if f"torch.{k}(" in text], rel
        if rel.startswith("functopk/adapter/"):
            assert set(re.findall(r"torch\._foreach_(\w+)\(", text)) <= {"add_", "mul"}, rel
