"""The sparse apply's Triton kernel (:mod:`functopk.sparse.kernels.triton_scatter`) on CPU tensors under Triton's
interpreter, bit for bit against a brute force, one coordinate at a time.

Not collected by the suite itself (``TRITON_INTERPRET=1`` must be set before ``triton`` is imported):
``tests/sparse/test_kernels_triton_select.py`` runs it with ``triton_interpreted.py`` in their own pytest
process. By hand: ``TRITON_INTERPRET=1 python -m pytest -q tests/sparse/triton_scatter_interpreted.py``.
bfloat16 leaves are checked on a GPU (``tests/sparse/test_kernels_triton_cuda.py``).
"""

from __future__ import annotations

import math
from unittest import mock

import optree
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import functopk as ft
from functopk.sparse.kernels import triton_layout, triton_scatter, triton_select
from tests.helpers import bits_any_nan, numel, trees_st

pytestmark = [
    pytest.mark.skipif(not triton_select.interpreting(), reason="needs TRITON_INTERPRET=1"),
    # inf - inf is NaN and a sum beyond float16's range is inf, as in torch; the interpreter computes with numpy,
    # which warns about each (the results are checked against the brute force)
    pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter"),
]

TRITON = ft.sparse.KernelConfig(backend="triton")
add_ = triton_scatter.add_
DTYPES = (torch.float32, torch.float64, torch.float16)
SPECIAL = [0.0, -0.0, 1e-45, -6e-8, 1.0, -2.5, 65504.0, math.inf, -math.inf, math.nan]


def brute(tree, sparse: ft.SparseUpdates, scale: float):
    """``tree`` plus ``scale * sparse``: each coordinate found by walking the leaves, added as a 0-d tensor."""
    leaves, treedef = optree.tree_flatten(tree)
    values = sparse.values * scale
    out, start = [], 0
    for leaf in leaves:
        flat = leaf.reshape(-1).clone()
        for index, value in zip(sparse.indices.tolist(), values):
            if start <= index < start + leaf.numel():
                flat[index - start] = flat[index - start] + value.to(values.dtype).to(leaf.dtype)
        out.append(flat.view(leaf.shape))
        start += leaf.numel()
    return optree.tree_unflatten(treedef, out)


def _relayout(x: torch.Tensor, order: list[int]) -> torch.Tensor:
    return x.permute(order).contiguous().permute([order.index(i) for i in range(x.dim())])


def assert_adds_like_brute_force(tree, sparse: ft.SparseUpdates, scale: float = -0.5, served: bool = True) -> None:
    """The kernel (or, not ``served``, the ATen path) writes into the leaves themselves (strides kept) the brute
    force's bits."""
    want = brute(tree, sparse, scale)
    leaves = optree.tree_leaves(tree)
    strides = [x.stride() for x in leaves]
    ran = []
    with mock.patch.object(triton_scatter, "add_", lambda *args: ran.append(add_(*args)) or ran[-1]):
        assert ft.apply_sparse_updates_(tree, sparse, scale, config=TRITON) is tree
    assert ran == [served]
    assert [x.stride() for x in optree.tree_leaves(tree)] == strides
    for got, expected in zip(leaves, optree.tree_leaves(want)):
        assert got.dtype == expected.dtype and torch.equal(bits_any_nan(got), bits_any_nan(expected)), (got, expected)


@settings(max_examples=15)
@given(tree=trees_st(allow_nonfinite=True, dtypes=DTYPES, max_leaves=5), data=st.data())
def test_adds_like_the_brute_force(tree, data):
    n = numel(tree)
    if n == 0:
        return
    tree = optree.tree_map(lambda x: _relayout(x, data.draw(st.permutations(range(x.dim())), label="layout")), tree)
    chosen = sorted(data.draw(st.sets(st.integers(0, n - 1), min_size=1, max_size=min(n, 40)), label="indices"))
    dtype = data.draw(st.sampled_from(DTYPES), label="values dtype")
    values = data.draw(st.lists(st.sampled_from(SPECIAL) | st.floats(-10, 10), min_size=len(chosen),
                                max_size=len(chosen)), label="values")  # fmt: skip
    sparse = ft.SparseUpdates(torch.tensor(chosen), torch.tensor(values, dtype=torch.float64).to(dtype), n)
    assert_adds_like_brute_force(tree, sparse, data.draw(st.sampled_from([1.0, -0.5, 3.0]), label="scale"))


