"""error_feedback: mass conservation, a brute-force reference, the unit of the residual, compile."""

from __future__ import annotations

import math

import optree
import pytest
import torch
import torch._dynamo

import functopk as ft
from tests.compress.helpers import check_compiled
from tests.helpers import assert_tree_bitwise_equal, clone_tree, real_device, ref_leaf_topk_mask, to_device

SHAPES = [(6, 5), (7,), (2, 2, 3)]


def dyadic_tree(seed: int, dtype=torch.float64, device="cpu"):
    """Values k/64 with |k| <= 2000: sums of a few hundred of them are exact in fp64 (on any device)."""
    g = torch.Generator().manual_seed(seed)
    return {f"p{i}": (torch.randint(-2000, 2001, s, generator=g) / 64).to(dtype).to(device)
            for i, s in enumerate(SHAPES)}


def normal_tree(seed: int, dtype=torch.float32, device="cpu"):
    """The same values on every device (drawn on the CPU, then moved)."""
    g = torch.Generator().manual_seed(seed)
    return {f"p{i}": torch.randn(*s, generator=g).to(dtype).to(device) for i, s in enumerate(SHAPES)}


INNERS = {
    "topk": lambda: ft.topk(3),
    "topk-density": lambda: ft.topk(density=0.05),
    "randk": lambda: ft.randk(4, seed=1),
    "threshold": lambda: ft.threshold(20.0),
    "layerwise": lambda: ft.layerwise_topk(2, min_size=8),
}


@pytest.mark.parametrize("inner", INNERS, ids=list(INNERS))
def test_mass_is_conserved_exactly_in_fp64(device, inner):
    params = dyadic_tree(0, device=device)
    tx = ft.error_feedback(INNERS[inner]())
    state = tx.init(params)
    total_in = ft.tree.zeros_like(params)
    total_sent = ft.tree.zeros_like(params)
    sent_counts = []
    for t in range(120):
        g = dyadic_tree(t + 1, device=device)
        sent, state = tx.update(g, state, params)
        total_in = ft.tree.add(total_in, g)
        total_sent = ft.tree.add(total_sent, sent)
        sent_counts.append(sum(int((x != 0).sum()) for x in ft.tree.leaves(sent)))
    assert_tree_bitwise_equal(ft.tree.add(total_sent, state.residual), total_in)
    n = sum(math.prod(s) for s in SHAPES)
    assert 0 < sum(sent_counts) < 120 * n  # something was held back and something was sent
    assert any(bool((r != 0).any()) for r in ft.tree.leaves(state.residual))


def test_mass_is_conserved_in_fp32_to_rounding():
    params = normal_tree(0)
    tx = ft.error_feedback(ft.topk(density=0.05))
    state = tx.init(params)
    total_in = ft.tree.zeros_like(params, dtype=torch.float64)
    total_sent = ft.tree.zeros_like(params, dtype=torch.float64)
    steps = 300
    for t in range(steps):
        g = normal_tree(t + 1)
        sent, state = tx.update(g, state, params)
        total_in = ft.tree.map(lambda a, b: a + b.double(), total_in, g)
        total_sent = ft.tree.map(lambda a, b: a + b.double(), total_sent, sent)
    max_residual = max(float(r.abs().max()) for r in ft.tree.leaves(state.residual))
    assert max_residual > 1.0  # the residual really carried mass across steps
    # each step rounds corrected = g + residual once: |error| <= steps * eps32 * max|corrected|
    tol = steps * 2.0**-24 * (max_residual + 5.0)
    for s, r, i in zip(ft.tree.leaves(total_sent), ft.tree.leaves(state.residual), ft.tree.leaves(total_in)):
        assert float((s + r.double() - i).abs().max()) <= tol


def test_equals_brute_force_reference(device):
    params = normal_tree(0, device=device)
    k = 4
    tx = ft.error_feedback(ft.topk(k))
    state = tx.init(params)
    residual = ft.tree.zeros_like(params)
    names = sorted(params)
    for t in range(10):
        g = normal_tree(t + 1, device=device)
        before = clone_tree(g)
        state_before = clone_tree(state)
        sent, new_state = tx.update(g, state, params)
        assert_tree_bitwise_equal(g, before)  # pure
        assert_tree_bitwise_equal(state, state_before)
        state = new_state
        corrected = {n: g[n] + residual[n] for n in names}
        flat = torch.cat([corrected[n].reshape(-1) for n in names])
        mask = ref_leaf_topk_mask(flat, k).to(device)
        pieces = dict(zip(names, torch.split(mask, [corrected[n].numel() for n in names])))
        expected_sent = {n: torch.where(pieces[n].view(corrected[n].shape), corrected[n], 0.0) for n in names}
        residual = {n: torch.where(pieces[n].view(corrected[n].shape), 0.0, corrected[n]) for n in names}
        assert_tree_bitwise_equal(sent, expected_sent)
        assert_tree_bitwise_equal(state.residual, residual)


