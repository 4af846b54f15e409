"""Adadelta, Rprop and ASGD against torch.optim (foreach), step by step.

The synced runs give torch.optim and functopk the same parameters and gradients at
every step (torch's parameters, a deterministic non-linear gradient field); each
side keeps its own state, and the new parameters must agree to 1e-12 relative in
float64. The float32 runs are free-running: functopk's float32 error against
torch's float64 trajectory must stay within a small factor of torch float32's own.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch

import functopk as ft
from functopk.optim.classic import (
    TORCH_BUILDERS,
    TORCH_STATE_NAMES,
    AdadeltaState,
    AsgdState,
    RpropState,
    adadelta,
    asgd,
    rprop,
)
from tests.optim.common import run_pure

STEPS = 40
TORCH_CLASSES = {"Adadelta": torch.optim.Adadelta, "Rprop": torch.optim.Rprop, "ASGD": torch.optim.ASGD}
FACTORIES = {"Adadelta": adadelta, "Rprop": rprop, "ASGD": functools.partial(asgd, foreach=True)}
"""(ASGD rounds as the torch implementation it is told: here the foreach one, which these tests step.)"""
STATES = {"Adadelta": AdadeltaState, "Rprop": RpropState, "ASGD": AsgdState}


def start_params(dtype=torch.float64, device="cpu"):
    """A dict tree with a 2-D, a 1-D and a 0-d leaf."""
    g = torch.Generator().manual_seed(7)
    tree = {
        "w": torch.rand(3, 4, generator=g, dtype=torch.float64) * 2 - 1,
        "b": torch.linspace(-1.2, 0.9, 5, dtype=torch.float64),
        "s": torch.tensor(0.35, dtype=torch.float64),
    }
    return {k: v.to(dtype=dtype, device=device) for k, v in tree.items()}


def field(p):
    """The gradient field: sin(3p) + p**3, evaluated at the current parameters."""
    return torch.sin(3 * p) + p**3


def torch_kwargs(kwargs):
    """Our keyword arguments as torch's (learning_rate -> lr)."""
    out = dict(kwargs)
    if "learning_rate" in out:
        out["lr"] = out.pop("learning_rate")
    return out


def tensor_kwargs(kwargs, shape=()):
    """Every number (also inside a pair; not a bool) as a float64 tensor of ``shape``."""

    def conv(v):
        if isinstance(v, tuple):
            return tuple(conv(x) for x in v)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return torch.full(shape, float(v), dtype=torch.float64)
        return v

    return {k: conv(v) for k, v in kwargs.items()}


def make_torch(cls_name, params, kwargs):
    tensors = {k: v.clone() for k, v in params.items()}
    opt = TORCH_CLASSES[cls_name](list(tensors.values()), foreach=True, **torch_kwargs(kwargs))
    return tensors, opt


def torch_step(tensors, opt):
    for p in tensors.values():
        p.grad = field(p)
    opt.step()


def assert_step_close(ours, theirs, before, where, rtol):
    """``|ours - theirs| <= rtol * (|theirs| + the largest step of the leaf)``."""
    step = (theirs - before).abs().max()
    err = (ours - theirs).abs()
    worst = (err - rtol * (theirs.abs() + step)).max()
    assert worst <= 0, f"{where}: max |diff| {err.max().item():.3g} (largest step {step.item():.3g}, rtol {rtol})"


def run_synced(cls_name, tx, kwargs, *, device="cpu", steps=STEPS, rtol=1e-12, scheduler=None, state=None):
    """Step torch and ``tx`` on torch's parameters; compare every new parameter; return both sides' final state.

    ``state``: ``tx``'s state to start from (default: ``tx.init`` of the start parameters).
    """
    tensors, opt = make_torch(cls_name, start_params(device=device), kwargs)
    sched = scheduler(opt) if scheduler else None
    if state is None:
        state = tx.init({k: v.clone() for k, v in tensors.items()})
    for i in range(steps):
        params = {k: v.clone() for k, v in tensors.items()}
        grads = {k: field(v) for k, v in params.items()}
        updates, state = tx.update(grads, state, params)
        ours = ft.apply_updates(params, updates)
        torch_step(tensors, opt)
        if sched:
            sched.step()
        for k, p in tensors.items():
            assert_step_close(ours[k], p, params[k], f"step {i}, {k}", rtol)
    moved = [k for k, p in tensors.items() if not torch.equal(p, start_params(device=device)[k])]
    assert moved == list(tensors), moved
    return state, tensors, opt


