"""The topk transformation: the same selection as topk_sparsify, as a GradientTransformation."""

from __future__ import annotations

import math

import optree
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import functopk as ft
from functopk.sparse.kernels import triton_select
from tests.helpers import (
    assert_compiles_like_eager,
    assert_tree_bitwise_equal,
    bad_k_cases,
    clone_tree,
    non_float_leaves,
    numel,
    real_device,
    to_device,
    trees_st,
)

GOOD = {"w": torch.ones(3), "b": torch.ones(2)}


@settings(max_examples=40)
@given(tree=trees_st(), data=st.data())
def test_topk_transform_equals_function(device, tree, data):
    n = numel(tree)
    if n == 0:
        return
    k = data.draw(st.integers(1, n), label="k")
    dtree = to_device(tree, device)
    tx = ft.topk(k)
    state = tx.init(dtree)
    out, new_state = tx.update(dtree, state)
    assert new_state == state == ft.EmptyState()
    assert_tree_bitwise_equal(out, ft.topk_sparsify(dtree, k))
    assert_tree_bitwise_equal(ft.topk_indices(dtree, k).to_dense(dtree), out)
    assert_tree_bitwise_equal(to_device(out, "cpu"), ft.topk_sparsify(tree, k))  # the CPU's selection


def test_density_form(device):
    tree = {"w": torch.arange(200.0, device=device)}
    tx = ft.topk(density=0.05)
    out, _ = tx.update(tree, tx.init(tree))
    assert int((out["w"] != 0).sum()) == 10
    assert torch.equal(out["w"][-10:], torch.arange(190.0, 200.0, device=device))


def test_sparse_flag_is_gone():
    """A sparse update comes from topk_indices + apply_sparse_updates, not from a flag on the transformation."""
    with pytest.raises(TypeError, match="sparse"):
        ft.topk(2, sparse=True)


@pytest.mark.parametrize("k, exc, match", bad_k_cases("params"))
def test_bad_k(k, exc, match):
    before = clone_tree(GOOD)
    with pytest.raises(exc, match=match):
        tx = ft.topk(k)
        tx.init(GOOD)
    assert_tree_bitwise_equal(GOOD, before)


def test_k_too_large_for_the_updates_at_update_time():
    tx = ft.topk(4)
    state = tx.init(None)
    with pytest.raises(ValueError, match=r"k=4 exceeds the number of coordinates in updates \(3\)"):
        tx.update({"w": torch.ones(3)}, state)


def test_all_none_updates_say_so():
    tx = ft.topk(density=0.1)
    with pytest.raises(ValueError, match="updates has no coordinates.*were all gradients None"):
        tx.update({"w": None}, tx.init(None))


