"""topk_sparsify / topk_mask / topk against a brute-force, sort-based reference."""

from __future__ import annotations

import math

import optree
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import functopk as ft
from tests.conftest import assert_tree_bitwise_equal, bits, clone_tree

FLOAT_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
SHAPES = [(), (0,), (1,), (5,), (2, 3), (3, 1, 2), (4, 0), (7,), (2, 2, 2)]
TIE_VALUES = [0.0, -0.0, 0.5, -0.5, 1.0, -1.0, 2.0, -2.0, 3.0]


# --------------------------------------------------------------------------- reference


def reference_mask(tree, k):
    """Brute force: rank every coordinate by (-|x| with NaN as inf, flat index) with a Python sort."""
    leaves, treedef = optree.tree_flatten(tree)
    mags = []
    for leaf in leaves:
        for v in leaf.reshape(-1).double().tolist():
            mags.append(math.inf if math.isnan(v) else abs(v))
    order = sorted(range(len(mags)), key=lambda i: (-mags[i], i))
    keep = torch.zeros(len(mags), dtype=torch.bool)
    keep[order[:k]] = True
    out, start = [], 0
    for leaf in leaves:
        out.append(keep[start : start + leaf.numel()].reshape(leaf.shape))
        start += leaf.numel()
    return optree.tree_unflatten(treedef, out)


def reference_sparsify(tree, k):
    mask = reference_mask(tree, k)

    def keep(x, m):
        y = x.clone()
        y[~m] = 0.0
        return y

    return optree.tree_map(keep, tree, mask)


# --------------------------------------------------------------------------- strategies


@st.composite
def leaves_st(draw, dtype):
    shape = draw(st.sampled_from(SHAPES))
    n = math.prod(shape)
    values = draw(
        st.one_of(
            st.lists(st.sampled_from(TIE_VALUES), min_size=n, max_size=n),
            st.lists(st.floats(-1e3, 1e3, allow_nan=False, width=16), min_size=n, max_size=n),
            st.lists(st.floats(-1e6, 1e6, allow_nan=False, allow_infinity=False), min_size=n, max_size=n),
        )
    )
    return torch.tensor(values, dtype=torch.float64).to(dtype).reshape(shape)


@st.composite
def trees_st(draw, allow_nonfinite=False):
    """Random trees: 1-20 leaves, odd shapes, one or mixed dtypes, nesting and None nodes."""
    num_leaves = draw(st.integers(1, 20))
    mixed = draw(st.booleans())
    base_dtype = draw(st.sampled_from(FLOAT_DTYPES))
    tree = {}
    for i in range(num_leaves):
        dtype = draw(st.sampled_from(FLOAT_DTYPES)) if mixed else base_dtype
        leaf = draw(leaves_st(dtype))
        if allow_nonfinite and leaf.numel() and draw(st.booleans()):
            pos = draw(st.integers(0, leaf.numel() - 1))
            leaf.view(-1)[pos] = draw(st.sampled_from([math.nan, math.inf, -math.inf]))
        kind = draw(st.integers(0, 2))
        tree[f"p{i:02d}"] = leaf if kind == 0 else (leaf,) if kind == 1 else {"w": leaf, "frozen": None}
    if draw(st.booleans()):  # all-zero gradients
        tree = optree.tree_map(torch.zeros_like, tree)
    return tree


def numel(tree):
    return sum(x.numel() for x in optree.tree_leaves(tree))


# --------------------------------------------------------------------------- properties


@given(trees_st(allow_nonfinite=True), st.data())
def test_topk_sparsify_matches_bruteforce(tree, data):
    n = numel(tree)
    if n == 0:
        with pytest.raises(ValueError, match="exceeds"):
            ft.topk_sparsify(tree, 1)
        return
    k = data.draw(st.integers(1, n), label="k")
    before = clone_tree(tree)
    out = ft.topk_sparsify(tree, k)
    assert_tree_bitwise_equal(out, reference_sparsify(tree, k))
    assert_tree_bitwise_equal(tree, before)  # pure


