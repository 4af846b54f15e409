"""clip, clip_by_global_norm, zero_nans, apply_if_finite (and the tree norm and finiteness check they use)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import functopk as ft
from tests.helpers import assert_tree_bitwise_equal, clone_tree, to_device

PARAMS = {"conv": {"weight": torch.randn(3, 2, 2), "bias": torch.randn(3)}, "fc": (torch.randn(4, 3), torch.randn(4))}


def grads_at(i, like=PARAMS):
    g = torch.Generator().manual_seed(i)
    return ft.tree.map(lambda p: torch.randn(p.shape, generator=g), like)


# ---------------------------------------------------------------- clipping


@given(
    st.lists(st.floats(-1e3, 1e3, allow_nan=False, width=32), min_size=1, max_size=20),
    st.floats(0.0, 100.0, allow_nan=False, width=32),
)
def test_clip_by_global_norm_bound_and_identity_below(device, values, max_norm):
    x = torch.tensor(values)
    tree = to_device({"a": x[: len(values) // 2], "b": x[len(values) // 2 :].reshape(-1, 1)}, device)
    tx = ft.clip_by_global_norm(max_norm)
    out, _ = tx.update(tree, tx.init(None))
    flat = torch.cat([out["a"], out["b"].reshape(-1)]).double().cpu()
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


def test_clip_by_global_norm_matches_torch_clip_grad_norm(device):
    grads = to_device(grads_at(0), device)  # torch's clip_grad_norm_ on the same device
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


def test_global_norm_half_precision_does_not_overflow(device):
    tree = {"h": torch.full((4,), 60000.0, dtype=torch.float16, device=device),
            "b": torch.full((2,), 3e4, dtype=torch.bfloat16, device=device)}
    expected = math.sqrt(4 * 60000.0**2 + 2 * 3e4**2)
    assert float(ft.tree.norm(tree)) == pytest.approx(expected, rel=1e-2)
    assert ft.tree.norm(tree).dtype == torch.float32


@given(
    st.lists(st.floats(-1e6, 1e6, allow_nan=False, width=32), min_size=1, max_size=20),
    st.floats(0.0, 10.0, width=32),
)
def test_clip_bounds_each_coordinate(device, values, max_delta):
    x = torch.tensor(values, device=device)
    for tx in (ft.clip(max_delta), ft.inject_hyperparams(ft.clip)(max_delta=max_delta)):
        out, _ = tx.update({"x": x}, tx.init({"x": x}))
        assert torch.equal(out["x"], x.clamp(-max_delta, max_delta))


def test_clip_and_zero_nans_non_finite(device):
    x = {"x": torch.tensor([math.nan, math.inf, -math.inf, -5.0, 0.5], device=device)}
    out, _ = ft.clip(1.0).update(x, ft.EmptyState())
    assert torch.equal(out["x"][1:].cpu(), torch.tensor([1.0, -1.0, -1.0, 0.5])) and out["x"][0].isnan()
    out, _ = ft.zero_nans().update(x, ft.EmptyState())
    assert torch.equal(out["x"].cpu(), torch.tensor([0.0, math.inf, -math.inf, -5.0, 0.5]))
    out, _ = ft.clip_by_global_norm(1.0).update({"x": torch.tensor([1.0, math.nan], device=device)}, ft.EmptyState())
    assert out["x"].isnan().all()


def test_all_finite(device):
    params = to_device(PARAMS, device)
    assert bool(ft.tree.all_finite(params))
    for bad in (math.nan, math.inf, -math.inf):
        tree = clone_tree(params)
        tree["fc"][1][2] = bad
        assert not bool(ft.tree.all_finite(tree))
    # finite float16 values at the top of the range are finite (no overflow in the check)
    assert bool(ft.tree.all_finite({"h": torch.full((3,), 65504.0, dtype=torch.float16, device=device)}))
    assert bool(ft.tree.all_finite({}))


# ---------------------------------------------------------------- apply_if_finite


def with_nan(g):
    g = clone_tree(g)
    g["conv"]["bias"][1] = math.nan
    return g


def test_apply_if_finite_skips_nan_steps_and_keeps_inner_state(device):
    inner = ft.adam(0.1)
    tx = ft.apply_if_finite(inner)
    params = to_device(PARAMS, device)
    state, ref = tx.init(params), inner.init(params)
    for i in range(6):
        g = to_device(grads_at(i), device)
        bad = i in (1, 2, 4)
        s0 = clone_tree(state)
        updates, state_new = tx.update(with_nan(g) if bad else g, state, params)
        assert_tree_bitwise_equal(state, s0)
        if bad:
            assert all(torch.equal(u, torch.zeros_like(u)) for u in ft.tree.leaves(updates))
            assert_tree_bitwise_equal(state_new.inner_state, state.inner_state)
        else:
            ref_u, ref = inner.update(g, ref, params)
            assert_tree_bitwise_equal(updates, ref_u)
            assert_tree_bitwise_equal(state_new.inner_state, ref)
        assert bool(state_new.last_finite) != bad
        state = state_new
    assert int(state.total_notfinite) == 3 and int(state.notfinite_count) == 0
    assert int(state.inner_state.count) == 3


def test_apply_if_finite_steps_a_tree_with_a_leaf_without_elements():
    tx = ft.apply_if_finite(ft.sgd(0.1, momentum=0.9), 3)
    params = {"empty": torch.zeros(0, 4), "w": torch.ones(2)}
    state = tx.init(params)
    updates, state = tx.update({"empty": torch.zeros(0, 4), "w": torch.tensor([1.0, 2.0])}, state, params)
    assert updates["empty"].shape == (0, 4) and updates["w"].tolist() == pytest.approx([-0.1, -0.2])
    assert int(state.notfinite_count) == 0
    updates, state = tx.update({"empty": torch.zeros(0, 4), "w": torch.tensor([math.nan, 2.0])}, state, params)
    assert updates["w"].tolist() == [0.0, 0.0] and int(state.notfinite_count) == 1


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




def test_apply_if_finite_errors():
    tx = ft.apply_if_finite(ft.adam(0.1))
    with pytest.raises(TypeError, match=r"state must be a ApplyIfFiniteState \(the state apply_if_finite's init"):
        tx.update(PARAMS, ft.adam(0.1).init(PARAMS), PARAMS)
    with pytest.raises(TypeError, match="inner must be a functopk.GradientTransformation"):
        ft.apply_if_finite(lambda u: u)
    with pytest.raises(TypeError, match="max_consecutive_errors must be an int or a 0-d tensor"):
        ft.apply_if_finite(ft.sgd(1.0), torch.ones(2))

    bad = ft.GradientTransformation(lambda p: (), lambda u, s, p=None: (u, (torch.zeros(()),)))
    with pytest.raises(ValueError, match="the inner transformation's new state does not have the tree structure"):
        ft.apply_if_finite(bad).update(PARAMS, ft.apply_if_finite(bad).init(PARAMS), PARAMS)


def test_stateless_guards_check_their_state():
    for tx in (ft.clip(1.0), ft.clip_by_global_norm(1.0), ft.zero_nans()):
        with pytest.raises(TypeError, match="state must be a EmptyState"):
            tx.update(PARAMS, ft.trace(0.9).init(PARAMS))
