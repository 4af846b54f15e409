"""Combinators and guards: masked, partition, clipping, zero_nans, apply_if_finite, multi_steps."""

from __future__ import annotations

import math

import optree
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import functopk as ft
from tests.helpers import assert_tree_bitwise_equal, assert_tree_close, clone_tree

PARAMS = {"conv": {"weight": torch.randn(3, 2, 2), "bias": torch.randn(3)}, "fc": (torch.randn(4, 3), torch.randn(4))}


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny tensors: one thread avoids OpenMP hand-offs on a busy 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def grads_at(i, like=PARAMS):
    g = torch.Generator().manual_seed(i)
    return ft.tree.map(lambda p: torch.randn(p.shape, generator=g), like)


def is_matrix(tree):
    return ft.tree.map(lambda x: x.dim() > 1, tree)


def sub(tree, keep):
    """The tree with the leaves where ``keep`` is False replaced by None (what an inner transform sees)."""
    return ft.tree.map(lambda x, k: x if k else None, tree, keep)


# ---------------------------------------------------------------- masked


@pytest.mark.parametrize("mask", [is_matrix(PARAMS), is_matrix], ids=["tree", "callable"])
def test_masked_equals_inner_on_selected_leaves_and_leaves_the_rest(mask):
    inner = ft.adam(0.1, weight_decay=0.01)
    tx = ft.masked(inner, mask)
    keep = is_matrix(PARAMS)
    state, ref_state = tx.init(PARAMS), inner.init(sub(PARAMS, keep))
    # the inner state holds tensors for the selected leaves only
    assert len(ft.tree.leaves(state.inner_state.mu)) == 2
    for i in range(3):
        g = grads_at(i)
        g0, s0 = clone_tree(g), clone_tree(state)
        updates, state = tx.update(g, state, PARAMS)
        ref_updates, ref_state = inner.update(sub(g, keep), ref_state, sub(PARAMS, keep))
        assert_tree_bitwise_equal(g, g0)
        assert_tree_bitwise_equal(s0, clone_tree(s0))
        assert updates["conv"]["bias"] is g["conv"]["bias"] and updates["fc"][1] is g["fc"][1]
        assert torch.equal(updates["conv"]["weight"], ref_updates["conv"]["weight"])
        assert torch.equal(updates["fc"][0], ref_updates["fc"][0])
    assert_tree_bitwise_equal(state.inner_state, ref_state)


def test_masked_errors():
    with pytest.raises(TypeError, match="inner must be a functopk.GradientTransformation"):
        ft.masked(lambda u: u, {"w": True})
    tx = ft.masked(ft.scale(2.0), {"conv": {"weight": True, "bias": 1}, "fc": (True, False)})
    with pytest.raises(TypeError, match=r"mask leaf at \['conv'\]\['bias'\] must be a Python bool, got int"):
        tx.init(PARAMS)
    tx = ft.masked(ft.scale(2.0), {"conv": True, "fc": (True, False)})
    with pytest.raises(ValueError, match=r"mask must have the structure of the parameters: leaf 0 is at \['conv'\] "):
        tx.init(PARAMS)
    tx = ft.masked(ft.scale(2.0), is_matrix)
    state = tx.init(PARAMS)
    with pytest.raises(TypeError, match=r"state must be a MaskedState \(the state masked's init returns\), got tuple"):
        tx.update(PARAMS, (state.inner_state,), PARAMS)
    with pytest.raises(ValueError, match=r"params does not have the tree structure of updates: .*\['fc'\]"):
        tx.update(PARAMS, state, {"conv": PARAMS["conv"]})


# ---------------------------------------------------------------- partition


def test_partition_sends_each_group_to_its_transform():
    """Like torch.optim parameter groups: matrices get AdamW, vectors SGD with momentum."""
    labels = ft.tree.map(lambda x: "decay" if x.dim() > 1 else "plain", PARAMS)
    txs = {"decay": ft.adamw(0.01, weight_decay=0.1), "plain": ft.sgd(0.1, momentum=0.9)}
    tx = ft.partition(txs, lambda p: ft.tree.map(lambda x: "decay" if x.dim() > 1 else "plain", p))
    state = tx.init(PARAMS)
    assert set(state) == {"decay", "plain"}
    keep = {name: ft.tree.map(lambda lab: lab == name, labels) for name in txs}
    refs = {name: t.init(sub(PARAMS, keep[name])) for name, t in txs.items()}
    for i in range(3):
        g = grads_at(i)
        s0 = clone_tree(state)
        updates, new_state = tx.update(g, state, PARAMS)
        assert_tree_bitwise_equal(state, s0)
        state = new_state
        for name, t in txs.items():
            ref_u, refs[name] = t.update(sub(g, keep[name]), refs[name], sub(PARAMS, keep[name]))
            for u, r, k in zip(ft.tree.leaves(updates), _full_leaves(ref_u, keep[name]), ft.tree.leaves(keep[name])):
                if k:
                    assert torch.equal(u, r)
    for name in txs:
        assert_tree_bitwise_equal(state[name], refs[name])