@given(trees_st(allow_nonfinite=True), st.data())
def test_topk_mask_matches_bruteforce_and_has_exactly_k(tree, data):
    n = numel(tree)
    if n == 0:
        return
    k = data.draw(st.integers(1, n), label="k")
    mask = ft.topk_mask(tree, k)
    ref = reference_mask(tree, k)
    assert optree.tree_structure(mask) == optree.tree_structure(ref)
    for m, r in zip(optree.tree_leaves(mask), optree.tree_leaves(ref)):
        assert m.dtype == torch.bool and torch.equal(m, r)
    assert sum(int(m.sum()) for m in optree.tree_leaves(mask)) == k


@given(trees_st(), st.data())
def test_topk_transform_equals_function(tree, data):
    n = numel(tree)
    if n == 0:
        return
    k = data.draw(st.integers(1, n), label="k")
    tx = ft.topk(k)
    state = tx.init(tree)
    out, new_state = tx.update(tree, state)
    assert new_state == state == ft.EmptyState()
    assert_tree_bitwise_equal(out, ft.topk_sparsify(tree, k))


# --------------------------------------------------------------------------- hand-computed cases


def test_hand_computed_global_selection_across_leaves():
    grads = {"a": torch.tensor([[0.5, -2.0], [0.1, 3.0]]), "b": torch.tensor([-1.0, 2.5]), "c": None}
    out = ft.topk_sparsify(grads, 3)
    assert out["c"] is None
    assert torch.equal(out["a"], torch.tensor([[0.0, -2.0], [0.0, 3.0]]))
    assert torch.equal(out["b"], torch.tensor([0.0, 2.5]))


def test_ties_lower_flat_index_wins():
    # flat order: "a" (sorted key) then "b"; all magnitudes equal
    tree = {"b": torch.tensor([1.0, -1.0]), "a": torch.tensor([-1.0, 1.0, 1.0])}
    out = ft.topk_sparsify(tree, 4)
    assert torch.equal(out["a"], torch.tensor([-1.0, 1.0, 1.0]))
    assert torch.equal(out["b"], torch.tensor([1.0, 0.0]))


def test_all_zero_keeps_first_k_and_outputs_zeros():
    tree = {"a": torch.zeros(3), "b": torch.zeros(2, 2)}
    mask = ft.topk_mask(tree, 4)
    assert mask["a"].all() and mask["b"].reshape(-1).tolist() == [True, False, False, False]
    out = ft.topk_sparsify(tree, 4)
    assert all(not x.any() for x in optree.tree_leaves(out))


def test_mixed_dtypes_rank_in_common_dtype_and_keep_bits():
    half = torch.tensor([1.0009765625, 0.25], dtype=torch.float16)  # 1 + 2**-10, exact in fp16
    single = torch.tensor([1.0001, -7.0], dtype=torch.float32)
    bf = torch.tensor([-1.0078125], dtype=torch.bfloat16)  # 1 + 2**-7, exact in bf16
    out = ft.topk_sparsify({"h": half, "s": single, "b": bf}, 3)
    assert out["h"].dtype == torch.float16 and out["b"].dtype == torch.bfloat16
    assert torch.equal(bits(out["s"]), bits(torch.tensor([0.0, -7.0])))
    assert torch.equal(bits(out["b"]), bits(bf))
    assert torch.equal(bits(out["h"]), bits(torch.tensor([1.0009765625, 0.0], dtype=torch.float16)))


def test_nan_and_inf_are_selected_first_and_propagate():
    tree = {"a": torch.tensor([1.0, math.nan, -math.inf, 5.0]), "b": torch.tensor([math.inf, 100.0])}
    out = ft.topk_sparsify(tree, 3)
    # NaN and +-inf all rank as infinite magnitude; ties by flat index -> a[1], a[2], b[0]
    assert torch.equal(bits(out["a"]), bits(torch.tensor([0.0, math.nan, -math.inf, 0.0])))
    assert torch.equal(out["b"], torch.tensor([math.inf, 0.0]))
    out2 = ft.topk_sparsify(tree, 2)
    assert torch.isnan(out2["a"][1]) and out2["a"][2] == -math.inf and out2["b"][0] == 0


def test_output_preserves_dtype_shape_device_and_negative_zero():
    tree = {"z": torch.tensor([-0.0, 0.0]), "s": torch.tensor(4.0, dtype=torch.float64)}
    out = ft.topk_sparsify(tree, 2)
    assert out["s"].shape == () and out["s"].dtype == torch.float64
    assert torch.equal(bits(out["z"]), bits(torch.tensor([-0.0, 0.0])))  # -0.0 kept bit-exact