def inner(state):
    """The optimizer's own state inside an inject_hyperparams state."""
    return state.inner_state if isinstance(state, ft.optim.InjectHyperparamsState) else state


def assert_state_matches(cls_name, state, tensors, opt, rtol=1e-12):
    """Every field of ours against torch's per-parameter state entry of TORCH_STATE_NAMES."""
    for field_name, key in TORCH_STATE_NAMES[cls_name].items():
        ours = getattr(state, field_name)
        for name, p in tensors.items():
            theirs = opt.state[p][key]
            mine = ours[name] if isinstance(ours, dict) else ours
            assert mine.shape == theirs.shape, (field_name, name)
            if field_name in ("eta", "mu"):
                assert mine.dtype == theirs.dtype, (field_name, mine.dtype, theirs.dtype)
            torch.testing.assert_close(
                mine.to(torch.float64), theirs.to(device=mine.device, dtype=torch.float64), rtol=rtol, atol=1e-300,
                msg=lambda m, f=field_name, n=name: f"{f} ({n}): {m}",
            )


CASES = {
    "Adadelta": {
        "default": {},
        "lr": {"learning_rate": 0.01},
        "weight_decay": {"weight_decay": 0.1},
        "maximize": {"maximize": True},
        "maximize_wd": {"weight_decay": 0.1, "maximize": True},
        "rho_wd": {"rho": 0.95, "weight_decay": 0.9, "eps": 1e-4},
    },
    "Rprop": {
        "default": {},
        "lr": {"learning_rate": 2e-4},
        "etas": {"etas": (0.5, 1.5)},
        "step_sizes": {"step_sizes": (2e-6, 100.0)},
        "tight_bounds": {"learning_rate": 0.05, "step_sizes": (0.01, 0.2)},
        "maximize": {"maximize": True},
    },
    "ASGD": {
        "default": {},
        "lambd": {"lambd": 0.1},
        "lr": {"learning_rate": 0.02},
        "t0": {"t0": 10, "alpha": 0.5},
        "maximize": {"maximize": True},
        "weight_decay": {"weight_decay": 0.1, "t0": 0.0},
        "maximize_wd": {"weight_decay": 0.1, "maximize": True, "lambd": 0.05, "t0": 3.5},
    },
}
PARAMS = [(c, k) for c, cases in CASES.items() for k in cases]


@pytest.mark.parametrize("cls_name, case", PARAMS, ids=[f"{c}-{k}" for c, k in PARAMS])
def test_parity_float64(device, cls_name, case):
    kwargs = CASES[cls_name][case]
    tx = FACTORIES[cls_name](**kwargs)
    state, tensors, opt = run_synced(cls_name, tx, kwargs, device=device)
    assert_state_matches(cls_name, state, tensors, opt)


def free_run(cls_name, kwargs, dtype, device, ours):
    """The trajectory (a list of float64 dicts) of a free-running torch or functopk optimizer."""
    out = []
    if ours:
        tx = FACTORIES[cls_name](**kwargs)
        params = start_params(dtype, device)
        state = tx.init(params)
        for _ in range(STEPS):
            updates, state = tx.update({k: field(v) for k, v in params.items()}, state, params)
            params = ft.apply_updates(params, updates)
            out.append({k: v.to(torch.float64) for k, v in params.items()})
    else:
        tensors, opt = make_torch(cls_name, start_params(dtype, device), kwargs)
        for _ in range(STEPS):
            torch_step(tensors, opt)
            out.append({k: v.to(torch.float64, copy=True) for k, v in tensors.items()})  # torch steps in place
    return out


def max_rel_error(run, ref):
    return max(
        ((a[k] - b[k]).abs() / (b[k].abs() + 1.0)).max().item() for a, b in zip(run, ref) for k in b
    )


