"""Every alias against its torch.optim counterpart, step by step, on a small CNN with BatchNorm.

For 20 steps, torch.optim (its foreach implementation) trains an nn.Module; at
each step functopk gets the same parameters and the same gradients, runs its
update from its own state, and its new parameters must equal torch's to 1e-6
relative. Feeding both the same inputs at every step is what makes this a test
of the optimizer and not of chaotic training dynamics: torch.optim adds
``-lr * update`` into the parameters with one fused multiply-add, whereas a pure
update is rounded once before ``apply_updates`` adds it, and a free-running
comparison amplifies such last-bit differences through the network (torch's own
``fused=True`` Adam drifts ~2e-6 from its foreach Adam in 20 free steps). The
optimizer *states* are never synchronised, so an error in a state (a wrong first
step, a misplaced eps, a bias correction off by one) accumulates and shows.

The injected cases pass every numeric hyperparameter as a 0-d tensor
(inject_hyperparams), follow a schedule for the learning rate, and change another
hyperparameter half-way, on both sides.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import functopk as ft
from tests.helpers import batch, force_accelerator_path, small_cnn

STEPS = 20
RTOL = float(__import__("os").environ.get("PARITY_RTOL", "1e-6"))


def assert_step_close(ours, theirs, before, where, rtol=RTOL):
    """New parameters equal to ``rtol`` relative to their value, or to the size of the step.

    ``|ours - theirs| <= rtol * |theirs| + rtol * max|theirs - before|``: a parameter
    far larger than its step is compared to its own value (a few ulps of it); one near
    zero, to the largest step taken in its tensor (a few ulps of the update).
    """
    step = (theirs - before).abs().max()
    err = (ours - theirs).abs()
    bound = rtol * theirs.abs() + rtol * step
    worst = (err - bound).max()
    assert worst <= 0, (
        f"{where}: max |diff| {err.max().item():.3g} exceeds rtol * (|value| + max step {step.item():.3g}) "
        f"by {worst.item():.3g}"
    )


def step_inputs(ref, opt, i, device):
    """Batch ``i``'s gradients on ``ref`` (``opt``'s zeroed first): its parameters and gradients, cloned by name."""
    x, y = (t.to(device) for t in batch(seed=i))
    opt.zero_grad()
    F.cross_entropy(ref(x), y).backward()
    named = dict(ref.named_parameters())
    return {n: p.detach().clone() for n, p in named.items()}, {n: p.grad.clone() for n, p in named.items()}


def run_parity(make_opt, tx, *, scheduler=None, change=None, steps=STEPS, model=None, device="cpu"):
    """Step torch.optim and ``tx`` side by side; compare the new parameters after every step.

    Args:
        make_opt: ``module -> torch.optim.Optimizer``.
        tx: The functopk transformation.
        scheduler: ``opt -> lr_scheduler`` (stepped after each step), or None.
        change: ``(opt, state) -> state`` called after step ``steps // 2``, to change a
            hyperparameter on both sides.
        model: The module (default: ``small_cnn()``).
        device: Where both run: the module, the batches, torch.optim's and functopk's states.

    Returns:
        The final functopk state.
    """
    ref = (small_cnn() if model is None else model).to(device)
    opt = make_opt(ref)
    sched = scheduler(opt) if scheduler else None
    named = dict(ref.named_parameters())
    state = tx.init({n: p.detach().clone() for n, p in named.items()})
    start = {n: p.detach().clone() for n, p in named.items()}
    for i in range(steps):
        params, grads = step_inputs(ref, opt, i, device)
        updates, state = tx.update(grads, state, params)
        ours = ft.apply_updates(params, updates)
        opt.step()
        if sched:
            sched.step()
        for n, p in named.items():
            assert_step_close(ours[n], p.detach(), params[n], f"step {i}, {n}")
        if change is not None and i == steps // 2:
            state = change(opt, state)
    # the run really trained: every parameter moved (conv biases that BatchNorm follows get
    # only rounding-noise gradients, which adaptive optimizers still turn into steps)
    moved = [n for n, p in named.items() if not torch.equal(p.detach(), start[n])]
    assert len(moved) >= len(named) - 2, moved
    return state


def set_both(name, torch_name, value):
    """A ``change`` callback: set hyperparameter ``name`` (torch: ``torch_name``) to ``value`` on both sides."""

    def change(opt, state):
        for group in opt.param_groups:
            group[torch_name] = value
        stored = state.hyperparams[name]  # on the parameters' device
        return state._replace(hyperparams={**state.hyperparams, name: torch.tensor(value, device=stored.device)})

    return change


SGD_CASES = {
    "plain": {},
    "momentum": {"momentum": 0.9},
    "nesterov": {"momentum": 0.9, "nesterov": True},
    "dampening": {"momentum": 0.9, "dampening": 0.3},
    "weight_decay": {"momentum": 0.8, "weight_decay": 0.05},
    "maximize_wd": {"momentum": 0.5, "weight_decay": 0.05, "maximize": True},
    "nesterov_wd": {"momentum": 0.7, "nesterov": True, "weight_decay": 0.01},
}


@pytest.mark.parametrize("kwargs", SGD_CASES.values(), ids=SGD_CASES.keys())
def test_sgd(device, kwargs):
    lr = 0.05 if not kwargs.get("maximize") else 0.01
    run_parity(
        lambda m: torch.optim.SGD(m.parameters(), lr=lr, foreach=True, **kwargs), ft.sgd(lr, **kwargs), device=device
    )


BUFFER_CASES = {  # (a momentum of 0.5 would round alike either way: its products are exact)
    "momentum": SGD_CASES["momentum"],
    "nesterov_wd": SGD_CASES["nesterov_wd"],
    "maximize_wd": {"momentum": 0.6, "weight_decay": 0.05, "maximize": True},
}


@pytest.mark.parametrize("foreach", [True, False], ids=["foreach", "for-loop"])
@pytest.mark.parametrize("kwargs", BUFFER_CASES.values(), ids=BUFFER_CASES.keys())
def test_sgd_momentum_buffer_has_torch_optims_bits_eagerly_on_an_accelerator(device, kwargs, foreach, monkeypatch):
    """Fed the same parameters and gradients, the trace is ``torch.optim.SGD``'s momentum buffer bit for bit,
    pure and in place, on an accelerator's eager path (forced on the CPU): both compute ``decay * buf`` and
    then add the gradient (two roundings; the CPU's path fuses them into one)."""
    if device == "cpu":
        force_accelerator_path(monkeypatch)
    ref = small_cnn().to(device)
    opt = torch.optim.SGD(ref.parameters(), lr=0.05, foreach=foreach, **kwargs)
    named = dict(ref.named_parameters())
    tx = ft.sgd(0.05, **kwargs)
    pure = tx.init({n: p.detach().clone() for n, p in named.items()})
    twin = tx.init({n: p.detach().clone() for n, p in named.items()})
    for i in range(6):
        params, grads = step_inputs(ref, opt, i, device)
        _, pure = tx.update(grads, pure, params)
        ft.update_(tx, grads, twin, params)
        opt.step()
        for state in (pure, twin):
            (trace,) = [s for s in state if isinstance(s, ft.optim.TraceState)]
            for n, p in named.items():
                assert torch.equal(trace.trace[n], opt.state[p]["momentum_buffer"]), (i, n)


def test_sgd_injected_with_schedule_and_change(device):
    kwargs = {"momentum": 0.9, "dampening": 0.2, "weight_decay": 0.01}
    tx = ft.inject_hyperparams(ft.sgd)(learning_rate=ft.exponential_decay(0.05, 1, 0.9), **kwargs)
    state = run_parity(
        lambda m: torch.optim.SGD(m.parameters(), lr=0.05, foreach=True, **kwargs),
        tx,
        scheduler=lambda o: torch.optim.lr_scheduler.ExponentialLR(o, 0.9),
        change=set_both("momentum", "momentum", 0.5),
        device=device,
    )
    assert set(state.hyperparams) == {"learning_rate", "momentum", "dampening", "weight_decay"}


ADAM_CASES = {
    "default": {},
    "weight_decay": {"weight_decay": 0.05},
    "amsgrad": {"amsgrad": True},
    "amsgrad_wd_maximize": {"amsgrad": True, "weight_decay": 0.01, "maximize": True},
    "betas_eps": {"betas": (0.8, 0.99), "eps": 1e-3},
}


def _ft_kwargs(kwargs):
    out = dict(kwargs)
    if "betas" in out:
        out["b1"], out["b2"] = out.pop("betas")
    return out


@pytest.mark.parametrize("kwargs", ADAM_CASES.values(), ids=ADAM_CASES.keys())
def test_adam(device, kwargs):
    run_parity(
        lambda m: torch.optim.Adam(m.parameters(), lr=0.01, foreach=True, **kwargs),
        ft.adam(0.01, **_ft_kwargs(kwargs)),
        device=device,
    )


ADAMW_CASES = {
    "default": {},
    "strong_decay": {"weight_decay": 0.5},
    "amsgrad_maximize": {"amsgrad": True, "maximize": True, "weight_decay": 0.1},
}


@pytest.mark.parametrize("kwargs", ADAMW_CASES.values(), ids=ADAMW_CASES.keys())
def test_adamw(device, kwargs):
    run_parity(
        lambda m: torch.optim.AdamW(m.parameters(), lr=0.01, foreach=True, **kwargs),
        ft.adamw(0.01, **_ft_kwargs(kwargs)),
        device=device,
    )


@pytest.mark.parametrize("name", ["adam", "adamw"])
def test_adam_injected_with_schedule_and_change(device, name):
    torch_cls = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW}[name]
    kwargs = {"weight_decay": 0.05, "amsgrad": True, "eps": 1e-6}
    tx = ft.inject_hyperparams(getattr(ft, name))(
        learning_rate=ft.cosine_decay_schedule(0.01, 30, alpha=0.1), b1=0.85, b2=0.995, **kwargs
    )
    state = run_parity(
        lambda m: torch_cls(m.parameters(), lr=0.01, betas=(0.85, 0.995), foreach=True, **kwargs),
        tx,
        scheduler=lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, 30, eta_min=0.001),
        change=set_both("weight_decay", "weight_decay", 0.2),
        device=device,
    )
    assert set(state.hyperparams) == {"learning_rate", "b1", "b2", "eps", "weight_decay"}


