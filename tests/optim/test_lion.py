"""Lion against optax.lion (optax 0.2.8), step by step; and its arguments, tensors, schedules, masks, purity."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch

import functopk as ft
from functopk.optim.elementary import WeightDecayScheduleState
from functopk.optim.elementary import add_decayed_weights as decayed_weights
from functopk.optim.lion import ScaleByLionState, lion, scale_by_lion
from tests.optim.common import run_pure
from tests.optim.optax_parity import (
    MASKS,
    assert_close_np,
    assert_float32_like_optax,
    assert_parity,
    run_pair,
    to_numpy,
    x64,  # noqa: F401  (the fixture)
)

CASES = {
    "default": {},
    "no_decay": {"weight_decay": 0.0},
    "betas_decay": {"b1": 0.5, "b2": 0.9, "weight_decay": 0.3},
    "b1_zero": {"b1": 0.0, "b2": 0.999, "weight_decay": 0.05},
}


@pytest.mark.usefixtures("x64")
@pytest.mark.parametrize("kwargs", CASES.values(), ids=CASES.keys())
def test_lion_matches_optax(device, kwargs):
    ours, theirs, state, ostate = run_pair(lion(0.01, **kwargs), optax.lion(0.01, **kwargs), device=device)
    assert_parity(ours, theirs)
    lion_state, olion_state = state[0], ostate[0]
    assert isinstance(lion_state, ScaleByLionState)
    assert int(lion_state.count) == int(olion_state.count) == 40
    for n, m in to_numpy(olion_state.mu).items():
        assert_close_np(to_numpy(lion_state.mu)[n], m, where=n)


@pytest.mark.usefixtures("x64")
def test_scale_by_lion_matches_optax(device):
    ours, theirs, _, _ = run_pair(scale_by_lion(0.8, 0.95), optax.scale_by_lion(0.8, 0.95), device=device)
    assert_parity(ours, theirs, rtol=0.0)  # signs: exactly equal


def test_float32_error_within_optax_float32_error():
    """functopk in float32 is as far from optax-float64 as optax-float32 is (within 4x and a tiny floor)."""
    kwargs = {"weight_decay": 0.1}
    assert_float32_like_optax(lambda: lion(0.01, **kwargs), lambda: optax.lion(0.01, **kwargs))


@pytest.mark.usefixtures("x64")
def test_tensor_hyperparameters(device):
    """Every numeric hyperparameter as a float64 0-d tensor: the same numbers as optax."""
    kwargs = {"b1": 0.85, "b2": 0.97, "weight_decay": 0.2}
    tensors = {k: torch.tensor(v, dtype=torch.float64, device=device) for k, v in kwargs.items()}
    lr = torch.tensor(0.02, dtype=torch.float64, device=device)
    ours, theirs, _, _ = run_pair(lion(lr, **tensors), optax.lion(0.02, **kwargs), device=device)
    assert_parity(ours, theirs)


@pytest.mark.usefixtures("x64")
def test_inject_hyperparams(device):
    """Under inject_hyperparams (float32 hyperparameters) with a change half-way."""
    kwargs = {"b1": 0.85, "b2": 0.97, "weight_decay": 0.2}
    tx = ft.inject_hyperparams(lion)(learning_rate=0.02, **kwargs)
    otx = optax.inject_hyperparams(optax.lion)(learning_rate=0.02, **kwargs)
    ours, theirs, state, ostate = run_pair(tx, otx, steps=20, device=device)
    assert_parity(ours, theirs, rtol=1e-6)
    assert set(state.hyperparams) == {"learning_rate", "b1", "b2", "weight_decay"}
    state = state._replace(hyperparams={**state.hyperparams, "b1": torch.tensor(0.5, device=device)})
    ostate.hyperparams["b1"] = jnp.asarray(0.5)
    p = {n: torch.ones_like(x) for n, x in state.inner_state[0].mu.items()}
    u, _ = tx.update(p, state, p)
    ones = {n: jnp.ones(x.shape) for n, x in p.items()}
    ou, _ = otx.update(ones, ostate, ones)
    for n in p:
        assert_close_np(to_numpy(u)[n], np.asarray(ou[n]), rtol=1e-6, where=n)


@pytest.mark.usefixtures("x64")
def test_schedules(device):
    """A learning-rate schedule and a weight-decay schedule (float64 on both sides)."""

    def ours_lr(count):
        return 0.02 / (1.0 + 0.1 * count.to(torch.float64))

    def ours_wd(count):
        return 0.3 * 0.9 ** count.to(torch.float64)

    tx = lion(ours_lr, weight_decay=ours_wd)
    otx = optax.lion(lambda c: 0.02 / (1.0 + 0.1 * c), weight_decay=lambda c: 0.3 * 0.9**c)
    ours, theirs, state, ostate = run_pair(tx, otx, device=device)
    assert_parity(ours, theirs)
    assert isinstance(state[1], WeightDecayScheduleState)
    assert int(state[1].count) == int(ostate[1].count) == 40
    assert int(state[2].count) == 40  # scale_by_learning_rate's schedule count


@pytest.mark.usefixtures("x64")
def test_functopk_schedule(device):
    """functopk's own schedules (float32 values) against optax's namesakes: float32 rounding of the rate only."""
    tx = lion(ft.exponential_decay(0.02, 5, 0.5), weight_decay=0.1)
    otx = optax.lion(optax.exponential_decay(0.02, 5, 0.5), weight_decay=0.1)
    ours, theirs, _, _ = run_pair(tx, otx, steps=20, device=device)
    assert_parity(ours, theirs, rtol=1e-6)


@pytest.mark.usefixtures("x64")
@pytest.mark.parametrize("ours_mask, their_mask", MASKS.values(), ids=MASKS.keys())
def test_mask(device, ours_mask, their_mask):
    tx = lion(0.01, weight_decay=0.5, mask=ours_mask)
    otx = optax.lion(0.01, weight_decay=0.5, mask=their_mask)
    ours, theirs, _, _ = run_pair(tx, otx, steps=20, device=device)
    assert_parity(ours, theirs)
    # masked-out leaves are not decayed: the update is exactly -lr * sign(...)
    assert set(np.unique(np.abs(ours[0]["b"])).tolist()) <= {0.01}


@pytest.mark.usefixtures("x64")
def test_scheduled_decay_with_mask(device):
    tx = lion(0.01, weight_decay=lambda c: 0.5 / (1.0 + c.to(torch.float64)), mask={"w": False, "b": True, "s": True,
                                                                                     "k": False})
    otx = optax.lion(0.01, weight_decay=lambda c: 0.5 / (1.0 + c), mask={"w": False, "b": True, "s": True, "k": False})
    ours, theirs, _, _ = run_pair(tx, otx, steps=10, device=device)
    assert_parity(ours, theirs)


def test_two_steps_by_hand():
    """Two steps by hand: the momentum (b2) and the interpolation (b1) are distinct."""
    tx = lion(0.1, b1=0.5, b2=0.75, weight_decay=0.0)
    params = {"w": torch.tensor([1.0, 1.0])}
    state = tx.init(params)
    u, state = tx.update({"w": torch.tensor([4.0, -4.0])}, state, params)
    assert torch.equal(u["w"], torch.tensor([-0.1, 0.1]))
    assert torch.equal(state[0].mu["w"], torch.tensor([1.0, -1.0]))  # 0.25 * g
    # c = 0.5 * mu + 0.5 * g: [0.5 - 1.5, -0.5 + 0.25]; mu = 0.75 * mu + 0.25 * g
    u, state = tx.update({"w": torch.tensor([-3.0, 0.5])}, state, params)
    assert torch.equal(u["w"], torch.tensor([0.1, 0.1]))
    assert torch.equal(state[0].mu["w"], torch.tensor([0.0, -0.625]))


@pytest.mark.parametrize(
    "tx",
    [
        lion(0.1),
        lion(0.1, b1=torch.tensor(0.5), weight_decay=torch.tensor(0.2), mask={"w": True, "b": False}),
        lion(lambda c: 0.1 / (c + 1), weight_decay=lambda c: 0.01 * c),
        ft.inject_hyperparams(lion)(learning_rate=0.1, weight_decay=0.1),
    ],
    ids=["plain", "tensors_mask", "schedules", "injected"],
)
def test_pure(tx):
    updates, state = run_pure(tx)
    assert updates["b"].dtype == torch.float64 and updates["w"].dtype == torch.float32


def test_needs_params():
    params = {"w": torch.ones(2)}
    tx = lion(0.1)
    with pytest.raises(ValueError, match="needs the parameters"):
        tx.update({"w": torch.ones(2)}, tx.init(params))
    # scale_by_lion alone does not
    tx = scale_by_lion()
    tx.update({"w": torch.ones(2)}, tx.init(params))


def test_empty_tree():
    tx = lion(0.1)
    state = tx.init({})
    assert tx.update({}, state, {})[0] == {}


@pytest.mark.parametrize(
    "factory, kwargs, exc, match",
    [
        (lion, {"learning_rate": None}, TypeError, "learning_rate"),
        (lion, {"learning_rate": "0.1"}, TypeError, "learning_rate must be a real number"),
        (lion, {"learning_rate": float("nan")}, ValueError, "learning_rate must not be NaN"),
        (lion, {"learning_rate": 0.1, "b1": 1.0}, ValueError, "b1 must be < 1"),
        (lion, {"learning_rate": 0.1, "b2": -0.1}, ValueError, "b2 must be >= 0"),
        (lion, {"learning_rate": 0.1, "b1": "high"}, TypeError, "b1 must be a real number"),
        (lion, {"learning_rate": 0.1, "weight_decay": [0.1]}, TypeError, "weight_decay must be a real number"),
        (lion, {"learning_rate": 0.1, "weight_decay": torch.ones(2)}, TypeError, "weight_decay must be"),
        (scale_by_lion, {"b2": 1.5}, ValueError, "b2 must be < 1"),
        (decayed_weights, {"weight_decay": True}, TypeError, "weight_decay must be a real number"),
    ],
)
def test_bad_arguments(factory, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        factory(**kwargs)


def test_arguments_after_learning_rate_are_keyword_only():
    with pytest.raises(TypeError, match="positional argument"):
        lion(1e-3, 0.9)  # optax's 2nd positional is b1


def test_bad_mask():
    params = {"w": torch.ones(2), "b": torch.ones(1)}
    tx = lion(0.1, mask={"w": True})
    with pytest.raises(ValueError, match="mask must have the structure of the parameters"):
        tx.init(params)
    tx = lion(0.1, mask={"w": True, "b": 1})
    with pytest.raises(TypeError, match=r"mask leaf at \['b'\] must be a Python bool"):
        tx.init(params)
