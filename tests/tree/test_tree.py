"""FlatLayout, ravel/unravel and the foreach tree maths."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import functopk as ft
from functopk._checks import check_same_structure
from tests.helpers import assert_tree_bitwise_equal, clone_tree, real_device, to_device, trees_st


@given(trees_st())
def test_ravel_unravel_roundtrip(device, tree):
    tree = to_device(tree, device)
    layout = ft.tree.FlatLayout.from_tree(tree)
    assert layout.device == real_device(device)
    leaves = ft.tree.leaves(tree)
    assert layout.numel == sum(x.numel() for x in leaves)
    assert layout.num_leaves == len(leaves)
    assert layout.offsets[0] == 0 and layout.offsets[-1] == layout.numel
    flat = layout.ravel(tree)
    assert flat.dim() == 1 and flat.dtype == layout.common_dtype and flat.device == real_device(device)
    # the flat vector is the leaves concatenated in optree order
    expected = [x.reshape(-1).to(layout.common_dtype) for x in leaves]
    assert torch.equal(flat, torch.cat(expected)) if expected else flat.numel() == 0
    # every leaf type is exactly representable in the common dtype, so the round trip is exact
    assert_tree_bitwise_equal(layout.unravel(flat), tree)


def test_layout_records_structure_shapes_dtypes():
    tree = {"w": torch.zeros(2, 3), "b": torch.zeros((), dtype=torch.float64), "frozen": None, "t": (torch.zeros(0),)}
    layout = ft.tree.FlatLayout.from_tree(tree)
    assert layout.shapes == (torch.Size([]), torch.Size([0]), torch.Size([2, 3]))
    assert layout.numels == (1, 0, 6)  # sorted keys: b, t, w ("frozen" is None: no leaf)
    assert layout.offsets == (0, 1, 1, 7)
    assert layout.dtypes == (torch.float64, torch.float32, torch.float32)
    assert layout.common_dtype == torch.float64
    assert layout.device == torch.device("cpu")
    assert layout.leaf_paths() == ["['b']", "['t'][0]", "['w']"]
    out = layout.unravel(torch.arange(7.0, dtype=torch.float64))
    assert out["frozen"] is None and out["b"].dtype == torch.float64 and out["w"].dtype == torch.float32
    assert torch.equal(out["w"], torch.arange(1.0, 7.0).reshape(2, 3))


def test_unravel_views_without_copy_when_dtype_matches():
    tree = {"a": torch.zeros(2), "b": torch.zeros(3)}
    layout = ft.tree.FlatLayout.from_tree(tree)
    flat = torch.arange(5.0)
    out = layout.unravel(flat)
    assert out["a"].data_ptr() == flat.data_ptr()


def test_layout_rejects_mismatched_trees():
    layout = ft.tree.FlatLayout.from_tree({"a": torch.zeros(2)})
    with pytest.raises(ValueError, match="tree structure"):
        layout.ravel({"b": torch.zeros(2)})
    with pytest.raises(ValueError, match=r"has shape \(3,\), expected \(2,\)"):
        layout.ravel({"a": torch.zeros(3)})
    with pytest.raises(ValueError, match="1-d tensor of 2 elements"):
        layout.unravel(torch.zeros(3))
    with pytest.raises(TypeError, match="expected a torch.Tensor"):
        ft.tree.FlatLayout.from_tree({"a": 1.0})
    assert not layout.matches({"a": torch.zeros(2, dtype=torch.float64)})
    assert layout.matches({"a": torch.ones(2)})


def test_layout_device_check(device):
    other = "meta" if device == "cpu" else device
    layout = ft.tree.FlatLayout.from_tree({"a": torch.zeros(2), "b": torch.zeros(2, device=other)})
    with pytest.raises(ValueError, match="several devices"):
        _ = layout.device


def test_ravel_pytree(device):
    tree = to_device({"x": torch.tensor([1.0, 2.0]), "y": [torch.tensor([[3.0]])]}, device)
    flat, unravel = ft.tree.ravel(tree)
    assert torch.equal(flat, torch.tensor([1.0, 2.0, 3.0], device=device))
    assert_tree_bitwise_equal(unravel(flat), tree)


def assert_rounded_from(actual, terms):
    """``actual`` equals the exact (float64) sum of ``terms`` up to rounding of each term and of the sum.

    A reduced-precision result may round an intermediate product before adding, so
    the allowed error is a couple of ulps of the largest term, not of the result.
    """
    exact = sum(t.double() for t in terms)
    eps = torch.finfo(actual.dtype).eps
    bound = 2 * eps * sum(t.double().abs() for t in terms) + torch.finfo(actual.dtype).tiny
    finite = torch.isfinite(exact) & torch.isfinite(bound)
    assert actual.dtype == terms[0].dtype and actual.shape == terms[0].shape
    err = (actual.double() - exact).abs()
    assert bool((err[finite] <= bound[finite]).all()), (actual, exact)
    assert torch.equal(torch.isnan(actual[~finite]), torch.isnan(exact[~finite].to(actual.dtype)))


@given(trees_st(), st.floats(-4, 4, allow_nan=False, width=32))
def test_tree_maths_match_per_leaf_reference(device, tree, s):
    tree = to_device(tree, device)
    before = clone_tree(tree)
    leaves = ft.tree.leaves(tree)
    other = ft.tree.map(lambda x: torch.ones_like(x) * 0.5, tree)
    others = ft.tree.leaves(other)
    for out, x in zip(ft.tree.leaves(ft.tree.scale(tree, s)), leaves):
        torch.testing.assert_close(out, (x.double() * s).to(x.dtype), equal_nan=True)
    for out, x, y in zip(ft.tree.leaves(ft.tree.add(tree, other)), leaves, others):
        assert_rounded_from(out, [x, y])
    for scalar in (s, torch.tensor(s), torch.tensor(s, device=device)):  # a tensor scalar on the CPU or the device
        for out, x, y in zip(ft.tree.leaves(ft.tree.add_scaled(tree, scalar, other)), leaves, others):
            assert_rounded_from(out, [x, y.double() * s])
    zeros = ft.tree.zeros_like(tree)
    assert all(not z.any() and z.shape == x.shape for z, x in zip(ft.tree.leaves(zeros), leaves))
    assert_tree_bitwise_equal(tree, before)


def test_tree_add_structure_mismatch():
    with pytest.raises(ValueError, match="tree structure"):
        ft.tree.add({"a": torch.ones(1)}, {"b": torch.ones(1)})
    with pytest.raises(ValueError, match="tree structure"):
        check_same_structure({"a": torch.ones(1)}, [torch.ones(1)], name="updates", expected_name="the state")