@pytest.mark.parametrize("cls_name, case", PARAMS, ids=[f"{c}-{k}" for c, k in PARAMS])
def test_float32_error_like_torch(device, cls_name, case):
    kwargs = CASES[cls_name][case]
    ref = free_run(cls_name, kwargs, torch.float64, device, ours=False)
    theirs = max_rel_error(free_run(cls_name, kwargs, torch.float32, device, ours=False), ref)
    ours = max_rel_error(free_run(cls_name, kwargs, torch.float32, device, ours=True), ref)
    assert ours <= 4 * theirs + 1e-9, f"float32 error {ours:.3g}, torch float32's {theirs:.3g}"


BUILDER_CASES = {
    "Adadelta": [{"lr": 0.5, "rho": 0.8, "weight_decay": 0.05}, {"lr": torch.tensor(0.3), "maximize": True}],
    "Rprop": [{"lr": torch.tensor(0.02), "etas": (0.4, 1.3)}, {"step_sizes": (1e-4, 0.5), "maximize": True}],
    "ASGD": [{"lr": torch.tensor(0.02), "lambd": 0.01, "t0": 5}, {"weight_decay": 0.1, "maximize": True, "t0": 2.0}],
}
BUILDER_PARAMS = [(c, i) for c, cases in BUILDER_CASES.items() for i in range(len(cases))]


@pytest.mark.parametrize("cls_name, i", BUILDER_PARAMS, ids=[f"{c}-{i}" for c, i in BUILDER_PARAMS])
def test_builder_from_torch_param_group(device, cls_name, i):
    torch_kw = BUILDER_CASES[cls_name][i]
    group = dict(TORCH_CLASSES[cls_name]([torch.zeros(1)], foreach=True, **torch_kw).param_groups[0])
    del group["params"]
    tx = TORCH_BUILDERS[cls_name](group)  # (as torch's foreach kernels, which run_synced steps)
    ours_kw = dict(torch_kw)
    ours_kw["learning_rate"] = ours_kw.pop("lr", group["lr"])
    state, tensors, opt = run_synced(cls_name, tx, ours_kw, device=device)
    assert_state_matches(cls_name, state, tensors, opt)


@pytest.mark.parametrize("cls_name", TORCH_CLASSES)
def test_builder_reshapes_one_element_tensors(cls_name):
    group = dict(TORCH_CLASSES[cls_name]([torch.zeros(1)]).param_groups[0])
    del group["params"]
    as_tensors = tensor_kwargs(group, shape=(1, 1))
    params = start_params()
    grads = {k: field(v) for k, v in params.items()}
    plain, shaped = TORCH_BUILDERS[cls_name](group), TORCH_BUILDERS[cls_name](as_tensors)
    s1, s2 = plain.init(params), shaped.init(params)
    for _ in range(3):
        u1, s1 = plain.update(grads, s1, params)
        u2, s2 = shaped.update(grads, s2, params)
    for k in params:
        torch.testing.assert_close(u1[k], u2[k], rtol=1e-6, atol=0.0)


@pytest.mark.parametrize("cls_name", TORCH_CLASSES)
def test_builder_ignores_implementation_flags(cls_name):
    group = dict(TORCH_CLASSES[cls_name]([torch.zeros(1)], foreach=False, differentiable=True).param_groups[0])
    del group["params"]
    group["initial_lr"] = 1.0  # what an LR scheduler adds
    assert isinstance(TORCH_BUILDERS[cls_name](group), ft.GradientTransformation)


@pytest.mark.parametrize("cls_name", TORCH_CLASSES)
def test_state_names_are_torch_keys(cls_name):
    p = torch.zeros(3)
    opt = TORCH_CLASSES[cls_name]([p])
    p.grad = torch.ones(3)
    opt.step()
    assert set(opt.state[p]) == set(TORCH_STATE_NAMES[cls_name].values())
    fields = set(STATES[cls_name]._fields)
    assert set(TORCH_STATE_NAMES[cls_name]) == fields
    assert set(TORCH_BUILDERS) == set(TORCH_STATE_NAMES) == set(TORCH_CLASSES)


