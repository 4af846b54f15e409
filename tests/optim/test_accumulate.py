"""multi_steps: gradient accumulation against the inner optimizer on mean gradients."""

from __future__ import annotations

import pytest
import torch

import functopk as ft
from tests.helpers import assert_tree_bitwise_equal, assert_tree_close, clone_tree, to_device

PARAMS = {"conv": {"weight": torch.randn(3, 2, 2), "bias": torch.randn(3)}, "fc": (torch.randn(4, 3), torch.randn(4))}


def grads_at(i, like=PARAMS):
    g = torch.Generator().manual_seed(i)
    return ft.tree.map(lambda p: torch.randn(p.shape, generator=g), like)


# ---------------------------------------------------------------- multi_steps


@pytest.mark.parametrize("k", [1, 3])
def test_multi_steps_equals_inner_on_mean_gradients(device, k):
    inner = ft.adamw(0.05, weight_decay=0.1)
    tx = ft.multi_steps(inner, every_k=k)
    params, ref_params = to_device(PARAMS, device), to_device(PARAMS, device)
    state, ref = tx.init(params), inner.init(params)
    for big in range(3):
        gs = [to_device(grads_at(10 * big + j), device) for j in range(k)]
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
    with pytest.raises(TypeError, match=r"state must be a MultiStepsState \(the state multi_steps's init returns\)"):
        tx.update(PARAMS, (), PARAMS)
    with pytest.raises(ValueError, match="updates does not have the tree structure of multi_steps's accumulated"):
        tx.update({"conv": PARAMS["conv"]}, tx.init(PARAMS), PARAMS)
    with pytest.raises(TypeError, match="every_k must be an int or a 0-d tensor"):
        ft.multi_steps(ft.sgd(0.1), torch.ones(2))
    with pytest.raises(TypeError, match="inner must be a functopk.GradientTransformation"):
        ft.multi_steps(ft.sgd, 2)


def test_multi_steps_with_injected_integer_every_k():
    """every_k injected as an int64 tensor: same results as the plain int."""
    plain = ft.multi_steps(ft.sgd(0.1, momentum=0.9), every_k=3)
    injected = ft.inject_hyperparams(ft.multi_steps)(inner=ft.sgd(0.1, momentum=0.9), every_k=3)
    s1, s2 = plain.init(PARAMS), injected.init(PARAMS)
    assert s2.hyperparams["every_k"].dtype == torch.int64
    for i in range(7):
        u1, s1 = plain.update(grads_at(i), s1, PARAMS)
        u2, s2 = injected.update(grads_at(i), s2, PARAMS)
        assert_tree_bitwise_equal(u2, u1)
    assert_tree_bitwise_equal(s2.inner_state, s1)
