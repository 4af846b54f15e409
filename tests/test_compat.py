"""functopk/_compat.py: the supported torch range, each feature's minimum torch, and the traceable comparisons."""

from __future__ import annotations

import collections
import re
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import optree
import pytest
import torch

import functopk as ft
from functopk import _compat
from functopk._compat import COMPILE_TOO_OLD, MINIMUM_TORCH, TORCH_FLOOR, replace, same_nodes, same_structure

ROOT = Path(__file__).resolve().parent.parent


class Pair(NamedTuple):
    a: object
    b: object


class Twin(NamedTuple):  # Pair's fields under another class
    a: object
    b: object


TREES = [
    1,
    None,
    (),
    [],
    {},
    (1, 2),
    [1, 2],
    [1, None],
    [1, 2, 3],
    {"a": 1, "b": 2},
    {"b": 2, "a": 1},  # a dict's key order is not its structure
    {"a": 1, "c": 2},
    collections.OrderedDict(a=1, b=2),
    collections.OrderedDict(b=2, a=1),  # an OrderedDict's key order is
    Pair(1, 2),
    Twin(1, 2),
    Pair(1, (2, 3)),
    {"a": [1, {"x": 2}], "b": (None, 3)},
    {"a": [1, {"y": 2}], "b": (None, 3)},
    {"a": [1, {"x": 2}], "b": (3, None)},
]


@pytest.mark.parametrize("none_is_leaf", [False, True])
def test_traced_comparison_agrees_with_optree_on_every_pair(none_is_leaf):
    specs = [optree.tree_structure(t, none_is_leaf=none_is_leaf) for t in TREES]
    for x in specs:
        for y in specs:
            assert same_nodes(x, y) == (x == y), (x, y)
            assert same_structure(x, y) == (x == y)


def test_traced_comparison_sees_none_handling_and_namespaces():
    assert not same_nodes(optree.tree_structure([1, None]), optree.tree_structure([1, None], none_is_leaf=True))
    plain, named = optree.tree_structure({"a": 1}), optree.tree_structure({"a": 1}, namespace="functopk-test")
    assert same_nodes(plain, named) == (plain == named)


def _flag(same: bool, x: torch.Tensor) -> torch.Tensor:
    return x * (1.0 if same else -1.0)


@pytest.mark.compile
@pytest.mark.usefixtures("fresh_dynamo")
def test_structures_compare_inside_a_compiled_function():
    """Under dynamo the structures are its own stand-ins: equal and unequal ones are told apart (one graph)."""

    def fn(a, b):
        return _flag(same_structure(optree.tree_structure(a), optree.tree_structure(b)), ft.tree.leaves(a)[0])

    compiled = torch.compile(fn, fullgraph=True, backend="eager")
    one = torch.ones(1)
    assert compiled({"a": one, "b": (one, one)}, {"b": (one, one), "a": one}).item() == 1.0
    assert compiled({"a": one, "b": (one, one)}, {"a": one, "b": [one, one]}).item() == -1.0
    assert compiled(Pair(one, one), Twin(one, one)).item() == -1.0


@pytest.mark.compile
@pytest.mark.usefixtures("fresh_dynamo")
def test_replace_inside_a_compiled_function_keeps_every_field():
    """dynamo 2.11 compiles NamedTuple._replace into an empty tuple; replace() is traced right."""
    state = Pair(torch.ones(2), torch.zeros(2))
    out = torch.compile(lambda s: replace(s, a=s.a + 1), fullgraph=True, backend="eager")(state)
    assert type(out) is Pair and len(out) == 2
    assert torch.equal(out.a, torch.full((2,), 2.0)) and torch.equal(out.b, state.b)


def test_replace_refuses_an_unknown_field():
    with pytest.raises(ValueError, match=r"Pair has no fields \['c'\]"):
        replace(Pair(1, 2), c=3)
    assert replace(Pair(1, 2)) == Pair(1, 2)


@pytest.mark.parametrize(("version", "too_old"), [("2.9.1+cu128", True), ("2.9.0", True), ("2.10.0", False),
                                                  ("2.10.0+cu128", False), ("2.14.1", False), ("3.0.0", False)])
def test_a_feature_on_an_older_torch_names_the_torch_it_needs(monkeypatch, version, too_old):
    monkeypatch.setattr(torch, "__version__", torch.torch_version.TorchVersion(version))
    message = _compat.too_old_for("torch.compile of functopk code")
    if too_old:
        assert message == f"torch.compile of functopk code needs torch >= 2.10; this is torch {version}"
    else:
        assert message is None


