"""Elementary transforms and sgd, against hand-computed values and torch.optim.SGD."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import functopk as ft
from tests.conftest import assert_tree_bitwise_equal, clone_tree
from tests.helpers import batch, small_cnn

PARAMS = {"w": torch.tensor([1.0, -2.0, 3.0]), "b": torch.tensor(0.5, dtype=torch.float64)}
GRADS = {"w": torch.tensor([0.5, 0.25, -1.0]), "b": torch.tensor(2.0, dtype=torch.float64)}


def run_pure(tx, params=PARAMS, grads=GRADS, steps=3):
    """Run a few updates, checking that no input is modified; return the final updates and state."""
    state = tx.init(params)
    for _ in range(steps):
        p0, g0, s0 = clone_tree(params), clone_tree(grads), clone_tree(state)
        updates, new_state = tx.update(grads, state, params)
        assert_tree_bitwise_equal(params, p0)
        assert_tree_bitwise_equal(grads, g0)
        assert_tree_bitwise_equal(state, s0)
        assert ft.tree_map(lambda a: (a.shape, a.dtype), new_state) == ft.tree_map(lambda a: (a.shape, a.dtype), state)
        state = new_state
    return updates, state


def test_scale():
    updates, _ = run_pure(ft.scale(-3.0))
    assert torch.equal(updates["w"], torch.tensor([-1.5, -0.75, 3.0]))
    assert updates["b"].dtype == torch.float64


def test_scale_by_learning_rate_constant_and_sign():
    updates, _ = run_pure(ft.scale_by_learning_rate(0.1))
    torch.testing.assert_close(updates["w"], torch.tensor([-0.05, -0.025, 0.1]))
    updates, _ = run_pure(ft.scale_by_learning_rate(0.1, flip_sign=False))
    torch.testing.assert_close(updates["w"], torch.tensor([0.05, 0.025, -0.1]))


def test_scale_by_schedule_uses_tensor_step_counter():
    seen = []

    def schedule(count):
        seen.append(count)
        return 1.0 / (count + 1)

    tx = ft.scale_by_schedule(schedule)
    state = tx.init(PARAMS)
    assert state.count.dtype == torch.int64 and state.count.shape == ()
    outs = []
    for _ in range(3):
        updates, state = tx.update(GRADS, state)
        outs.append(updates["w"][0].item())
    assert outs == pytest.approx([0.5, 0.25, 0.5 / 3])
    assert all(isinstance(c, torch.Tensor) for c in seen)
    assert int(state.count) == 3


def test_scale_keeps_leaf_dtypes_with_tensor_scalars():
    params = {"h": torch.tensor(2.0, dtype=torch.float16), "v": torch.ones(3, dtype=torch.bfloat16)}
    tx = ft.scale_by_learning_rate(lambda c: torch.tensor(0.5))
    updates, _ = tx.update(params, tx.init(params))
    assert updates["h"].dtype == torch.float16 and updates["v"].dtype == torch.bfloat16
    assert updates["h"].item() == -1.0


@pytest.mark.parametrize("nesterov", [False, True])
def test_trace_hand_computed(nesterov):
    tx = ft.trace(0.5, nesterov=nesterov)
    state = tx.init(PARAMS)
    g1 = {"w": torch.tensor([1.0, 0.0, 0.0]), "b": torch.tensor(0.0, dtype=torch.float64)}
    g2 = {"w": torch.tensor([0.0, 1.0, 0.0]), "b": torch.tensor(1.0, dtype=torch.float64)}
    u1, state = tx.update(g1, state)
    u2, state = tx.update(g2, state)
    # trace after 2 steps: g2 + 0.5 * g1
    assert torch.equal(state.trace["w"], torch.tensor([0.5, 1.0, 0.0]))
    if nesterov:
        assert torch.equal(u1["w"], torch.tensor([1.5, 0.0, 0.0]))
        assert torch.equal(u2["w"], torch.tensor([0.25, 1.5, 0.0]))
    else:
        assert torch.equal(u2["w"], state.trace["w"])
    run_pure(tx)


def test_trace_rejects_structure_mismatch_without_changing_state():
    tx = ft.trace(0.9)
    state = tx.init(PARAMS)
    before = clone_tree(state)
    with pytest.raises(ValueError, match="updates has tree structure .* the trace state"):
        tx.update({"w": torch.ones(3)}, state)
    assert_tree_bitwise_equal(state, before)


def test_chain_state_mismatch():
    tx = ft.chain(ft.topk(1), ft.sgd(0.1, momentum=0.9))
    state = tx.init(PARAMS)
    before = clone_tree(state)
    with pytest.raises(ValueError, match="tuple of 2 states"):
        tx.update(GRADS, state[:1], PARAMS)
    with pytest.raises(ValueError, match="the trace state"):
        tx.update({"w": GRADS["w"]}, state, PARAMS)
    assert_tree_bitwise_equal(state, before)


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        ({"learning_rate": "0.1"}, TypeError, "learning_rate must be a real number"),
        ({"learning_rate": None}, TypeError, "learning_rate"),
        ({"learning_rate": float("nan")}, ValueError, "learning_rate must not be NaN"),
        ({"learning_rate": 0.1, "momentum": -0.5}, ValueError, "momentum must be >= 0"),
        ({"learning_rate": 0.1, "nesterov": True}, ValueError, "nesterov=True needs momentum > 0"),
        ({"learning_rate": 0.1, "momentum": 0.9, "nesterov": 1}, TypeError, "nesterov must be a bool"),
    ],
)
def test_sgd_bad_arguments(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        ft.sgd(**kwargs)


@pytest.mark.parametrize(
    "momentum, nesterov, schedule",
    [(0.0, False, False), (0.9, False, False), (0.9, True, False), (0.5, False, True)],
    ids=["plain", "momentum", "nesterov", "schedule"],
)
def test_sgd_matches_torch_optim(momentum, nesterov, schedule):
    """20 steps on a small CNN with BatchNorm: same parameters as torch.optim.SGD."""
    model = small_cnn()
    ref = copy.deepcopy(model)
    lr = 0.05
    opt = torch.optim.SGD(ref.parameters(), lr=lr, momentum=momentum, nesterov=nesterov)
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.9) if schedule else None
    tx = ft.sgd((lambda c: lr * 0.9 ** c.to(torch.float32)) if schedule else lr, momentum=momentum, nesterov=nesterov)
    model_fn, params, buffers = ft.nn.functionalize(model)
    state = tx.init(params)

    def loss_fn(params, buffers, x, y):
        out, new_buffers = model_fn(params, buffers, x)
        return F.cross_entropy(out, y), new_buffers

    for i in range(20):
        x, y = batch(seed=i)
        opt.zero_grad()
        F.cross_entropy(ref(x), y).backward()
        opt.step()
        if sched:
            sched.step()
        grads, buffers = torch.func.grad(loss_fn, has_aux=True)(params, buffers, x, y)
        updates, state = tx.update(grads, state, params)
        params = ft.apply_updates(params, updates)
    for name, p in ref.named_parameters():
        torch.testing.assert_close(params[name], p.detach(), rtol=1e-6, atol=1e-7)
    for name, b in ref.named_buffers():
        torch.testing.assert_close(buffers[name], b, rtol=1e-6, atol=1e-7)
