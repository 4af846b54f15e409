"""Elementary transforms (scale, schedules, learning rate, trace, weight decay): hand-computed values, purity.

Parity of the optimizers with torch.optim is in test_alias.py; the table of every
transformation (purity, stable states, injection, compilation, bad inputs) in
test_contracts.py.
"""

from __future__ import annotations

import pytest
import torch

import functopk as ft
from tests.helpers import assert_tree_bitwise_equal, clone_tree, real_device, to_device
from tests.optim.common import GRADS, PARAMS, grads_at, run_pure


def run_pure_on(device, tx):
    """:func:`run_pure` on ``device``; the final updates and state come back on the CPU."""
    updates, state = run_pure(tx, to_device(PARAMS, device), to_device(GRADS, device))
    assert all(x.device == real_device(device) for x in ft.tree.leaves(updates))
    return to_device(updates, "cpu"), to_device(state, "cpu")


def test_scale(device):
    updates, _ = run_pure_on(device, ft.scale(-3.0))
    assert torch.equal(updates["w"], torch.tensor([-1.5, -0.75, 3.0]))
    assert updates["b"].dtype == torch.float64


def test_scale_by_learning_rate_constant_and_sign(device):
    updates, _ = run_pure_on(device, ft.scale_by_learning_rate(0.1))
    torch.testing.assert_close(updates["w"], torch.tensor([-0.05, -0.025, 0.1]))
    updates, _ = run_pure_on(device, ft.scale_by_learning_rate(0.1, flip_sign=False))
    torch.testing.assert_close(updates["w"], torch.tensor([0.05, 0.025, -0.1]))


@pytest.mark.parametrize("flip_sign", [True, False])
def test_scale_by_learning_rate_reads_a_tensor_at_every_update(flip_sign):
    # a scheduler changes a tensor lr in place: the next update must use the new value
    lr = torch.tensor(0.1)
    tx = ft.scale_by_learning_rate(lr, flip_sign=flip_sign)
    grads = {"w": torch.tensor([1.0, -2.0])}
    sign = -1.0 if flip_sign else 1.0
    assert torch.equal(tx.update(grads, tx.init(None))[0]["w"], sign * lr * grads["w"])
    lr.fill_(0.5)
    assert torch.equal(tx.update(grads, tx.init(None))[0]["w"], sign * 0.5 * grads["w"])


def test_sgd_alias_reads_its_tensor_lr_at_every_update():
    lr = torch.tensor(0.1)
    tx = ft.sgd(lr, momentum=0.9)
    params = {"w": torch.tensor([1.0])}
    state = tx.init(params)
    lr.fill_(0.0)
    updates, _ = tx.update({"w": torch.tensor([1.0])}, state, params)
    assert torch.equal(updates["w"], torch.zeros(1))


def test_scale_by_schedule_uses_tensor_step_counter(device):
    seen = []

    def schedule(count):
        seen.append(count)
        return 1.0 / (count + 1)

    tx = ft.scale_by_schedule(schedule)
    state = tx.init(to_device(PARAMS, device))
    assert state.count.dtype == torch.int64 and state.count.shape == ()
    assert state.count.device == real_device(device)
    outs = []
    for _ in range(3):
        updates, state = tx.update(to_device(GRADS, device), state)
        outs.append(updates["w"][0].item())
    assert outs == pytest.approx([0.5, 0.25, 0.5 / 3])
    assert all(isinstance(c, torch.Tensor) for c in seen)
    assert int(state.count) == 3


def test_scale_keeps_leaf_dtypes_with_tensor_scalars(device):
    params = to_device({"h": torch.tensor(2.0, dtype=torch.float16), "v": torch.ones(3, dtype=torch.bfloat16)}, device)
    for where in dict.fromkeys(("cpu", device)):  # a schedule may return a CPU tensor for device leaves
        tx = ft.scale_by_learning_rate(lambda c, w=where: torch.tensor(0.5, device=w))
        updates, _ = tx.update(params, tx.init(params))
        assert updates["h"].dtype == torch.float16 and updates["v"].dtype == torch.bfloat16
        assert updates["h"].item() == -1.0 and updates["v"].device == real_device(device)


