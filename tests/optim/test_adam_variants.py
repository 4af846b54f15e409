"""nadam, radam and adamax against torch.optim.NAdam, RAdam and Adamax, step by step.

Both sides run free (each from its own parameters and state) on a deterministic
non-linear gradient field, ``g = sin(3p) + p**3`` at the current parameters, over a
small dict tree (a matrix, a vector, a 3-d leaf and a 0-d leaf). In float64 the
parameters must agree to ~1e-12 relative at every step, and the states, read
through ``TORCH_STATE_NAMES``, at the end. The float64 torch reference runs with
float64 as torch's default dtype, so that its scalar state (``step``, NAdam's
``mu_product``) is float64 too; in float32 our error against that reference must
stay within a small factor of torch float32's own.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

import functopk as ft
from functopk.optim.adam_variants import (
    TORCH_BUILDERS,
    TORCH_STATE_NAMES,
    AdamaxState,
    NadamState,
    RadamState,
    adamax,
    nadam,
    radam,
)
from tests.helpers import assert_updates_compile_like_eager, to_device
from tests.optim.common import run_pure

STEPS = 40
RTOL64 = 1e-12

FUNCTIONS = {"NAdam": nadam, "RAdam": radam, "Adamax": adamax}
STATES = {"NAdam": NadamState, "RAdam": RadamState, "Adamax": AdamaxState}

# torch keyword arguments (lr included), after optim_db's configurations for each class
CASES = {
    "NAdam": {
        "default": {},
        "lr": {"lr": 1e-3},
        "momentum_decay": {"lr": 0.02, "momentum_decay": 6e-3},
        "weight_decay": {"lr": 0.02, "weight_decay": 0.1},
        "wd_momentum_decay": {"lr": 0.02, "weight_decay": 0.1, "momentum_decay": 6e-3},
        "decoupled": {"lr": 0.02, "weight_decay": 0.1, "momentum_decay": 6e-3, "decoupled_weight_decay": True},
        "maximize": {"lr": 0.02, "weight_decay": 0.1, "maximize": True},
        "betas_eps": {"lr": 0.02, "betas": (0.8, 0.95), "eps": 1e-3},
    },
    "RAdam": {
        "default": {},
        "lr": {"lr": 2e-2},
        "eps": {"lr": 2e-2, "eps": 1e-6},
        "weight_decay": {"lr": 2e-2, "weight_decay": 0.1},
        "decoupled": {"lr": 2e-2, "weight_decay": 0.1, "decoupled_weight_decay": True},
        "maximize": {"lr": 2e-2, "weight_decay": 0.1, "maximize": True},
        "betas": {"lr": 2e-2, "betas": (0.8, 0.9), "eps": 1e-3},  # rho_t crosses 5 at step 7
    },
    "Adamax": {
        "default": {},
        "lr": {"lr": 0.1},
        "weight_decay": {"lr": 0.02, "weight_decay": 0.1},
        "maximize": {"lr": 0.02, "maximize": True},
        "maximize_wd": {"lr": 0.02, "weight_decay": 0.1, "maximize": True},
        "betas_eps": {"lr": 0.02, "betas": (0.8, 0.99), "eps": 1e-3},
    },
}
ALL_CASES = [(name, case) for name, cases in CASES.items() for case in cases]


def make_params(dtype=torch.float64, device="cpu"):
    """A small tree: a matrix, a vector, a 3-d leaf, a 0-d leaf; values spread over [-1.2, 1.2]."""
    shapes = {"w": (3, 4), "b": (5,), "k": (2, 1, 3), "s": ()}
    values = torch.linspace(-1.2, 1.2, 24, dtype=torch.float64)[torch.arange(24) * 7 % 24]  # shuffled, no zero
    out, start = {}, 0
    for name, shape in shapes.items():
        n = torch.Size(shape).numel()
        out[name] = values[start:start + n].reshape(shape).to(dtype=dtype, device=device)
        start += n
    return out


def field(params):
    """The gradient field: ``sin(3p) + p**3``, elementwise, at the current parameters."""
    return {k: torch.sin(3 * p) + p**3 for k, p in params.items()}


def to_ft(kwargs):
    """torch keyword arguments -> ours (``lr`` -> learning_rate, ``betas`` -> b1, b2)."""
    out = dict(kwargs)
    lr = out.pop("lr", None)
    if "betas" in out:
        out["b1"], out["b2"] = out.pop("betas")
    return lr, out


def make_ft(name, kwargs):
    lr, rest = to_ft(kwargs)
    return FUNCTIONS[name](**rest) if lr is None else FUNCTIONS[name](lr, **rest)


@pytest.fixture(autouse=True)
def float64_scalars():
    """torch keeps NAdam's mu_product in its default dtype (float32 unless float64 is the default), and so
    does nadam's init: both run with float64 as the default here, so that float64 runs are float64 throughout.
    (tests/test_param_groups.py compares them under the float32 default.)"""
    with default_dtype(torch.float64):
        yield


@contextlib.contextmanager
def default_dtype(dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def run_torch(name, kwargs, params, steps=STEPS, lr_at=None, foreach=True):
    """torch.optim's trajectory: the parameters after each step, and the optimizer."""
    ps = {k: torch.nn.Parameter(p.clone()) for k, p in params.items()}
    opt = getattr(torch.optim, name)(list(ps.values()), foreach=foreach, **kwargs)
    out = []
    for i in range(steps):
        if lr_at is not None:
            opt.param_groups[0]["lr"] = lr_at(i)
        for p, g in zip(ps.values(), field({k: p.detach() for k, p in ps.items()}).values()):
            p.grad = g
        opt.step()
        out.append({k: p.detach().clone() for k, p in ps.items()})
    return out, opt, ps


