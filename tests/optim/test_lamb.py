"""LAMB and the trust ratio against optax.lamb / optax.scale_by_trust_ratio (optax 0.2.8), step by step."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch

import functopk as ft
from functopk.optim.elementary import WeightDecayScheduleState
from functopk.optim.lamb import lamb, scale_by_trust_ratio
from tests.optim.common import run_pure
from tests.optim.optax_parity import (
    MASKS,
    assert_close_np,
    assert_float32_like_optax,
    assert_parity,
    field,
    run_pair,
    start_params,
    to_jax,
    to_numpy,
    to_torch,
    x64,  # noqa: F401  (the fixture)
)

CASES = {
    "default": {},
    "weight_decay": {"weight_decay": 0.1},
    "betas_eps": {"b1": 0.8, "b2": 0.95, "eps": 1e-3},
    "eps_root_decay": {"eps": 0.0, "eps_root": 1e-4, "weight_decay": 0.3},
}


@pytest.mark.usefixtures("x64")
@pytest.mark.parametrize("kwargs", CASES.values(), ids=CASES.keys())
def test_lamb_matches_optax(device, kwargs):
    ours, theirs, state, ostate = run_pair(lamb(0.05, **kwargs), optax.lamb(0.05, **kwargs), device=device)
    assert_parity(ours, theirs)
    adam, oadam = state[0], ostate[0]
    assert int(adam.count) == int(oadam.count) == 40
    for name in ("mu", "nu"):
        for n, v in to_numpy(getattr(oadam, name)).items():
            assert_close_np(to_numpy(getattr(adam, name))[n], v, where=f"{name}[{n!r}]")


TRUST_CASES = {
    "default": {},
    "all_options": {"min_norm": 0.5, "trust_coefficient": 0.02, "eps": 1e-3},
}


@pytest.mark.usefixtures("x64")
@pytest.mark.parametrize("kwargs", TRUST_CASES.values(), ids=TRUST_CASES.keys())
def test_scale_by_trust_ratio_matches_optax(device, kwargs):
    ours, theirs, _, _ = run_pair(
        scale_by_trust_ratio(**kwargs), optax.scale_by_trust_ratio(**kwargs), steps=8, device=device
    )
    assert_parity(ours, theirs)


# (params, updates) leaves for the trust ratio's special cases: a zero parameter, a zero update,
# both, norms below min_norm, a 0-d leaf
EDGE_PARAMS = {"zp": np.zeros(3), "zu": np.array([1.0, 2.0]), "zz": np.zeros(2), "small": np.array([1e-3, 0.0]),
               "s": np.array(-2.0), "w": np.arange(6.0).reshape(2, 3)}
EDGE_UPDATES = {"zp": np.array([0.5, -1.0, 2.0]), "zu": np.zeros(2), "zz": np.zeros(2), "small": np.array([0.0, 2e-3]),
                "s": np.array(0.25), "w": np.ones((2, 3))}


@pytest.mark.usefixtures("x64")
@pytest.mark.parametrize(
    "kwargs", [{}, {"min_norm": 0.1}, {"eps": 0.5}, {"min_norm": 0.01, "trust_coefficient": 3.0, "eps": 1e-2}]
)
def test_trust_ratio_edge_cases_match_optax(device, kwargs):
    tx, otx = scale_by_trust_ratio(**kwargs), optax.scale_by_trust_ratio(**kwargs)
    u = tx.update(to_torch(EDGE_UPDATES, torch.float64, device), tx.init(None),
                  to_torch(EDGE_PARAMS, torch.float64, device))[0]
    ou = otx.update(to_jax(EDGE_UPDATES, np.float64), otx.init(None), to_jax(EDGE_PARAMS, np.float64))[0]
    for n, v in to_numpy(ou).items():
        assert np.isfinite(v).all()
        assert_close_np(to_numpy(u)[n], v, where=n)


def test_trust_ratio_by_hand():
    tx = scale_by_trust_ratio(min_norm=1.0, trust_coefficient=0.5, eps=1.0)
    params = {"a": torch.tensor([3.0, 4.0]), "b": torch.tensor([0.1]), "c": torch.zeros(2)}
    updates = {"a": torch.tensor([0.0, 2.0]), "b": torch.tensor([-0.5]), "c": torch.zeros(2)}
    out = tx.update(updates, tx.init(None), params)[0]
    assert torch.allclose(out["a"], torch.tensor([0.0, 2.0]) * (0.5 * 5.0 / (2.0 + 1.0)))  # 0.5 * 5 / (2 + eps)
    assert torch.allclose(out["b"], torch.tensor([-0.5]) * (0.5 * 1.0 / (1.0 + 1.0)))  # both norms raised to 1
    assert torch.equal(out["c"], torch.zeros(2))  # norms raised to 1: ratio 0.25, times a zero update


def test_float32_error_within_optax_float32_error():
    """functopk in float32 is as far from optax-float64 as optax-float32 is (within 4x and a tiny floor)."""
    kwargs = {"weight_decay": 0.1}
    assert_float32_like_optax(lambda: lamb(0.05, **kwargs), lambda: optax.lamb(0.05, **kwargs))


@pytest.mark.usefixtures("x64")
def test_tensor_hyperparameters(device):
    """Every numeric hyperparameter as a float64 0-d tensor: the same numbers as optax."""
    kwargs = {"b1": 0.85, "b2": 0.97, "eps": 1e-4, "eps_root": 1e-6, "weight_decay": 0.2}
    tensors = {k: torch.tensor(v, dtype=torch.float64, device=device) for k, v in kwargs.items()}
    lr = torch.tensor(0.02, dtype=torch.float64, device=device)
    ours, theirs, _, _ = run_pair(lamb(lr, **tensors), optax.lamb(0.02, **kwargs), device=device)
    assert_parity(ours, theirs)
    trust = {"min_norm": 0.5, "trust_coefficient": 0.02, "eps": 1e-3}
    tensors = {k: torch.tensor(v, dtype=torch.float64, device=device) for k, v in trust.items()}
    ours, theirs, _, _ = run_pair(
        scale_by_trust_ratio(**tensors), optax.scale_by_trust_ratio(**trust), steps=8, device=device
    )
    assert_parity(ours, theirs)


@pytest.mark.usefixtures("x64")
def test_inject_hyperparams(device):
    """Under inject_hyperparams (float32 hyperparameters)."""
    kwargs = {"b1": 0.85, "b2": 0.97, "eps": 1e-4, "weight_decay": 0.2}
    tx = ft.inject_hyperparams(lamb)(learning_rate=0.02, **kwargs)
    otx = optax.inject_hyperparams(optax.lamb)(learning_rate=0.02, **kwargs)
    ours, theirs, state, _ = run_pair(tx, otx, steps=20, device=device)
    assert_parity(ours, theirs, rtol=1e-6)
    assert set(state.hyperparams) == {"learning_rate", "b1", "b2", "eps", "weight_decay"}


@pytest.mark.usefixtures("x64")
def test_schedules(device):
    """A learning-rate schedule and a weight-decay schedule (float64 on both sides)."""

    def ours_lr(count):
        return 0.05 * torch.cos(0.05 * count.to(torch.float64))

    def ours_wd(count):
        return 0.3 / (1.0 + count.to(torch.float64))

    tx = lamb(ours_lr, weight_decay=ours_wd)
    otx = optax.lamb(lambda c: 0.05 * jnp.cos(0.05 * c), weight_decay=lambda c: 0.3 / (1.0 + c))
    ours, theirs, state, ostate = run_pair(tx, otx, device=device)
    assert_parity(ours, theirs)
    assert isinstance(state[1], WeightDecayScheduleState)
    assert int(state[1].count) == int(ostate[1].count) == 40


@pytest.mark.usefixtures("x64")
def test_functopk_schedule(device):
    """functopk's own schedule (float32 values) against optax's namesake: float32 rounding of the rate only."""
    tx = lamb(ft.cosine_decay_schedule(0.05, 30, alpha=0.1), weight_decay=0.1)
    otx = optax.lamb(optax.cosine_decay_schedule(0.05, 30, alpha=0.1), weight_decay=0.1)
    ours, theirs, _, _ = run_pair(tx, otx, steps=20, device=device)
    assert_parity(ours, theirs, rtol=1e-6)


@pytest.mark.usefixtures("x64")
@pytest.mark.parametrize("ours_mask, their_mask", MASKS.values(), ids=MASKS.keys())
def test_mask(device, ours_mask, their_mask):
    tx = lamb(0.05, weight_decay=0.5, mask=ours_mask)
    otx = optax.lamb(0.05, weight_decay=0.5, mask=their_mask)
    ours, theirs, _, _ = run_pair(tx, otx, steps=20, device=device)
    assert_parity(ours, theirs)
    params = to_torch(start_params(), torch.float64, device)
    plain = lamb(0.05)
    undecayed = to_numpy(plain.update(to_torch(field(start_params()), torch.float64, device), plain.init(params),
                                      params)[0])
    assert_close_np(ours[0]["b"], undecayed["b"])  # masked out: as without decay
    assert np.abs(ours[0]["w"] - undecayed["w"]).max() > 1e-3


def test_by_hand():
    """One step with eps=0: Adam's first step is sign(g), plus the decay, rescaled to |params|."""
    tx = lamb(0.1, eps=0.0, weight_decay=0.5)
    params = {"w": torch.tensor([3.0, 4.0], dtype=torch.float64)}
    u, state = tx.update({"w": torch.tensor([1.0, -1.0], dtype=torch.float64)}, tx.init(params), params)
    d = torch.tensor([1.0 + 1.5, -1.0 + 2.0], dtype=torch.float64)
    torch.testing.assert_close(u["w"], -0.1 * 5.0 / math.sqrt(7.25) * d, rtol=1e-14, atol=0.0)
    assert [type(s).__name__ for s in state] == ["ScaleByAdamState", "EmptyState", "EmptyState", "EmptyState"]