RMSPROP_CASES = {
    "default": {},
    "centered": {"centered": True},
    "momentum": {"momentum": 0.9},
    "centered_momentum_wd": {"centered": True, "momentum": 0.5, "weight_decay": 0.05},
    "maximize_alpha": {"maximize": True, "alpha": 0.9, "eps": 1e-4},
}


@pytest.mark.parametrize("kwargs", RMSPROP_CASES.values(), ids=RMSPROP_CASES.keys())
def test_rmsprop(device, kwargs):
    run_parity(
        lambda m: torch.optim.RMSprop(m.parameters(), lr=1e-3, foreach=True, **kwargs),
        ft.rmsprop(1e-3, **kwargs),
        device=device,
    )


def test_rmsprop_injected_with_schedule_and_change(device):
    kwargs = {"alpha": 0.95, "momentum": 0.5, "centered": True, "weight_decay": 0.01}
    tx = ft.inject_hyperparams(ft.rmsprop)(learning_rate=ft.piecewise_constant_schedule(1e-3, {5: 0.5}), **kwargs)
    run_parity(
        lambda m: torch.optim.RMSprop(m.parameters(), lr=1e-3, foreach=True, **kwargs),
        tx,
        scheduler=lambda o: torch.optim.lr_scheduler.MultiStepLR(o, [5], 0.5),
        change=set_both("alpha", "alpha", 0.8),
        device=device,
    )