def test_parameter_unit_residual_tracks_sgd_exactly_under_a_schedule():
    """After scale_by_learning_rate, params + residual follow plain SGD exactly (the documented unit)."""
    lr = ft.piecewise_constant_schedule(0.5, {3: 0.5, 6: 0.25})  # dyadic learning rates
    params0 = dyadic_tree(0)
    lr_first = ft.chain(ft.scale_by_learning_rate(lr), ft.error_feedback(ft.topk(3)))
    lr_last = ft.chain(ft.error_feedback(ft.topk(3)), ft.scale_by_learning_rate(lr))
    p_first, p_last, p_sgd = params0, params0, params0
    s_first, s_last = lr_first.init(params0), lr_last.init(params0)
    for t in range(10):
        g = dyadic_tree(t + 1)
        u, s_first = lr_first.update(g, s_first, p_first)
        p_first = ft.apply_updates(p_first, u)
        u, s_last = lr_last.update(g, s_last, p_last)
        p_last = ft.apply_updates(p_last, u)
        p_sgd = ft.tree.add_scaled(p_sgd, -float(lr(t)), g)
    # parameter units: p + (-residual) ... the residual holds -lr * g not yet applied
    assert_tree_bitwise_equal(ft.tree.add(p_first, s_first[1].residual), p_sgd)
    # gradient units: the held-back gradient is applied at a later (smaller) learning rate, so the same
    # identity with the final learning rate does not hold
    lr_end = float(lr(10))
    gap = ft.tree.add_scaled(p_last, -lr_end, s_last[0].residual)
    assert any(not torch.equal(a, b) for a, b in zip(ft.tree.leaves(gap), ft.tree.leaves(p_sgd)))


def test_non_finite_input_stays_visible_in_the_residual(device):
    params = {"w": torch.zeros(4, device=device)}
    tx = ft.error_feedback(ft.topk(1))
    state = tx.init(params)
    sent, state = tx.update({"w": torch.tensor([1.0, float("nan"), 2.0, 0.5], device=device)}, state)
    assert math.isnan(float(sent["w"][1]))  # top-k ranks NaN first: it is sent
    assert math.isnan(float(state.residual["w"][1]))  # NaN - NaN: the residual keeps it
    assert state.residual["w"][[0, 2, 3]].tolist() == [1.0, 2.0, 0.5]
    sent, state = tx.update({"w": torch.zeros(4, device=device)}, state)
    assert math.isnan(float(sent["w"][1]))  # and it keeps reaching the updates


def test_none_leaves_and_dtypes_are_preserved(device):
    params = {"a": torch.zeros(5, dtype=torch.float16), "frozen": None, "b": torch.zeros(3, dtype=torch.float64)}
    params = to_device(params, device)
    tx = ft.error_feedback(ft.topk(2))
    state = tx.init(params)
    g = to_device({"a": torch.randn(5).half(), "frozen": None, "b": torch.randn(3, dtype=torch.float64)}, device)
    sent, state = tx.update(g, state)
    assert sent["frozen"] is None and state.residual["frozen"] is None
    assert sent["a"].device == state.residual["b"].device == real_device(device)
    assert sent["a"].dtype == state.residual["a"].dtype == torch.float16
    assert sent["b"].dtype == state.residual["b"].dtype == torch.float64


def test_errors():
    with pytest.raises(TypeError, match="inner must be a functopk.GradientTransformation"):
        ft.error_feedback(lambda g: g)
    tx = ft.error_feedback(ft.topk(1))
    with pytest.raises(ValueError, match="needs the parameters at init"):
        tx.init(None)
    state = tx.init({"w": torch.zeros(3)})
    with pytest.raises(ValueError, match="tree structure"):
        tx.update({"v": torch.zeros(3)}, state)
    with pytest.raises(ValueError, match="shape"):
        tx.update({"w": torch.zeros(4)}, state)
    with pytest.raises(TypeError, match="ErrorFeedbackState"):
        tx.update({"w": torch.zeros(3)}, ft.EmptyState())
    bad_inner = ft.stateless(lambda u, p: {"other": u["w"]})
    bad = ft.error_feedback(bad_inner)
    with pytest.raises(ValueError, match="inner transformation's output does not have the tree structure of its input"):
        bad.update({"w": torch.zeros(3)}, bad.init({"w": torch.zeros(3)}))


@pytest.mark.compile
def test_compiles_fullgraph_without_recompiling(fresh_dynamo):
    params = normal_tree(0)
    tx = ft.chain(ft.error_feedback(ft.topk(density=0.1, method="torch")), ft.sgd(0.1, momentum=0.9))
    state_c = check_compiled(tx, params)
    assert optree.tree_structure(state_c) == optree.tree_structure(tx.init(params))


def test_gradient_of_another_shape_is_an_error_naming_the_leaf_not_a_broadcast():
    tx = ft.error_feedback(ft.topk(2))
    state = tx.init({"layer": {"w": torch.zeros(3, 4)}})
    with pytest.raises(ValueError, match=r"updates leaf at \['layer'\]\['w'\] has shape \(1, 4\).*\(3, 4\)"):
        tx.update({"layer": {"w": torch.ones(1, 4)}}, state)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool])
def test_integer_gradients_are_a_type_error(dtype):
    tx = ft.error_feedback(ft.topk(1))
    state = tx.init({"w": torch.zeros(3)})
    with pytest.raises(TypeError, match=r"updates leaf at \['w'\] has dtype .*floating-point"):
        tx.update({"w": torch.ones(3, dtype=dtype)}, state)


def test_inner_output_of_another_shape_is_an_error():
    bad = ft.error_feedback(ft.stateless(lambda u, p: {"w": u["w"][:2]}))
    with pytest.raises(ValueError, match=r"inner transformation's output leaf at \['w'\] has shape \(2,\)"):
        bad.update({"w": torch.zeros(3)}, bad.init({"w": torch.zeros(3)}))