@pytest.mark.parametrize(
    "tx",
    [
        lamb(0.1),
        lamb(0.1, b1=torch.tensor(0.5), weight_decay=torch.tensor(0.2), mask={"w": True, "b": False}),
        lamb(lambda c: 0.1 / (c + 1), weight_decay=lambda c: 0.01 * c, eps_root=1e-8),
        ft.inject_hyperparams(lamb)(learning_rate=0.1, weight_decay=0.1),
        scale_by_trust_ratio(min_norm=torch.tensor(0.1), trust_coefficient=0.5, eps=1e-3),
    ],
    ids=["plain", "tensors_mask", "schedules", "injected", "trust_ratio"],
)
def test_pure(tx):
    updates, state = run_pure(tx)
    assert updates["b"].dtype == torch.float64 and updates["w"].dtype == torch.float32


@pytest.mark.parametrize("make", [lambda: lamb(0.1), scale_by_trust_ratio])
def test_needs_params(make):
    tx = make()
    params = {"w": torch.ones(2)}
    with pytest.raises(ValueError, match="needs the parameters"):
        tx.update({"w": torch.ones(2)}, tx.init(params))


def test_trust_ratio_checks_param_shapes():
    tx = scale_by_trust_ratio()
    with pytest.raises(ValueError, match=r"params leaf at \['w'\] has shape \(3,\)"):
        tx.update({"w": torch.ones(2)}, tx.init(None), {"w": torch.ones(3)})