ADAGRAD_CASES = {
    "default": {},
    "lr_decay": {"lr_decay": 0.1},
    "initial_wd": {"initial_accumulator_value": 0.1, "weight_decay": 0.05},
    "maximize_eps": {"maximize": True, "eps": 1e-3},
}


@pytest.mark.parametrize("kwargs", ADAGRAD_CASES.values(), ids=ADAGRAD_CASES.keys())
def test_adagrad(device, kwargs):
    run_parity(
        lambda m: torch.optim.Adagrad(m.parameters(), lr=0.05, foreach=True, **kwargs),
        ft.adagrad(0.05, **kwargs),
        device=device,
    )


def test_adagrad_injected_with_schedule_and_change(device):
    kwargs = {"lr_decay": 0.05, "initial_accumulator_value": 0.1, "weight_decay": 0.01}
    tx = ft.inject_hyperparams(ft.adagrad)(learning_rate=ft.exponential_decay(0.05, 1, 0.95), **kwargs)
    run_parity(
        lambda m: torch.optim.Adagrad(m.parameters(), lr=0.05, foreach=True, **kwargs),
        tx,
        scheduler=lambda o: torch.optim.lr_scheduler.ExponentialLR(o, 0.95),
        change=set_both("lr_decay", "lr_decay", 0.2),
        device=device,
    )


