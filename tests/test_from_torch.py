"""``ft.from_torch`` and ``optimizer_from_torch`` against torch.optim, on PyTorch's own test configurations.

``torch.testing._internal.common_optimizers.optim_db`` lists, per optimizer
class, the configurations PyTorch tests. For each class and configuration, 40
steps on a small model-like tree with a deterministic non-linear gradient field
are compared with torch.optim run in float64 (ground truth):

* float64: the functional form and the adapter agree with torch to ~1e-12;
* float32: the functional form's error is at most a small factor of torch float32's own error.
"""

from __future__ import annotations

import contextlib
import copy
import math

import pytest
import torch
from torch.testing._internal.common_optimizers import optim_db

import functopk as ft
from functopk.adapter.registry import IMPLEMENTATION_FLAGS

STEPS = 40
COVERED = {
    "ASGD", "Adadelta", "Adafactor", "Adagrad", "Adam", "AdamW", "Adamax", "Muon", "NAdam", "RAdam", "RMSprop",
    "Rprop", "SGD",
}  # fmt: skip
"""torch.optim minus LBFGS and SparseAdam: 13 classes."""


def _configs() -> list:
    out = []
    for info in optim_db:
        name = info.optim_cls.__name__
        if name not in COVERED:
            continue
        for i, cfg in enumerate(info.optim_inputs_func(device="cpu", dtype=torch.float64)):
            kwargs = {k: v for k, v in cfg.kwargs.items() if k not in IMPLEMENTATION_FLAGS}
            out.append(pytest.param(info.optim_cls, kwargs, id=f"{name}-{i}"))
    return out


CONFIGS = _configs()


def _shapes(cls: type) -> dict[str, tuple[int, ...]]:
    if cls.__name__ == "Muon":  # Muon takes 2-D parameters only
        return {"w1": (5, 3), "w2": (3, 4)}
    return {"w1": (5, 3), "b1": (3,), "w2": (3, 4, 2), "s": ()}