def test_empty_tree():
    tx = lamb(0.1)
    assert tx.update({}, tx.init({}), {})[0] == {}


@pytest.mark.parametrize(
    "factory, kwargs, exc, match",
    [
        (lamb, {"learning_rate": None}, TypeError, "learning_rate"),
        (lamb, {"learning_rate": float("nan")}, ValueError, "learning_rate must not be NaN"),
        (lamb, {"learning_rate": 0.1, "b1": 1.0}, ValueError, "b1 must be < 1"),
        (lamb, {"learning_rate": 0.1, "b2": -0.1}, ValueError, "b2 must be >= 0"),
        (lamb, {"learning_rate": 0.1, "eps": "small"}, TypeError, "eps must be a real number"),
        (lamb, {"learning_rate": 0.1, "eps_root": -1.0}, ValueError, "eps_root must be >= 0"),
        (lamb, {"learning_rate": 0.1, "weight_decay": None}, TypeError, "weight_decay must be a real number"),
        (scale_by_trust_ratio, {"min_norm": -1.0}, ValueError, "min_norm must be >= 0"),
        (scale_by_trust_ratio, {"trust_coefficient": "1"}, TypeError, "trust_coefficient must be a real number"),
        (scale_by_trust_ratio, {"trust_coefficient": -0.5}, ValueError, "trust_coefficient must be >= 0"),
        (scale_by_trust_ratio, {"eps": float("nan")}, ValueError, "eps must not be NaN"),
        (scale_by_trust_ratio, {"eps": torch.ones(1)}, TypeError, "eps must be a real number or a 0-d float tensor"),
    ],
)
def test_bad_arguments(factory, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        factory(**kwargs)


def test_arguments_after_learning_rate_are_keyword_only():
    with pytest.raises(TypeError, match="positional argument"):
        lamb(1e-3, 0.9)  # optax's 2nd positional is b1