def test_adamw_mask_decays_only_masked_leaves(device):
    """adamw(mask=...) equals torch.optim.AdamW with two parameter groups (decay / no decay)."""

    def make_opt(model):
        decay = [p for p in model.parameters() if p.dim() > 1]
        no_decay = [p for p in model.parameters() if p.dim() <= 1]
        groups = [{"params": decay, "weight_decay": 0.3}, {"params": no_decay, "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=0.01, foreach=True)

    tx = ft.adamw(0.01, weight_decay=0.3, mask=lambda p: ft.tree.map(lambda x: x.dim() > 1, p))
    run_parity(make_opt, tx, steps=10, device=device)


@pytest.mark.parametrize(
    "factory, kwargs, exc, match",
    [
        (ft.sgd, {"learning_rate": 0.1, "momentum": 0.9, "nesterov": True, "dampening": 0.1}, ValueError, "dampening"),
        (ft.sgd, {"learning_rate": 0.1, "weight_decay": -1.0}, ValueError, "weight_decay must be >= 0"),
        (ft.sgd, {"learning_rate": 0.1, "maximize": "yes"}, TypeError, "maximize must be a bool"),
        (ft.adam, {"b1": 1.0}, ValueError, "b1 must be < 1"),
        (ft.adam, {"b2": -0.1}, ValueError, "b2 must be >= 0"),
        (ft.adam, {"eps": "small"}, TypeError, "eps must be a real number"),
        (ft.adam, {"amsgrad": 1}, TypeError, "amsgrad must be a bool"),
        (ft.adamw, {"weight_decay": float("nan")}, ValueError, "weight_decay must not be NaN"),
        (ft.rmsprop, {"alpha": 1.5}, ValueError, "decay must be < 1"),
        (ft.rmsprop, {"centered": None}, TypeError, "centered must be a bool"),
        (ft.adagrad, {"lr_decay": -0.5}, ValueError, "lr_decay must be >= 0"),
        (ft.adagrad, {"initial_accumulator_value": -1.0}, ValueError, "initial_accumulator_value must be >= 0"),
        (ft.adagrad, {"learning_rate": [0.1]}, TypeError, "learning_rate must be a real number"),
    ],
)
def test_bad_arguments(factory, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        factory(**kwargs)


@pytest.mark.parametrize(
    "factory", [ft.adam, lambda: ft.adamw(weight_decay=0.1), lambda: ft.sgd(0.1, weight_decay=0.1)]
)
def test_weight_decay_needs_params(factory):
    tx = factory()
    params = {"w": torch.ones(2)}
    state = tx.init(params)
    if factory is ft.adam:
        tx = ft.adam(weight_decay=0.1)
        state = tx.init(params)
    with pytest.raises(ValueError, match="needs the parameters"):
        tx.update({"w": torch.ones(2)}, state)


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
    "call",
    [
        lambda: ft.sgd(0.1, 0.9),
        lambda: ft.adam(1e-3, 0.9, 0.999, 1e-8, 1e-8),  # optax's 5th positional is eps_root: no silent weight decay
        lambda: ft.adamw(1e-3, 0.9),
        lambda: ft.rmsprop(1e-2, 0.9),
        lambda: ft.adagrad(1e-2, 0.1),
    ],
    ids=["sgd", "adam", "adamw", "rmsprop", "adagrad"],
)
def test_arguments_after_learning_rate_are_keyword_only(call):
    with pytest.raises(TypeError, match="positional argument"):
        call()