@pytest.mark.parametrize("nesterov", [False, True])
def test_trace_hand_computed(device, nesterov):
    tx = ft.trace(0.5, nesterov=nesterov)
    state = tx.init(to_device(PARAMS, device))
    g1 = {"w": torch.tensor([1.0, 0.0, 0.0]), "b": torch.tensor(0.0, dtype=torch.float64)}
    g2 = {"w": torch.tensor([0.0, 1.0, 0.0]), "b": torch.tensor(1.0, dtype=torch.float64)}
    u1, state = tx.update(to_device(g1, device), state)
    u2, state = tx.update(to_device(g2, device), state)
    u1, u2, state = to_device((u1, u2, state), "cpu")
    # trace after 2 steps: g2 + 0.5 * g1
    assert torch.equal(state.trace["w"], torch.tensor([0.5, 1.0, 0.0]))
    if nesterov:
        assert torch.equal(u1["w"], torch.tensor([1.5, 0.0, 0.0]))
        assert torch.equal(u2["w"], torch.tensor([0.25, 1.5, 0.0]))
    else:
        assert torch.equal(u2["w"], state.trace["w"])
    run_pure_on(device, tx)


def test_trace_dampening_first_step_undamped_then_damped(device):
    """torch.optim.SGD's rule: buf = g on the first step, then m * buf + (1 - d) * g."""
    m, d = 0.9, 0.25
    tx = ft.trace(m, dampening=d)
    state = tx.init(to_device(PARAMS, device))
    buf = None
    for i in range(4):
        g = grads_at(i)
        updates, state = tx.update(to_device(g, device), state)
        updates, trace = to_device((updates, state.trace), "cpu")
        buf = g["w"].clone() if buf is None else m * buf + (1 - d) * g["w"]
        torch.testing.assert_close(updates["w"], buf, rtol=1e-6, atol=0)
        torch.testing.assert_close(trace["w"], buf, rtol=1e-6, atol=0)
    assert int(state.count) == 4
    with pytest.raises(ValueError, match="nesterov=True needs dampening == 0"):
        ft.trace(0.9, nesterov=True, dampening=0.1)


def test_trace_rejects_structure_mismatch_without_changing_state():
    tx = ft.trace(0.9)
    state = tx.init(PARAMS)
    before = clone_tree(state)
    with pytest.raises(ValueError, match=r"updates does not have the tree structure of trace's state \(trace\)"):
        tx.update({"w": torch.ones(3)}, state)
    assert_tree_bitwise_equal(state, before)


def test_chain_state_mismatch():
    tx = ft.chain(ft.topk(1), ft.sgd(0.1, momentum=0.9))
    state = tx.init(PARAMS)
    before = clone_tree(state)
    with pytest.raises(TypeError, match="tuple of 2 states"):
        tx.update(GRADS, state[:1], PARAMS)
    with pytest.raises(ValueError, match="trace's state"):
        tx.update({"w": GRADS["w"]}, state, PARAMS)
    assert_tree_bitwise_equal(state, before)


def test_add_decayed_weights_masks():
    params = {"w": torch.ones(2, 2), "b": torch.ones(2), "frozen": None}
    g = {"w": torch.zeros(2, 2), "b": torch.zeros(2), "frozen": None}
    full = ft.add_decayed_weights(0.5)
    u, _ = full.update(g, full.init(params), params)
    assert torch.equal(u["w"], torch.full((2, 2), 0.5)) and torch.equal(u["b"], torch.full((2,), 0.5))
    assert u["frozen"] is None
    for mask in ({"w": True, "b": False, "frozen": None}, lambda p: ft.tree.map(lambda x: x.dim() > 1, p)):
        tx = ft.add_decayed_weights(0.5, mask=mask)
        u, _ = tx.update(g, tx.init(params), params)
        assert torch.equal(u["w"], torch.full((2, 2), 0.5))
        assert u["b"] is g["b"]  # untouched: the very same tensor
    with pytest.raises(ValueError, match="needs the parameters"):
        full.update(g, full.init(params))
    bad = ft.add_decayed_weights(0.5, mask={"w": True, "b": torch.tensor(True), "frozen": None})
    with pytest.raises(TypeError, match=r"mask leaf at \['b'\] must be a Python bool"):
        bad.init(params)
    with pytest.raises(ValueError, match="mask must have the structure"):
        ft.add_decayed_weights(0.5, mask={"w": True}).init(params)


@pytest.mark.parametrize(
    "factory, kwargs, exc, match",
    [
        (ft.trace, {"decay": -1.0}, ValueError, "decay must be >= 0"),
        (ft.trace, {"decay": 0.9, "dampening": "x"}, TypeError, "dampening must be a real number"),
        (ft.add_decayed_weights, {"weight_decay": None}, TypeError, "weight_decay must be a real number"),
        (ft.scale_by_learning_rate, {"learning_rate": 0.1, "flip_sign": "no"}, TypeError, "flip_sign must be a bool"),
    ],
)
def test_bad_arguments(factory, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        factory(**kwargs)