def run_ft(tx, params, steps=STEPS, state=None):
    """Our trajectory from ``params``: the parameters after each step, and the final state."""
    state = tx.init(params) if state is None else state
    out = []
    for _ in range(steps):
        updates, state = tx.update(field(params), state, params)
        params = ft.apply_updates(params, updates)
        out.append(params)
    return out, state


def max_rel_error(ours, theirs, start):
    """Worst ``|ours - theirs| / (|theirs| + max step)`` over leaves (the step of each leaf from ``start``)."""
    worst = 0.0
    for k in theirs:
        scale = theirs[k].abs() + (theirs[k] - start[k]).abs().max()
        worst = max(worst, ((ours[k].to(theirs[k]) - theirs[k]).abs() / scale).max().item())
    return worst


def assert_trajectories_close(ours, theirs, start, rtol=RTOL64):
    for i, (a, b) in enumerate(zip(ours, theirs)):
        err = max_rel_error(to_device(a, "cpu"), to_device(b, "cpu"), to_device(start, "cpu"))
        assert err <= rtol, f"step {i}: relative error {err:.3g} > {rtol}"


def assert_state_matches(name, state, opt, ps, rtol=RTOL64):
    """Every state field equals torch's per-parameter entry it maps to (0-d fields: for every parameter)."""
    for field_name, key in TORCH_STATE_NAMES[name].items():
        ours = getattr(state, field_name)
        for leaf, p in ps.items():
            theirs = opt.state[p][key]
            mine = ours[leaf] if isinstance(ours, dict) else ours
            torch.testing.assert_close(mine.cpu().double(), theirs.cpu().double(), rtol=rtol, atol=1e-300)


# --------------------------------------------------------------------------- float64 parity


@pytest.mark.parametrize(("name", "case"), ALL_CASES, ids=[f"{n}-{c}" for n, c in ALL_CASES])
def test_float64_parity_with_torch(device, name, case):
    kwargs = CASES[name][case]
    params = make_params(torch.float64, device)
    with default_dtype(torch.float64):
        theirs, opt, ps = run_torch(name, kwargs, params)
    ours, state = run_ft(make_ft(name, kwargs), params)
    assert_trajectories_close(ours, theirs, params)
    assert_state_matches(name, state, opt, ps)
    assert int(state.count) == STEPS


@pytest.mark.parametrize("name", list(CASES))
def test_float64_parity_with_torch_single_tensor_path(name):
    """torch's default on CPU (foreach=False) rounds in another order: still ~1e-12 in float64."""
    kwargs = {**CASES[name]["maximize"], "betas": (0.8, 0.9)}
    params = make_params(torch.float64)
    with default_dtype(torch.float64):
        theirs, _, _ = run_torch(name, kwargs, params, foreach=False)
    ours, _ = run_ft(make_ft(name, kwargs), params)
    assert_trajectories_close(ours, theirs, params)