def _full_leaves(sub_tree, keep):
    """Leaves of a sub-tree in the full tree's positions (None where not kept)."""
    return optree.tree_structure(keep).flatten_up_to(sub_tree)


def test_partition_errors():
    with pytest.raises(TypeError, match="non-empty dict"):
        ft.partition({}, {})
    tx = ft.partition({"a": ft.sgd(0.1)}, ft.tree.map(lambda x: "b", PARAMS))
    with pytest.raises(ValueError, match=r"param_labels leaf at \['conv'\]\['bias'\] is 'b', which is not a key"):
        tx.init(PARAMS)
    tx = ft.partition({"a": ft.sgd(0.1)}, ft.tree.map(lambda x: "a", PARAMS))
    state = tx.init(PARAMS)
    with pytest.raises(TypeError, match=r"state must be a dict with keys \[\"'a'\"\] \(the state partition's init"):
        tx.update(PARAMS, {"b": state["a"]}, PARAMS)
    with pytest.raises(TypeError, match="state must be a dict with keys .* got tuple"):
        tx.update(PARAMS, (state["a"],), PARAMS)
    with pytest.raises(ValueError, match=r"param_labels must have the structure .*: leaf 0 is at \['conv'\]"):
        ft.partition({"a": ft.sgd(0.1)}, {"conv": "a", "fc": "a"}).init(PARAMS)
    with pytest.raises(ValueError, match=r"params does not have the tree structure of updates: .*\['fc'\]"):
        tx.update(PARAMS, state, {"conv": PARAMS["conv"]})


# ---------------------------------------------------------------- clipping