def _mixed_tree() -> dict:
    """Four dtypes of leaves in flat order, empty ones between, a channels_last and a transposed weight."""
    g = torch.Generator().manual_seed(0)
    return {
        "conv": torch.randn(4, 3, 2, 5, generator=g).to(memory_format=torch.channels_last),
        "empty": torch.zeros(0),
        "half": torch.randn(33, generator=g).half(),
        "t": torch.randn(6, 7, generator=g, dtype=torch.float64).t(),
        "empty2": torch.zeros(0, 3),
        "last": torch.randn(9, generator=g),
    }


def test_every_coordinate_of_a_mixed_tree_and_the_empty_update():
    tree = _mixed_tree()
    n = numel(tree)
    assert triton_layout.plan(optree.tree_leaves(tree)).source == "table"
    values = torch.linspace(-3.0, 3.0, n)
    assert_adds_like_brute_force(tree, ft.SparseUpdates(torch.arange(n), values, n))
    # the half leaf (flat 120 to 152, after conv's 120): beyond float16's range, just inside it, and a double
    # that rounds to half differently directly (up) and through float32, as torch converts it (to 1.0)
    values = torch.tensor([1e6, -7e4, 6e4, 1 + 2**-11 + 2**-40], dtype=torch.float64)
    half = tree["half"][12].clone()
    assert_adds_like_brute_force(tree, ft.SparseUpdates(torch.tensor([120, 121, 130, 132]), values, n), scale=1.0)
    assert tree["half"][0] == math.inf and tree["half"][1] == -math.inf and tree["half"][12] == half + 1.0
    before = optree.tree_map(torch.clone, tree)
    empty = ft.SparseUpdates(torch.zeros(0, dtype=torch.int64), torch.zeros(0), n)
    ft.apply_sparse_updates_(tree, empty, config=TRITON)
    assert all(torch.equal(a, b) for a, b in zip(optree.tree_leaves(tree), optree.tree_leaves(before)))


def test_infinities_and_overflow_give_what_torch_gives():
    tree = {"h": torch.tensor([math.inf, 65504.0, -0.0, 1.0], dtype=torch.float16), "s": torch.tensor([-math.inf, 2.0])}
    values = torch.tensor([-math.inf, 65504.0, 0.0, math.nan, math.inf, 3e38])
    assert_adds_like_brute_force(tree, ft.SparseUpdates(torch.arange(6), values, 6), scale=1.0)
    assert tree["h"][0].isnan() and tree["h"][1] == math.inf and tree["s"][0].isnan() and tree["s"][1] == 3e38


def test_leaves_of_one_flat_buffer_take_one_index_add():
    flat = torch.randn(300, generator=torch.Generator().manual_seed(1))
    tree = {"a": flat[:120].view(10, 12), "b": flat[120:121], "c": flat[121:]}
    assert triton_layout.plan(optree.tree_leaves(tree)).source == "flat"
    chosen = torch.tensor([0, 5, 119, 120, 121, 299])
    assert_adds_like_brute_force(tree, ft.SparseUpdates(chosen, torch.tensor([1.0, -2, 3, 4, 5, math.nan]), 300))


def test_leaves_with_gaps_are_left_to_the_aten_path():
    base = torch.zeros(20)
    tree = {"gaps": base[::2], "w": torch.zeros(4)}
    leaves = optree.tree_leaves(tree)
    sparse = ft.SparseUpdates(torch.tensor([1, 9, 12]), torch.tensor([1.0, 2.0, 3.0]), 14)
    assert not triton_scatter.add_(leaves, sparse.indices, sparse.values)  # nothing written
    assert not base.any()
    assert_adds_like_brute_force(tree, sparse, served=False)
    assert base[2] == -0.5 and base[18] == -1.0 and tree["w"][2] == -1.5