def test_radam_switches_after_five_steps(device):
    """With b2 = 0.999, rho_t > 5 from step 6: steps 1-5 are -lr * m / (1 - b1**t) exactly as torch."""
    params = make_params(torch.float64, device)
    tx = radam(0.01)
    state = tx.init(params)
    m = {k: torch.zeros_like(p) for k, p in params.items()}
    for t in range(1, 8):
        g = field(params)
        updates, state = tx.update(g, state, params)
        m = {k: 0.9 * m[k] + 0.1 * g[k] for k in m}
        plain = {k: -0.01 * m[k] / (1 - 0.9**t) for k in m}
        same = all(torch.allclose(updates[k], plain[k], rtol=1e-12, atol=0) for k in m)
        assert same == (t <= 5), t
        params = ft.apply_updates(params, updates)


def test_nadam_keeps_a_float32_mu_product_like_torch(device):
    """A float32 mu_product (torch's default scalar dtype, e.g. loaded from torch) stays float32 and
    matches torch run with float32 scalars; the float64 one differs from it by the float32 rounding only."""
    kwargs = {"lr": 0.02, "weight_decay": 0.1}
    params = make_params(torch.float64, device)
    with default_dtype(torch.float32):
        theirs, opt, ps = run_torch("NAdam", kwargs, params)  # default dtype float32: float32 mu_product
    tx = make_ft("NAdam", kwargs)
    start = tx.init(params)
    ours32, state32 = run_ft(tx, params, state=start._replace(mu_product=start.mu_product.float()))
    assert state32.mu_product.dtype == torch.float32
    assert_trajectories_close(ours32, theirs, params)
    assert_state_matches("NAdam", state32, opt, ps)
    ours64, _ = run_ft(tx, params)
    err = max(max_rel_error(to_device(a, "cpu"), to_device(b, "cpu"), to_device(params, "cpu"))
              for a, b in zip(ours64, theirs))
    assert 0 < err < 1e-6


# --------------------------------------------------------------------------- float32


def float32_errors(name, kwargs, device):
    """(ours, torch's) worst absolute float32 error against the float64 torch run, over all steps."""
    p64 = make_params(torch.float64, device)
    with default_dtype(torch.float64):
        ref, _, _ = run_torch(name, kwargs, p64)
    theirs32, _, _ = run_torch(name, kwargs, make_params(torch.float32, device))
    ours32, _ = run_ft(make_ft(name, kwargs), make_params(torch.float32, device))

    def worst(run):
        return max((a[k].double() - b[k]).abs().max().item() for a, b in zip(run, ref) for k in b)

    return worst(ours32), worst(theirs32)


@pytest.mark.parametrize(("name", "case"), ALL_CASES, ids=[f"{n}-{c}" for n, c in ALL_CASES])
def test_float32_error_within_torch_float32_error(device, name, case):
    ours, theirs = float32_errors(name, CASES[name][case], device)
    assert ours <= 4 * theirs + 1e-7, (ours, theirs)


# --------------------------------------------------------------------------- the torch.optim correspondence


@pytest.mark.parametrize("name", list(CASES))
def test_state_names_match_torch_keys(name):
    p = torch.nn.Parameter(torch.ones(3))
    opt = getattr(torch.optim, name)([p])
    p.grad = torch.ones(3)
    opt.step()
    assert set(TORCH_STATE_NAMES[name].values()) == set(opt.state[p])
    assert set(TORCH_STATE_NAMES[name]) == set(STATES[name]._fields)
    assert type(FUNCTIONS[name]().init({"w": torch.ones(3)})) is STATES[name]


BUILDER_CASES = [
    ("NAdam", {"lr": 0.02, "betas": (0.85, 0.99), "weight_decay": 0.1, "momentum_decay": 6e-3,
               "decoupled_weight_decay": True, "maximize": True}),
    ("NAdam", {"lr": torch.tensor(0.01, dtype=torch.float64), "weight_decay": 0.05}),
    ("RAdam", {"lr": 0.02, "betas": (0.8, 0.9), "weight_decay": 0.1, "decoupled_weight_decay": True}),
    ("RAdam", {"lr": torch.tensor([0.02], dtype=torch.float64), "eps": 1e-6, "maximize": True, "weight_decay": 0.1}),
    ("Adamax", {"lr": 0.05, "betas": (0.8, 0.99), "eps": 1e-4, "weight_decay": 0.1, "maximize": True}),
    ("Adamax", {"lr": torch.tensor(0.02, dtype=torch.float64)}),
]