TENSOR_CASES = {
    "Adadelta": {"learning_rate": 0.5, "rho": 0.95, "eps": 1e-4, "weight_decay": 0.1},
    "Rprop": {"learning_rate": 0.02, "etas": (0.4, 1.3), "step_sizes": (1e-4, 0.5)},
    "ASGD": {"learning_rate": 0.02, "lambd": 0.01, "alpha": 0.6, "t0": 5.0, "weight_decay": 0.1},
}


@pytest.mark.parametrize("cls_name", TORCH_CLASSES)
def test_tensor_hyperparameters(device, cls_name):
    kwargs = TENSOR_CASES[cls_name]
    tx = FACTORIES[cls_name](**tensor_kwargs(kwargs))
    # ASGD's eta is float32 in torch, computed from Python floats: float64 tensors round it differently
    run_synced(cls_name, tx, kwargs, device=device, rtol=1e-6 if cls_name == "ASGD" else 1e-12)


@pytest.mark.parametrize("cls_name", TORCH_CLASSES)
def test_inject_hyperparams(device, cls_name):
    kwargs = TENSOR_CASES[cls_name]
    tx = ft.inject_hyperparams(FACTORIES[cls_name])(**kwargs)
    state, tensors, opt = run_synced(cls_name, tx, kwargs, device=device, rtol=1e-6)  # float32 hyperparameters
    assert_state_matches(cls_name, inner(state), tensors, opt, rtol=1e-5)


@pytest.mark.parametrize("cls_name", ["Adadelta", "ASGD"])
@pytest.mark.parametrize("injected", [False, True], ids=["direct", "injected"])
def test_learning_rate_schedule(device, cls_name, injected):
    lr = 0.5 if cls_name == "Adadelta" else 0.05
    factory = ft.inject_hyperparams(FACTORIES[cls_name]) if injected else FACTORIES[cls_name]
    tx = factory(learning_rate=ft.exponential_decay(lr, 1, 0.9), weight_decay=0.05)
    run_synced(
        cls_name, tx, {"learning_rate": lr, "weight_decay": 0.05}, device=device, rtol=1e-6,  # float32 schedule values
        scheduler=lambda o: torch.optim.lr_scheduler.ExponentialLR(o, 0.9),
    )


def test_rprop_learning_rate_is_the_initial_step_size(device):
    """Injected, rprop reads its learning rate at init only, as torch reads lr at its first step only."""
    tx = ft.inject_hyperparams(rprop)(learning_rate=0.5)  # exact in float32
    state = tx.init(start_params(device=device))
    state = state._replace(hyperparams={"learning_rate": torch.tensor(5.0, device=device)})  # too late: no effect
    state, tensors, opt = run_synced("Rprop", tx, {"learning_rate": 0.5}, device=device, steps=10, state=state)
    assert_state_matches("Rprop", inner(state), tensors, opt)
    with pytest.raises(TypeError, match="learning_rate must be .* not a schedule"):
        rprop(ft.exponential_decay(0.1, 1, 0.9))


def test_asgd_ax_is_the_average_after_t0(device):
    """For an integer t0, ax after step t is params while t <= t0 + 1, then the mean after steps t0 + 2 .. t."""
    t0 = 5
    tx = asgd(0.05, t0=t0)
    params = start_params(device=device)
    state = tx.init(params)
    history = []
    for t in range(1, 21):
        updates, state = tx.update({k: field(v) for k, v in params.items()}, state, params)
        params = ft.apply_updates(params, updates)
        history.append(params)
        for k in params:
            expected = params[k] if t <= t0 + 1 else torch.stack([h[k] for h in history[t0 + 1 :]]).mean(0)
            # mu = 1/n is rounded to float32, as in torch: 1e-7 relative
            torch.testing.assert_close(state.ax[k], expected, rtol=1e-6, atol=1e-12)