def _params(cls: type, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {k: torch.randn(shape, generator=g, dtype=torch.float64).to(dtype) for k, shape in _shapes(cls).items()}


def _grad(p: torch.Tensor) -> torch.Tensor:
    """A smooth non-linear gradient field (that of sum(-cos(3p)/3 + p**4/40))."""
    return torch.sin(3 * p) + 0.1 * p**3


def _kwargs_for(kwargs: dict, dtype: torch.dtype) -> dict:
    """Tensor hyperparameters in the run's dtype (torch wants a tensor lr to match)."""
    return {k: v.to(dtype) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}


@contextlib.contextmanager
def default_dtype_for(dtype: torch.dtype):
    """float64 runs happen with float64 as the default dtype, so that the per-parameter scalars torch and
    functopk keep in torch's scalar dtype (NAdam's mu_product, ASGD's eta and mu: float32 under the usual
    default) are float64 too: the float64 torch run is then float64 throughout, ground truth."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64 if dtype == torch.float64 else default)
    try:
        yield
    finally:
        torch.set_default_dtype(default)


def run_torch(cls: type, kwargs: dict, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    with default_dtype_for(dtype):
        params = {k: v.clone().requires_grad_() for k, v in _params(cls, dtype).items()}
        opt = cls(list(params.values()), **_kwargs_for(kwargs, dtype))
        for _ in range(STEPS):
            for p in params.values():
                p.grad = _grad(p.detach())
            opt.step()
    return {k: v.detach() for k, v in params.items()}


def run_functional(cls: type, kwargs: dict, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    with default_dtype_for(dtype):
        tx = ft.from_torch(cls, **_kwargs_for(kwargs, dtype))
        params = _params(cls, dtype)
        state = tx.init(params)
        for _ in range(STEPS):
            updates, state = tx.update({k: _grad(p) for k, p in params.items()}, state, params)
            params = ft.apply_updates(params, updates)
    return params


def run_adapter(cls: type, kwargs: dict, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    with default_dtype_for(dtype):
        params = {k: v.clone().requires_grad_() for k, v in _params(cls, dtype).items()}
        opt = ft.optimizer_from_torch(cls, list(params.values()), **_kwargs_for(kwargs, dtype))
        for _ in range(STEPS):
            for p in params.values():
                p.grad = _grad(p.detach())
            opt.step()
    return {k: v.detach() for k, v in params.items()}


def max_err(a: dict, b: dict) -> float:
    """Largest error relative to the size of the reference parameter."""
    return max(((a[k].double() - b[k].double()).abs().max() / (1.0 + b[k].double().abs().max())).item() for k in b)


def test_every_class_but_lbfgs_and_sparse_adam_is_covered():
    names = {info.optim_cls.__name__ for info in optim_db}
    assert names - {"LBFGS", "SparseAdam"} == COVERED
    for name in sorted(COVERED):
        ft.from_torch(getattr(torch.optim, name))  # defaults build


@pytest.mark.parametrize("cls, kwargs", CONFIGS)
def test_functional_and_adapter_match_torch_in_float64(cls, kwargs):
    truth = run_torch(cls, kwargs, torch.float64)
    assert max_err(run_functional(cls, kwargs, torch.float64), truth) < 1e-12
    assert max_err(run_adapter(cls, kwargs, torch.float64), truth) < 1e-12


@pytest.mark.parametrize("cls, kwargs", CONFIGS)
def test_functional_float32_error_is_torch_float32_error(cls, kwargs):
    truth = run_torch(cls, kwargs, torch.float64)
    theirs = max_err(run_torch(cls, kwargs, torch.float32), truth)
    ours = max_err(run_functional(cls, kwargs, torch.float32), truth)
    assert math.isfinite(ours)
    assert ours <= 4 * theirs + 1e-6, (ours, theirs)


@pytest.mark.parametrize(
    "cls, kwargs, exc",
    [
        (torch.optim.Adam, {"lr": -1.0}, ValueError),
        (torch.optim.Adam, {"betas": (1.5, 0.9)}, ValueError),
        (torch.optim.SGD, {"lr": 0.1, "nesterov": True}, ValueError),
        (torch.optim.SGD, {"lr": 0.1, "momentm": 0.9}, TypeError),
        (torch.optim.RMSprop, {"alpha": -0.5}, ValueError),
        # implementation flags pass through torch's checks too
        (torch.optim.Adam, {"lr": torch.tensor(0.01), "foreach": True}, ValueError),
        (torch.optim.AdamW, {"fused": True, "foreach": True}, RuntimeError),
        (torch.optim.SGD, {"lr": 0.1, "fused": True, "differentiable": True}, RuntimeError),
        (torch.optim.RMSprop, {"fused": True}, TypeError),
    ],
)
def test_validation_errors_are_torchs(cls, kwargs, exc):
    with pytest.raises(exc) as theirs:
        cls([torch.zeros(2, 2, requires_grad=True)], **kwargs)
    with pytest.raises(exc) as ours:
        ft.from_torch(cls, **kwargs)
    assert str(ours.value) == str(theirs.value)


@pytest.mark.parametrize("bad", [torch.optim.LBFGS, torch.optim.SparseAdam])
def test_lbfgs_and_sparse_adam_say_why_not(bad):
    with pytest.raises(ValueError, match="optimizer_class torch.optim.*has no functopk form"):
        ft.from_torch(bad)


@pytest.mark.parametrize("bad", [torch.optim.Optimizer, "Adam", torch.nn.Linear, type("Mine", (torch.optim.SGD,), {})])
def test_not_a_torch_optim_class_is_rejected(bad):
    with pytest.raises((TypeError, ValueError), match="optimizer_class"):
        ft.from_torch(bad)


@pytest.mark.parametrize("flags", [{"foreach": True}, {"foreach": False}, {"fused": True}, {"fused": False}])
def test_foreach_and_fused_choose_torchs_kernel_only(flags):
    plain = run_functional(torch.optim.Adam, {"lr": 0.01}, torch.float64)
    assert max_err(run_functional(torch.optim.Adam, {"lr": 0.01, **flags}, torch.float64), plain) == 0.0
    truth = run_torch(torch.optim.Adam, {"lr": 0.01, **flags}, torch.float64)  # torch's kernel for these flags
    assert max_err(run_adapter(torch.optim.Adam, {"lr": 0.01, **flags}, torch.float64), truth) < 1e-12


@pytest.mark.parametrize("flag", ["capturable", "differentiable"])
def test_capturable_and_differentiable_are_refused_by_name(flag):
    torch.optim.Adam([torch.zeros(2, requires_grad=True)], **{flag: True})  # torch accepts them
    with pytest.raises(NotImplementedError, match=f"{flag}=True is not supported.*Leave {flag}=False"):
        ft.from_torch(torch.optim.Adam, **{flag: True})
    ft.from_torch(torch.optim.Adam, **{flag: False})


@pytest.mark.parametrize("shape", [(1,), (1, 1)])
def test_betas_may_be_one_element_tensors(shape):
    betas = (torch.full(shape, 0.8, dtype=torch.float64), torch.full(shape, 0.99, dtype=torch.float64))
    ours = run_functional(torch.optim.Adam, {"lr": 0.01, "betas": betas}, torch.float64)
    truth = run_torch(torch.optim.Adam, {"lr": 0.01, "betas": (0.8, 0.99)}, torch.float64)
    assert max_err(ours, truth) < 1e-12


# Every float hyperparameter as a 0-d float64 tensor; the cases cover all 13 classes and every branch that
# combines a hyperparameter with a constant (SGD with and without dampening, RMSprop centered, Adagrad with
# and without lr_decay, decoupled decay).
TENSOR_CASES = {
    "SGD-dampening": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "dampening": 0.3, "weight_decay": 0.01}),
    "SGD-nesterov": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01}),
    "Adam-amsgrad": (torch.optim.Adam, {"lr": 0.1, "betas": (0.9, 0.99), "eps": 1e-3, "amsgrad": True}),
    "AdamW": (torch.optim.AdamW, {"lr": 0.1, "betas": (0.9, 0.99), "eps": 1e-3, "weight_decay": 0.1}),
    "RMSprop-centered": (
        torch.optim.RMSprop,
        {"lr": 0.1, "alpha": 0.9, "eps": 1e-3, "weight_decay": 0.01, "momentum": 0.5, "centered": True},
    ),
    "Adagrad": (torch.optim.Adagrad, {"lr": 0.1, "weight_decay": 0.01, "eps": 1e-3}),
    "Adagrad-lr_decay": (torch.optim.Adagrad, {"lr": 0.1, "lr_decay": 0.1, "eps": 1e-3}),
    "Adadelta": (torch.optim.Adadelta, {"lr": 0.5, "rho": 0.8, "eps": 1e-3, "weight_decay": 0.01}),
    "Rprop": (torch.optim.Rprop, {"lr": 0.1, "etas": (0.4, 1.3), "step_sizes": (0.05, 0.12)}),
    "ASGD": (torch.optim.ASGD, {"lr": 0.1, "lambd": 0.01, "alpha": 0.7, "t0": 1.0, "weight_decay": 0.01}),
    "NAdam": (torch.optim.NAdam, {"lr": 0.1, "betas": (0.9, 0.99), "weight_decay": 0.1, "momentum_decay": 0.004}),
    "RAdam-decoupled": (
        torch.optim.RAdam,
        {"lr": 0.1, "betas": (0.9, 0.9), "eps": 1e-3, "weight_decay": 0.1, "decoupled_weight_decay": True},
    ),
    "Adamax": (torch.optim.Adamax, {"lr": 0.1, "betas": (0.9, 0.99), "eps": 1e-3, "weight_decay": 0.01}),
    "Adafactor": (torch.optim.Adafactor, {"lr": 0.1, "beta2_decay": -0.8, "eps": (0.3, 1e-3), "d": 1.0}),
    "Muon": (torch.optim.Muon, {"lr": 0.1, "weight_decay": 0.01, "momentum": 0.9, "nesterov": True}),
}  # fmt: skip


def _tensor_kwargs(kwargs: dict) -> dict:
    """Fresh 0-d float64 tensors for every float (pairs included)."""
    def tensor(v):
        return torch.tensor(v, dtype=torch.float64) if isinstance(v, float) else v

    return {k: tuple(map(tensor, v)) if isinstance(v, tuple) else tensor(v) for k, v in kwargs.items()}


def _change_in_place_(kwargs: dict) -> None:
    """Every tensor but ``lr`` (the scheduler's) scaled in place, within each hyperparameter's valid range."""
    for name, value in kwargs.items():
        for t in value if isinstance(value, tuple) else (value,):
            if name != "lr" and isinstance(t, torch.Tensor):
                t.mul_(0.9 if name == "etas" else 0.5)


def _run_with_changes(cls: type, kwargs: dict, how: str, change: bool = True) -> dict[str, torch.Tensor]:
    """8 steps, with ``ExponentialLR(gamma=0.5)`` (``lr.mul_(0.5)`` for the functional form) and
    :func:`_change_in_place_` after the 3rd."""
    kwargs = _tensor_kwargs(kwargs)
    with default_dtype_for(torch.float64):
        params = _params(cls, torch.float64)
        if how == "functional":
            tx = ft.from_torch(cls, **kwargs)
            state = tx.init(params)
        else:
            params = {k: v.requires_grad_() for k, v in params.items()}
            make = cls if how == "torch" else lambda ps, **kw: ft.optimizer_from_torch(cls, ps, **kw)
            opt = make(list(params.values()), **kwargs)
            scheduler = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.5)
        for i in range(8):
            if how == "functional":
                updates, state = tx.update({k: _grad(p) for k, p in params.items()}, state, params)
                params = ft.apply_updates(params, updates)
            else:
                for p in params.values():
                    p.grad = _grad(p.detach())
                opt.step()
            if i == 2 and change:
                _change_in_place_(kwargs)
                if how == "functional":
                    kwargs["lr"].mul_(0.5)
                else:
                    scheduler.step()
    return {k: v.detach() for k, v in params.items()}


@pytest.mark.parametrize("cls, kwargs", TENSOR_CASES.values(), ids=TENSOR_CASES.keys())
def test_tensor_hyperparameters_changed_in_place_are_read_at_the_next_step(cls, kwargs):
    truth = _run_with_changes(cls, kwargs, "torch")
    assert max_err(_run_with_changes(cls, kwargs, "torch", change=False), truth) > 1e-3  # the changes matter
    assert max_err(_run_with_changes(cls, kwargs, "functional"), truth) < 1e-12
    assert max_err(_run_with_changes(cls, kwargs, "adapter"), truth) < 1e-12


@pytest.mark.parametrize("name", sorted(COVERED))
def test_loggers_and_isinstance_see_the_torch_class(name):
    """Lightning's LearningRateMonitor logs lr-{type(opt).__name__}; code checks isinstance(opt, torch.optim.X)."""
    cls = getattr(torch.optim, name)
    params = [torch.zeros(2, 2, requires_grad=True)]
    made = [
        ft.optimizer_from_torch(cls, params),
        ft.optimizer_from_torch(cls, params, sparsify=ft.topk(1)),
        ft.optimizer_class_from_torch(cls)(params),
        ft.optimizer_class_from_torch(cls, ft.topk(1))(params),
    ]
    for opt in made:
        assert type(opt).__name__ == name
        assert isinstance(opt, cls) and isinstance(opt, ft.ParamGroupOptimizer)
    assert type(made[0]) is type(made[1]) is type(made[2])  # one class per torch class; sparsify is an argument
    with pytest.raises(NotImplementedError, match=r"torch\.optim\..*\._init_group is torch.s implementation"):
        made[0]._init_group()  # torch's own helpers are not inherited (they would run torch's maths)
    if name == "Adagrad":
        with pytest.raises(NotImplementedError, match="share_memory"):
            made[0].share_memory()


def _forbidden(owner: type, name: str):
    original = getattr(owner, name, None)  # before patching: torch's own method (a base's, if owner has none)

    def method(*args, **kwargs):
        if args and isinstance(args[0], ft.ParamGroupOptimizer):
            raise AssertionError(f"{owner.__name__}.{name} ran")
        return original(*args, **kwargs)  # torch's own throw-away instances (argument and checkpoint checks)

    method.hooked = True  # so that torch.optim.Optimizer.__init__ does not wrap (and set) the class's step
    return method


@pytest.mark.parametrize("name", sorted(COVERED))
def test_no_method_of_the_torch_class_runs(name, monkeypatch):
    """The class subclasses torch's, but steps, loads and copies with functopk's and torch.optim.Optimizer's code.

    (Only ``__init__`` runs on it; torch's methods run on torch's own throw-away instances, which check the
    arguments and fill an older checkpoint's group keys as torch does.)
    """
    cls = getattr(torch.optim, name)
    truth = run_torch(cls, {}, torch.float64)
    owners = cls.__mro__[: cls.__mro__.index(torch.optim.Optimizer)]
    names = {attr for owner in owners for attr, value in vars(owner).items() if callable(value) and attr != "__init__"}
    for owner in owners:
        for attr in names:
            monkeypatch.setattr(owner, attr, _forbidden(owner, attr), raising=False)
    with default_dtype_for(torch.float64):
        params = _params(cls, torch.float64)
        opt = ft.optimizer_from_torch(cls, list(params.values()))
        for i in range(STEPS):
            for p in params.values():
                p.grad = _grad(p.detach())
            opt.step()
            if i == 1:  # a reload and a copy on the way
                opt.load_state_dict(opt.state_dict())
                params, opt = copy.deepcopy((params, opt))
        opt.zero_grad()
    assert max_err(params, truth) < 1e-12