def test_density_form():
    tree = {"w": torch.arange(200.0)}
    tx = ft.topk(density=0.05)
    out, _ = tx.update(tree, tx.init(tree))
    assert int((out["w"] != 0).sum()) == 10
    assert torch.equal(out["w"][-10:], torch.arange(190.0, 200.0))
    assert ft.k_from_density(0.01, 25600) == 256
    assert ft.k_from_density(1.0, 7) == 7
    assert ft.k_from_density(1e-12, 7) == 1


def test_works_under_torch_func_grad():
    from torch.func import grad

    def loss(params):
        return (params["w"] ** 2).sum() + params["b"].sum()

    params = {"w": torch.tensor([1.0, -3.0, 2.0]), "b": torch.tensor([0.1])}
    g = grad(loss)(params)
    out = ft.topk_sparsify(g, 2)
    assert torch.equal(out["w"], torch.tensor([0.0, -6.0, 4.0])) and torch.equal(out["b"], torch.tensor([0.0]))


# --------------------------------------------------------------------------- bad input, one row each

GOOD = {"w": torch.ones(3), "b": torch.ones(2)}


@pytest.mark.parametrize(
    "k, exc, match",
    [
        (2.0, TypeError, "k must be an int"),
        (True, TypeError, "k must be an int"),
        (torch.tensor(2), TypeError, "k must be an int"),
        ("3", TypeError, "k must be an int"),
        (0, ValueError, "k must be >= 1"),
        (-1, ValueError, "k must be >= 1"),
        (6, ValueError, r"k=6 exceeds the number of coordinates in the tree \(5\)"),
    ],
    ids=["float", "bool", "tensor", "str", "zero", "negative", "too-large"],
)
def test_bad_k(k, exc, match):
    before = clone_tree(GOOD)
    with pytest.raises(exc, match=match):
        ft.topk_sparsify(GOOD, k)
    with pytest.raises(exc, match=match):
        ft.topk_mask(GOOD, k)
    with pytest.raises(exc, match=match):
        tx = ft.topk(k)
        tx.init(GOOD)
    assert_tree_bitwise_equal(GOOD, before)


def test_k_too_large_for_the_updates_at_update_time():
    tx = ft.topk(4)
    state = tx.init(None)
    with pytest.raises(ValueError, match="exceeds"):
        tx.update({"w": torch.ones(3)}, state)


@pytest.mark.parametrize(
    "density, exc",
    [(0.0, ValueError), (1.5, ValueError), (-0.1, ValueError), (math.nan, ValueError), ("0.1", TypeError), (True, TypeError)],
    ids=["zero", "above-one", "negative", "nan", "str", "bool"],
)
def test_bad_density(density, exc):
    with pytest.raises(exc, match="density"):
        ft.topk(density=density)


def test_k_and_density_exclusive():
    with pytest.raises(ValueError, match="exactly one of k or density"):
        ft.topk(3, density=0.1)
    with pytest.raises(ValueError, match="exactly one of k or density"):
        ft.topk()


@pytest.mark.parametrize(
    "leaf",
    [torch.ones(3, dtype=torch.int64), torch.ones(3, dtype=torch.bool), torch.ones(3, dtype=torch.complex64)],
    ids=["int", "bool", "complex"],
)
def test_non_float_leaves_rejected(leaf):
    tree = {"w": torch.ones(3), "bad": leaf}
    with pytest.raises(TypeError, match=r"leaf at \['bad'\] has dtype"):
        ft.topk_sparsify(tree, 1)
    tx = ft.topk(1)
    with pytest.raises(TypeError, match="dtype"):
        tx.update(tree, tx.init(None))


def test_non_tensor_leaf_rejected():
    with pytest.raises(TypeError, match="expected a torch.Tensor"):
        ft.topk_sparsify({"w": torch.ones(3), "x": 1.0}, 1)


def test_leaves_on_several_devices_rejected():
    tree = {"a": torch.ones(3), "b": torch.ones(3, device="meta")}
    with pytest.raises(ValueError, match="several devices"):
        ft.topk_sparsify(tree, 2)


def test_unknown_method_rejected():
    with pytest.raises(ValueError, match="method must be one of"):
        ft.topk_sparsify(GOOD, 1, method="fast")
    with pytest.raises(ValueError, match="method must be one of"):
        ft.topk(1, method="fast")