def test_asgd_scalars_follow_the_default_dtype(device):
    """Under a float64 default dtype torch keeps eta and mu in float64; so does asgd (and stays at parity)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        kwargs = {"learning_rate": 0.03, "lambd": 0.01, "t0": 4}
        state, tensors, opt = run_synced("ASGD", asgd(**kwargs), kwargs, device=device)
        assert state.eta.dtype == state.mu.dtype == torch.float64
        assert_state_matches("ASGD", state, tensors, opt)
    finally:
        torch.set_default_dtype(old)
    assert asgd().init({"w": torch.zeros(2)}).eta.dtype == torch.float32


@pytest.mark.parametrize(
    "tx",
    [adadelta(weight_decay=0.1, maximize=True), rprop(0.1, maximize=True), asgd(0.1, t0=1, weight_decay=0.1)],
    ids=["adadelta", "rprop", "asgd"],
)
def test_pure(tx):
    run_pure(tx, steps=4)


def test_empty_tree():
    for tx in (adadelta(), rprop(), asgd()):
        updates, _ = tx.update({}, tx.init({}), {})
        assert updates == {}


@pytest.mark.parametrize(
    "factory, kwargs, exc, match",
    [
        (adadelta, {"learning_rate": -1.0}, ValueError, "learning_rate must be >= 0"),
        (adadelta, {"rho": 1.1}, ValueError, "rho must be <= 1"),
        (adadelta, {"rho": -0.1}, ValueError, "rho must be >= 0"),
        (adadelta, {"eps": "tiny"}, TypeError, "eps must be a real number"),
        (adadelta, {"weight_decay": float("nan")}, ValueError, "weight_decay must not be NaN"),
        (adadelta, {"maximize": 1}, TypeError, "maximize must be a bool"),
        (rprop, {"learning_rate": lambda c: 0.1}, TypeError, "not a schedule"),
        (rprop, {"learning_rate": -0.1}, ValueError, "learning_rate must be >= 0"),
        (rprop, {"etas": (1.0, 0.5)}, ValueError, r"etas\[0\] must be < 1"),
        (rprop, {"etas": (0.0, 1.2)}, ValueError, r"etas\[0\] must be > 0"),
        (rprop, {"etas": (0.5, 1.0)}, ValueError, r"etas\[1\] must be > 1"),
        (rprop, {"etas": 0.5}, TypeError, "etas must be a pair"),
        (rprop, {"step_sizes": (1.0, 0.5)}, ValueError, "min <= max"),
        (rprop, {"step_sizes": (-1.0, 0.5)}, ValueError, r"step_sizes\[0\] must be >= 0"),
        (rprop, {"step_sizes": (1e-6, 50.0, 3.0)}, TypeError, "step_sizes must be a pair"),
        (rprop, {"maximize": None}, TypeError, "maximize must be a bool"),
        (asgd, {"learning_rate": "0.1"}, TypeError, "learning_rate must be a real number"),
        (asgd, {"lambd": -1.0}, ValueError, "lambd must be >= 0"),
        (asgd, {"alpha": -0.5}, ValueError, "alpha must be >= 0"),
        (asgd, {"t0": float("nan")}, ValueError, "t0 must not be NaN"),
        (asgd, {"weight_decay": -0.5}, ValueError, "weight_decay must be >= 0"),
        (asgd, {"t0": torch.zeros(2)}, TypeError, "t0 must be a real number or a 0-d float tensor"),
    ],
)
def test_bad_arguments(factory, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        factory(**kwargs)


@pytest.mark.parametrize(
    "call", [lambda: adadelta(1.0, 0.9), lambda: rprop(0.01, (0.5, 1.2)), lambda: asgd(0.01, 1e-4)],
    ids=["adadelta", "rprop", "asgd"],
)
def test_arguments_after_learning_rate_are_keyword_only(call):
    with pytest.raises(TypeError, match="positional argument"):
        call()


def test_asgd_and_weight_decay_need_params():
    params = {"w": torch.ones(2)}
    for tx in (asgd(), adadelta(weight_decay=0.1)):
        with pytest.raises(ValueError, match="needs the parameters"):
            tx.update({"w": torch.ones(2)}, tx.init(params))
    updates, _ = adadelta().update({"w": torch.ones(2)}, adadelta().init(params))  # no decay: no params needed
    assert math.isfinite(updates["w"].sum().item())