@pytest.mark.parametrize(
    "density, exc",
    [(0.0, ValueError), (1.5, ValueError), (-0.1, ValueError), (math.nan, ValueError), ("0.1", TypeError),
     (True, TypeError)],
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


@pytest.mark.parametrize("leaf", non_float_leaves())
def test_non_float_leaves_rejected(leaf):
    tree = {"w": torch.ones(3), "bad": leaf}
    tx = ft.topk(1)
    with pytest.raises(TypeError, match=r"updates leaf at \['bad'\] has dtype"):
        tx.update(tree, tx.init(None))


def test_unknown_method_rejected():
    with pytest.raises(ValueError, match="method must be one of"):
        ft.topk(1, method="fast")


def test_config_reaches_the_kernel_and_is_checked(device):
    """The tiny config runs the eager kernel's scan on the CPU; every backend selects the same coordinates."""
    g = torch.Generator().manual_seed(0)
    tree = to_device({"w": torch.randn(300, generator=g), "b": torch.randn(50, generator=g)}, device)
    tiny = ft.sparse.KernelConfig(exact_min_numel=0, segment=64, sample_size=16)
    for config in (tiny, ft.sparse.KernelConfig(backend="aten")):
        tx = ft.topk(17, config=config)
        assert_tree_bitwise_equal(tx.update(tree, tx.init(tree))[0], ft.topk_sparsify(tree, 17))
    if triton_select.available() and device == "cpu" and not triton_select.interpreting():
        tx = ft.topk(17, config=ft.sparse.KernelConfig(backend="triton"))  # reaches the kernel: says why not here
        with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
            tx.update(tree, tx.init(tree))
    with pytest.raises(TypeError, match="config must be a functopk.sparse.KernelConfig or None, got dict"):
        ft.topk(1, config={"backend": "aten"})


def test_nan_or_huge_tensor_k_and_density(device):
    grads = {"w": torch.tensor([1.0, -4.0, 2.0, 0.5], device=device)}
    for k in (torch.tensor(math.inf, device=device), torch.tensor(1e30, device=device)):
        out, _ = ft.topk(k).update(grads, ft.EmptyState())
        assert_tree_bitwise_equal(out, grads)  # k = n, not 1
    nan = torch.tensor(math.nan, device=device)
    for method in ("torch", "approx"):
        out, _ = ft.topk(nan, method=method).update(grads, ft.EmptyState())
        assert_tree_bitwise_equal(out, grads)
    if device == "cpu":
        with pytest.raises(ValueError, match="k is NaN"):  # the eager exact kernel reads k
            ft.topk(nan).update(grads, ft.EmptyState())
    else:  # off CPU "exact" is the static kernel: NaN keeps everything
        assert_tree_bitwise_equal(ft.topk(nan).update(grads, ft.EmptyState())[0], grads)
    for density in (math.nan, math.inf):
        out, _ = ft.topk(density=torch.tensor(density, device=device)).update(grads, ft.EmptyState())
        assert_tree_bitwise_equal(out, grads)


# --------------------------------------------------------------------------- schedules


@pytest.mark.parametrize("method", ["exact", "torch", "approx"])
def test_k_schedule_keeps_a_count_and_follows_it(device, method):
    grads = to_device({"a": torch.arange(1.0, 7.0).reshape(2, 3), "b": torch.tensor([-10.0, 0.5])}, device)
    tx = ft.topk(lambda count: 1 + 2 * count, method=method)
    state = tx.init(grads)
    assert isinstance(state, ft.compress.TopKState) and state.count.dtype == torch.int64
    assert state.count.device == real_device(device)
    for step in range(3):
        before = clone_tree(state)
        out, state = tx.update(grads, state)
        # the old state is not changed
        assert_tree_bitwise_equal(before, ft.compress.TopKState(count=torch.tensor(step, device=device)))
        if method != "approx":
            assert_tree_bitwise_equal(out, ft.topk_sparsify(grads, 1 + 2 * step))
        else:
            assert sum(int((x != 0).sum()) for x in optree.tree_leaves(out)) == 1 + 2 * step
    assert int(state.count) == 3


def test_density_schedule_and_injected_density(device):
    grads = {"w": torch.arange(1.0, 201.0, device=device)}
    tx = ft.topk(density=ft.linear_schedule(0.25, 0.05, transition_steps=2))
    state = tx.init(grads)
    counts = []
    for _ in range(4):
        out, state = tx.update(grads, state)
        counts.append(int((out["w"] != 0).sum()))
    assert counts == [50, 30, 10, 10]
    injected = ft.inject_hyperparams(ft.topk, static_args=("method",))(density=0.1)
    state = injected.init(grads)
    out, state = injected.update(grads, state)
    assert_tree_bitwise_equal(out, ft.topk_sparsify(grads, 20))
    assert state.hyperparams["density"].device == real_device(device)
    state = state._replace(hyperparams={"density": torch.tensor(0.02, device=device)})
    out, _ = injected.update(grads, state)
    assert_tree_bitwise_equal(out, ft.topk_sparsify(grads, 4))


def test_bad_schedule_output_and_state():
    tx = ft.topk(lambda count: "ten")
    with pytest.raises(TypeError, match="k schedule must return a number or a 0-d tensor"):
        tx.update(GOOD, tx.init(GOOD))
    with pytest.raises(TypeError, match="state must be a TopKState"):
        ft.topk(lambda c: 2).update(GOOD, ft.EmptyState())
    with pytest.raises(TypeError, match="k must be an int"):
        ft.topk(lambda c: 2.5).update(GOOD, ft.topk(lambda c: 2.5).init(GOOD))
    with pytest.raises(ValueError, match="density must be in"):
        ft.topk(density=lambda c: 1.5).update(GOOD, ft.topk(density=lambda c: 1.5).init(GOOD))



@pytest.mark.parametrize("make", [lambda: ft.topk(2), lambda: ft.topk(lambda c: 2), lambda: ft.randk(2)],
                         ids=["topk", "topk_scheduled", "randk"])
def test_topk_and_randk_ignore_params_at_update_alike(make):
    """One rule for both compressors: update neither needs nor reads params, so it does not check them."""
    tx = make()
    state = tx.init({"w": torch.zeros(3, 4)})
    for params in ({"w": torch.zeros(3, 4)}, {"v": torch.zeros(1, 4)}, None):
        out, _ = tx.update({"w": torch.ones(1, 4)}, state, params)
        assert int((out["w"] != 0).sum()) == 2


# --------------------------------------------------------------------------- compile


TREE = {"a": torch.randn(6, 5, generator=torch.Generator().manual_seed(0)), "b": torch.tensor([3.0, -0.1, 7.0]),
        "c": (torch.tensor([[-8.0, 0.2]], dtype=torch.float64), None)}


@pytest.mark.compile
@pytest.mark.slow
@pytest.mark.usefixtures("fresh_dynamo")
def test_scheduled_density_chain_compiles_without_recompiling():
    tx = ft.chain(ft.topk(density=ft.linear_schedule(0.5, 0.1, transition_steps=3)), ft.sgd(0.1))
    params = optree.tree_map(torch.zeros_like, TREE)
    calls, state = [], tx.init(params)
    for _ in range(3):
        grads = optree.tree_map(lambda x: torch.randn_like(x), TREE)
        calls.append((grads, state, params))
        state = tx.update(grads, state, params)[1]
    outs = assert_compiles_like_eager(tx.update, calls, bitwise=True)
    assert int(outs[-1][1][0].count) == 3