@pytest.fixture
def old_torch_for_compile(monkeypatch):
    """On a torch that compiles functopk, pretend it is 2.9.1 (what _compat decides at import for a real one)."""
    if COMPILE_TOO_OLD is None:
        monkeypatch.setattr(torch, "__version__", torch.torch_version.TorchVersion("2.9.1"))
        monkeypatch.setattr(_compat, "COMPILE_TOO_OLD", _compat.too_old_for("torch.compile of functopk code"))
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.usefixtures("old_torch_for_compile")
def test_compiling_functopk_on_a_torch_before_2_10_fails_naming_2_10_with_fullgraph():
    tree = {"a": torch.tensor([3.0, -1.0, 2.0]), "b": torch.tensor([-4.0])}
    with pytest.raises(Exception, match=r"torch\.compile of functopk code needs torch >= 2\.10; this is torch 2\.9"):
        torch.compile(lambda t: ft.topk_sparsify(t, 2), fullgraph=True, backend="eager")(tree)
    # without fullgraph dynamo runs functopk eagerly: the same numbers
    got = torch.compile(lambda t: ft.topk_sparsify(t, 2), backend="eager")(tree)
    assert torch.equal(got["a"], torch.tensor([3.0, 0.0, 0.0])) and torch.equal(got["b"], torch.tensor([-4.0]))


def test_eager_functopk_ignores_the_compile_minimum(old_torch_for_compile):
    tx = ft.chain(ft.topk(1), ft.sgd(0.5))
    params = {"w": torch.tensor([1.0, -3.0])}
    updates, _ = tx.update(params, tx.init(params), params)
    assert torch.equal(updates["w"], torch.tensor([0.0, 1.5]))


def test_import_does_not_load_dynamo_or_dtensor():
    """torch._dynamo and torch.distributed.tensor (FSDP2) are imported where used, not by ``import functopk``."""
    heavy = ("torch._dynamo", "torch.distributed.tensor")
    code = f"import sys, functopk; print(sorted(m for m in {heavy} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]", out.stdout


def test_the_supported_range_is_stated_alike_everywhere():
    """pyproject's torch>=, the README, design.md and the oldest torch CI tests agree with _compat."""
    floor = f"torch>={TORCH_FLOOR}"
    assert f'"{floor}"' in (ROOT / "pyproject.toml").read_text()
    readme, design = (ROOT / "README.md").read_text(), (ROOT / "docs" / "design.md").read_text()
    for feature, version in MINIMUM_TORCH.items():
        assert f"torch >= {version}" in design and f"{version}" in readme, feature
    assert f"torch >= {TORCH_FLOOR}" in readme and f"torch >= {TORCH_FLOOR}" in design
    oldest = re.search(r"^OLDEST_TORCH\s*:?=\s*(\S+)", (ROOT / "Makefile").read_text(), flags=re.M)
    assert oldest and oldest.group(1).startswith(TORCH_FLOOR + "."), "the Makefile's OLDEST_TORCH is the floor"
    compile_floor = re.search(r"^COMPILE_TORCH\s*:?=\s*(\S+)", (ROOT / "Makefile").read_text(), flags=re.M)
    assert compile_floor and compile_floor.group(1).startswith(MINIMUM_TORCH["torch.compile of functopk code"] + ".")


@pytest.mark.compile
@pytest.mark.usefixtures("fresh_dynamo")
def test_the_list_form_of_tensor_scalars_torch_2_10_compiles_gives_the_eager_numbers(monkeypatch):
    """Where dynamo cannot trace a foreach kernel with a 0-d tensor scalar (2.10), the list form runs instead."""
    from functopk.tree import foreach

    monkeypatch.setattr(foreach, "FOREACH_TENSOR_SCALARS_TRACE", False)
    tx = ft.adam(0.1, eps_root=1e-8)
    params = {"w": torch.randn(3, 4), "b": torch.randn(4, dtype=torch.float64)}
    grads = ft.tree.map(torch.sin, params)

    def step(state):
        return tx.update(grads, state, params)

    eager = step(tx.init(params))
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")(tx.init(params))
    for a, b in zip(ft.tree.leaves(compiled), ft.tree.leaves(eager)):
        assert torch.equal(a, b)
    scalar = torch.tensor(2.0)
    assert foreach.per_leaf(scalar, [torch.ones(1)] * 3) is scalar  # eagerly: the scalar overload


def test_assume_constant_result_sets_the_mark_torchs_decorator_sets():
    """functopk marks constant results itself (no dynamo import); the mark must be the one torch's decorator sets."""
    from functopk._compat import assume_constant_result

    def ours():
        return 1

    def theirs():
        return 1

    assert assume_constant_result(ours) is ours
    assert torch.compiler.assume_constant_result(theirs) is theirs
    assert vars(ours) == vars(theirs) == {"_dynamo_marked_constant": True}