@pytest.mark.parametrize(("name", "kwargs"), BUILDER_CASES, ids=[f"{n}-{i}" for i, (n, _) in enumerate(BUILDER_CASES)])
def test_builder_from_torch_param_group(device, name, kwargs):
    params = make_params(torch.float64, device)
    with default_dtype(torch.float64):
        group = dict(getattr(torch.optim, name)([torch.nn.Parameter(torch.zeros(1))], **kwargs).param_groups[0])
        del group["params"]
        theirs, _, _ = run_torch(name, kwargs, params)
    tx = TORCH_BUILDERS[name](group)
    ours, _ = run_ft(tx, params)
    assert_trajectories_close(ours, theirs, params)


def test_builder_takes_one_element_tensor_betas():
    group = dict(torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))], betas=(0.9, 0.99)).param_groups[0])
    group = {**group, "betas": (torch.tensor([0.9], dtype=torch.float64), torch.tensor(0.99, dtype=torch.float64)),
             "momentum_decay": 4e-3, "decoupled_weight_decay": False}
    params = make_params()
    for name, builder in TORCH_BUILDERS.items():
        tx = builder(group)
        ours, _ = run_ft(tx, params, steps=3)
        expected, _ = run_ft(make_ft(name, {"lr": group["lr"], "betas": (0.9, 0.99)}), params, steps=3)
        assert_trajectories_close(ours, expected, params)
    with pytest.raises(ValueError, match="one element"):
        TORCH_BUILDERS["RAdam"]({**group, "lr": torch.tensor([0.1, 0.2])})


@pytest.mark.parametrize("name", list(TORCH_BUILDERS))
def test_builder_follows_a_tensor_lr_changed_in_place(name):
    """A tensor lr in the group is used as is (a view, never read): a scheduler's in-place change reaches us."""
    lr = torch.tensor([0.01])
    group = dict(getattr(torch.optim, name)([torch.nn.Parameter(torch.zeros(1))], lr=lr).param_groups[0])
    tx = TORCH_BUILDERS[name](group)
    params = make_params()
    updates, state = tx.update(field(params), tx.init(params), params)
    assert all(u.abs().max() > 0 for u in updates.values())
    lr.fill_(0.0)
    updates, _ = tx.update(field(params), state, params)
    assert all(u.abs().max() == 0 for u in updates.values())


# --------------------------------------------------------------------------- hyperparameters as tensors, schedules


TENSOR_CASES = {
    "NAdam": {"lr": 0.02, "betas": (0.85, 0.99), "eps": 1e-6, "weight_decay": 0.1, "momentum_decay": 6e-3,
              "decoupled_weight_decay": True},
    "RAdam": {"lr": 0.02, "betas": (0.8, 0.9), "eps": 1e-6, "weight_decay": 0.1},
    "Adamax": {"lr": 0.02, "betas": (0.8, 0.99), "eps": 1e-4, "weight_decay": 0.1},
}


@pytest.mark.parametrize("name", list(TENSOR_CASES))
def test_tensor_hyperparameters(device, name):
    """Every numeric hyperparameter as a float64 0-d tensor gives torch's run with the same floats."""
    kwargs = TENSOR_CASES[name]
    lr, rest = to_ft(kwargs)
    as_tensor = {k: v if isinstance(v, bool) else torch.tensor(v, dtype=torch.float64, device=device)
                 for k, v in rest.items()}
    params = make_params(torch.float64, device)
    with default_dtype(torch.float64):
        theirs, _, _ = run_torch(name, kwargs, params)
    tx = FUNCTIONS[name](torch.tensor(lr, dtype=torch.float64, device=device), **as_tensor)
    ours, _ = run_ft(tx, params)
    assert_trajectories_close(ours, theirs, params)


@pytest.mark.parametrize("name", list(TENSOR_CASES))
def test_inject_hyperparams_and_lr_schedule(device, name):
    """Under inject_hyperparams (float32 hyperparameters) with an lr schedule, torch with the same schedule."""
    kwargs = TENSOR_CASES[name]
    lr, rest = to_ft(kwargs)
    params = make_params(torch.float64, device)
    with default_dtype(torch.float64):
        theirs, _, _ = run_torch(name, kwargs, params, lr_at=lambda i: lr * 0.95**i)
    tx = ft.inject_hyperparams(FUNCTIONS[name])(learning_rate=ft.exponential_decay(lr, 1, 0.95), **rest)
    ours, state = run_ft(tx, params)
    assert_trajectories_close(ours, theirs, params, rtol=1e-5)  # the injected values are float32
    assert state.hyperparams["learning_rate"].dtype == torch.float32