@given(
    st.lists(st.floats(-1e3, 1e3, allow_nan=False, width=32), min_size=1, max_size=20),
    st.floats(0.0, 100.0, allow_nan=False, width=32),
)
def test_clip_by_global_norm_bound_and_identity_below(values, max_norm):
    x = torch.tensor(values)
    tree = {"a": x[: len(values) // 2], "b": x[len(values) // 2 :].reshape(-1, 1)}
    tx = ft.clip_by_global_norm(max_norm)
    out, _ = tx.update(tree, tx.init(None))
    flat = torch.cat([out["a"], out["b"].reshape(-1)]).double()
    norm = float(torch.linalg.vector_norm(x.double()))
    # measured in float64: squaring tiny float32 outputs (max_norm near 1e-38) would underflow
    assert float(torch.linalg.vector_norm(flat)) <= max_norm * (1 + 1e-6) + 1e-30
    if norm + 1e-6 <= max_norm:  # torch's rule: factor min(1, max / (norm + 1e-6)) is 1
        assert_tree_bitwise_equal(out, tree)
    else:  # scaled down: float64 reference of x * max_norm / (norm + 1e-6)
        expected = x.double() * (max_norm / (norm + 1e-6))
        # float32 rounding is relative for normal numbers; below 2**-126 (max_norm near
        # 1e-38) the factor and the products are subnormal and carry absolute errors of
        # up to 2**-150 each, the factor's scaled by |x| <= 1e3
        atol = 2.0**-150 * (1 + 1e3)
        torch.testing.assert_close(flat, expected, rtol=1e-5, atol=atol)


def test_clip_by_global_norm_matches_torch_clip_grad_norm():
    grads = grads_at(0)
    tensors = [torch.zeros_like(g, requires_grad=True) for g in ft.tree.leaves(grads)]
    for t, g in zip(tensors, ft.tree.leaves(grads)):
        t.grad = g.clone()
    total = torch.nn.utils.clip_grad_norm_(tensors, 0.5, foreach=True)
    tensors = [t.grad for t in tensors]
    tx = ft.clip_by_global_norm(0.5)
    out, _ = tx.update(grads, tx.init(None))
    torch.testing.assert_close(ft.tree.norm(grads), total, rtol=1e-6, atol=0)
    for a, b in zip(ft.tree.leaves(out), tensors):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-8)
    # below the bound: returned unchanged
    loose = ft.clip_by_global_norm(10.0)
    assert_tree_bitwise_equal(loose.update(grads, loose.init(None))[0], grads)


def test_global_norm_half_precision_does_not_overflow():
    tree = {"h": torch.full((4,), 60000.0, dtype=torch.float16), "b": torch.full((2,), 3e4, dtype=torch.bfloat16)}
    expected = math.sqrt(4 * 60000.0**2 + 2 * 3e4**2)
    assert float(ft.tree.norm(tree)) == pytest.approx(expected, rel=1e-2)
    assert ft.tree.norm(tree).dtype == torch.float32


@given(
    st.lists(st.floats(-1e6, 1e6, allow_nan=False, width=32), min_size=1, max_size=20),
    st.floats(0.0, 10.0, width=32),
)
def test_clip_bounds_each_coordinate(values, max_delta):
    x = torch.tensor(values)
    for tx in (ft.clip(max_delta), ft.inject_hyperparams(ft.clip)(max_delta=max_delta)):
        out, _ = tx.update({"x": x}, tx.init({"x": x}))
        assert torch.equal(out["x"], x.clamp(-max_delta, max_delta))


def test_clip_and_zero_nans_non_finite():
    x = {"x": torch.tensor([math.nan, math.inf, -math.inf, -5.0, 0.5])}
    out, _ = ft.clip(1.0).update(x, ())
    assert torch.equal(out["x"][1:], torch.tensor([1.0, -1.0, -1.0, 0.5])) and out["x"][0].isnan()
    out, _ = ft.zero_nans().update(x, ())
    assert torch.equal(out["x"], torch.tensor([0.0, math.inf, -math.inf, -5.0, 0.5]))
    out, _ = ft.clip_by_global_norm(1.0).update({"x": torch.tensor([1.0, math.nan])}, ())
    assert out["x"].isnan().all()


def test_all_finite():
    assert bool(ft.tree.all_finite(PARAMS))
    for bad in (math.nan, math.inf, -math.inf):
        tree = clone_tree(PARAMS)
        tree["fc"][1][2] = bad
        assert not bool(ft.tree.all_finite(tree))
    # finite float16 values at the top of the range are finite (no overflow in the check)
    assert bool(ft.tree.all_finite({"h": torch.full((3,), 65504.0, dtype=torch.float16)}))
    assert bool(ft.tree.all_finite({}))


# ---------------------------------------------------------------- apply_if_finite


def with_nan(g):
    g = clone_tree(g)
    g["conv"]["bias"][1] = math.nan
    return g


def test_apply_if_finite_skips_nan_steps_and_keeps_inner_state():
    inner = ft.adam(0.1)
    tx = ft.apply_if_finite(inner)
    state, ref = tx.init(PARAMS), inner.init(PARAMS)
    for i in range(6):
        g = grads_at(i)
        bad = i in (1, 2, 4)
        s0 = clone_tree(state)
        updates, state_new = tx.update(with_nan(g) if bad else g, state, PARAMS)
        assert_tree_bitwise_equal(state, s0)
        if bad:
            assert all(torch.equal(u, torch.zeros_like(u)) for u in ft.tree.leaves(updates))
            assert_tree_bitwise_equal(state_new.inner_state, state.inner_state)
        else:
            ref_u, ref = inner.update(g, ref, PARAMS)
            assert_tree_bitwise_equal(updates, ref_u)
            assert_tree_bitwise_equal(state_new.inner_state, ref)
        assert bool(state_new.last_finite) != bad
        state = state_new
    assert int(state.total_notfinite) == 3 and int(state.notfinite_count) == 0
    assert int(state.inner_state.count) == 3


def test_apply_if_finite_max_consecutive_errors():
    tx = ft.apply_if_finite(ft.sgd(1.0), max_consecutive_errors=2)
    state = tx.init(PARAMS)
    applied = []
    for _ in range(4):
        updates, state = tx.update(with_nan(grads_at(0)), state, PARAMS)
        applied.append(bool(updates["conv"]["bias"][1].isnan()))
    # two skipped, then applied anyway, then the count keeps growing (still applied)
    assert applied == [False, False, True, True]
    assert int(state.notfinite_count) == 4 and int(state.total_notfinite) == 4
    with pytest.raises(ValueError, match="max_consecutive_errors must be >= 0"):
        ft.apply_if_finite(ft.sgd(1.0), -1)
    with pytest.raises(TypeError, match="max_consecutive_errors must be an int"):
        ft.apply_if_finite(ft.sgd(1.0), 1.5)


# ---------------------------------------------------------------- multi_steps


@pytest.mark.parametrize("k", [1, 3])
def test_multi_steps_equals_inner_on_mean_gradients(k):
    inner = ft.adamw(0.05, weight_decay=0.1)
    tx = ft.multi_steps(inner, every_k=k)
    params, ref_params = clone_tree(PARAMS), clone_tree(PARAMS)
    state, ref = tx.init(params), inner.init(params)
    for big in range(3):
        gs = [grads_at(10 * big + j) for j in range(k)]
        for j, g in enumerate(gs):
            s0 = clone_tree(state)
            updates, new_state = tx.update(g, state, params)
            assert_tree_bitwise_equal(state, s0)
            if j < k - 1:
                assert all(not u.any() for u in ft.tree.leaves(updates))
                assert_tree_bitwise_equal(new_state.inner_state, state.inner_state)
            state = new_state
            params = ft.apply_updates(params, updates)
        mean = ft.tree.map(lambda *xs: sum(xs) / k, *gs)
        ref_u, ref = inner.update(mean, ref, ref_params)
        ref_params = ft.apply_updates(ref_params, ref_u)
        assert_tree_close(params, ref_params, rtol=1e-6, atol=1e-7)
        assert int(state.mini_step) == 0 and int(state.gradient_step) == big + 1
        assert all(not a.any() for a in ft.tree.leaves(state.acc_grads))


def test_multi_steps_errors():
    with pytest.raises(ValueError, match="every_k must be >= 1"):
        ft.multi_steps(ft.sgd(0.1), 0)
    with pytest.raises(TypeError, match="every_k must be an int"):
        ft.multi_steps(ft.sgd(0.1), 2.5)
    tx = ft.multi_steps(ft.sgd(0.1), 2)
    with pytest.raises(ValueError, match="MultiStepsState"):
        tx.update(PARAMS, (), PARAMS)