@pytest.mark.parametrize("name", list(TENSOR_CASES))
def test_float64_lr_schedule(device, name):
    kwargs = TENSOR_CASES[name]
    lr, rest = to_ft(kwargs)
    params = make_params(torch.float64, device)
    with default_dtype(torch.float64):
        theirs, _, _ = run_torch(name, kwargs, params, lr_at=lambda i: lr * 0.95**i)
    decay = torch.tensor(0.95, dtype=torch.float64, device=device)
    ours, _ = run_ft(FUNCTIONS[name](lambda count: lr * decay**count, **rest), params)
    assert_trajectories_close(ours, theirs, params)


# --------------------------------------------------------------------------- contracts


@pytest.mark.parametrize("name", list(FUNCTIONS))
@pytest.mark.parametrize("decay", [0.0, 0.1])
def test_pure(name, decay):
    tx = FUNCTIONS[name](0.1, weight_decay=decay)
    updates, state = run_pure(tx)
    assert int(state.count) == 3
    assert updates["b"].dtype == torch.float64 and updates["w"].dtype == torch.float32


@pytest.mark.compile
def test_updates_compile_without_graph_breaks(fresh_dynamo):
    """Every step-dependent switch (RAdam's rho_t > 5, NAdam's schedule) is traced: no host sync, no recompile."""
    params = make_params(torch.float32)
    txs = [nadam(0.02, weight_decay=0.1, decoupled_weight_decay=True), radam(0.02, weight_decay=0.1), adamax(0.02)]

    def grads(i):
        return field({k: p + 0.1 * i for k, p in params.items()})

    assert_updates_compile_like_eager(txs, params, grads, steps=7)


BAD_ARGS = [
    ({"learning_rate": -0.1}, ValueError, "learning_rate"),
    ({"learning_rate": "0.1"}, TypeError, "learning_rate"),
    ({"b1": 1.0}, ValueError, "b1"),
    ({"b1": -0.1}, ValueError, "b1"),
    ({"b2": 1.5}, ValueError, "b2"),
    ({"b2": None}, TypeError, "b2"),
    ({"eps": -1e-8}, ValueError, "eps"),
    ({"eps": float("nan")}, ValueError, "eps"),
    ({"weight_decay": -0.1}, ValueError, "weight_decay"),
    ({"weight_decay": torch.zeros(2)}, TypeError, "weight_decay"),
    ({"maximize": 1}, TypeError, "maximize"),
]
EXTRA_BAD_ARGS = {
    "NAdam": [
        ({"momentum_decay": -1e-3}, ValueError, "momentum_decay"),
        ({"momentum_decay": "4e-3"}, TypeError, "momentum_decay"),
        ({"decoupled_weight_decay": "yes"}, TypeError, "decoupled_weight_decay"),
    ],
    "RAdam": [({"decoupled_weight_decay": 0}, TypeError, "decoupled_weight_decay")],
    "Adamax": [({"decoupled_weight_decay": True}, TypeError, "decoupled_weight_decay")],  # torch has none
}


@pytest.mark.parametrize("name", list(FUNCTIONS))
def test_bad_arguments_name_the_argument(name):
    for kwargs, error, match in BAD_ARGS + EXTRA_BAD_ARGS[name]:
        with pytest.raises(error, match=match):
            FUNCTIONS[name](**{"learning_rate": 0.1, **kwargs})
    with pytest.raises(TypeError):
        FUNCTIONS[name](0.1, 0.9)  # everything after learning_rate is keyword-only


@pytest.mark.parametrize("name", list(FUNCTIONS))
def test_bad_inputs(name):
    params = make_params()
    tx = FUNCTIONS[name](0.1, weight_decay=0.1)
    state = tx.init(params)
    with pytest.raises(ValueError, match=r"shape"):
        tx.update({**field(params), "w": torch.ones(1, 4, dtype=torch.float64)}, state, params)
    with pytest.raises(ValueError, match="needs the parameters"):
        tx.update(field(params), state)
    other = next(f for n, f in FUNCTIONS.items() if n != name)(0.1).init(params)
    with pytest.raises(TypeError, match="state must be"):
        tx.update(field(params), other, params)
    with pytest.raises(TypeError, match="floating-point"):
        tx.update({k: torch.ones(p.shape, dtype=torch.int64) for k, p in params.items()}, state, params)
