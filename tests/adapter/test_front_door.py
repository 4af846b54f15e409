"""The doors of torch interop, named by what they return, and the older names, deprecated aliases for a release.

``ft.from_torch`` returns a transformation; ``ft.optimizer_from_torch`` an optimizer of the torch
class (through functopk); ``ft.optimizer_class_from_torch`` that optimizer's class;
``ft.TorchOptimizer.from_torch`` and ``.from_torch_class`` are the optimizer door's older names, and
``ft.sparse.sparse_optimizer_from_torch`` the sparse door's: each warns (``DeprecationWarning``) and works.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest
import torch

import functopk as ft
from tests.helpers import assert_tree_bitwise_equal


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1)).double()


def _train(make, steps: int = 3) -> list[torch.Tensor]:
    """The parameters after ``steps`` steps of the optimizer ``make(model)`` on a fixed batch, in float64."""
    model = _model()
    opt = make(model)
    x = torch.linspace(-1, 1, 15, dtype=torch.float64).reshape(5, 3)
    for _ in range(steps):
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    return [p.detach() for p in model.parameters()]


def test_each_door_returns_what_its_name_says():
    params = [torch.nn.Parameter(torch.ones(2))]
    tx = ft.from_torch(torch.optim.AdamW, lr=0.1)
    opt = ft.optimizer_from_torch(torch.optim.AdamW, params, lr=0.1)
    cls = ft.optimizer_class_from_torch(torch.optim.AdamW)
    assert isinstance(tx, ft.GradientTransformation)
    assert isinstance(opt, torch.optim.AdamW) and isinstance(opt, ft.ParamGroupOptimizer)
    assert not isinstance(opt, ft.TorchOptimizer)  # the optimizer door is not TorchOptimizer's constructor
    assert inspect.isclass(cls) and issubclass(cls, torch.optim.AdamW) and type(opt) is cls
    assert {"from_torch", "optimizer_from_torch", "optimizer_class_from_torch"} <= set(ft.__all__)


def test_the_optimizer_door_and_its_kept_aliases_step_as_torch_optim():
    """The new name, the alias and the alias's class all match torch.optim.AdamW bit for bit (float64)."""
    kwargs = {"lr": 0.05, "weight_decay": 0.1}
    theirs = _train(lambda m: torch.optim.AdamW(m.parameters(), **kwargs))
    door = _train(lambda m: ft.optimizer_from_torch(torch.optim.AdamW, m.parameters(), **kwargs))
    with pytest.warns(DeprecationWarning, match=r"TorchOptimizer\.from_torch is deprecated: use ft\.optimizer_from"):
        alias = _train(lambda m: ft.TorchOptimizer.from_torch(torch.optim.AdamW, m.parameters(), **kwargs))
    with pytest.warns(DeprecationWarning, match="use ft.optimizer_class_from_torch"):
        by_class = _train(lambda m: ft.TorchOptimizer.from_torch_class(torch.optim.AdamW)(m.parameters(), **kwargs))
    for ours in (door, alias, by_class):
        torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-14)
    assert_tree_bitwise_equal(door, alias)
    assert_tree_bitwise_equal(door, by_class)


def test_the_class_door_and_its_alias_give_the_same_class():
    sparsify = ft.topk(2)
    cls = ft.optimizer_class_from_torch(torch.optim.SGD, sparsify)
    with pytest.warns(DeprecationWarning):
        assert ft.TorchOptimizer.from_torch_class(torch.optim.SGD, sparsify) is cls
    assert cls.__name__ == "SGD" and cls is not ft.optimizer_class_from_torch(torch.optim.SGD)


def test_the_sparse_door_and_its_deprecated_alias_step_alike():
    params, kwargs = [torch.nn.Parameter(torch.arange(4.0))], {"k": 2, "lr": 0.5}
    with pytest.warns(DeprecationWarning, match="use ft.sparse_optimizer_from_torch"):
        old = ft.sparse.sparse_optimizer_from_torch(torch.optim.SGD, params, **kwargs)
    new = ft.sparse_optimizer_from_torch(torch.optim.SGD, [torch.nn.Parameter(torch.arange(4.0))], **kwargs)
    for opt in (old, new):
        opt.param_groups[0]["params"][0].mul(torch.tensor([1.0, -3.0, 2.0, 0.5])).sum().backward()
        opt.step()
    assert type(old) is type(new)
    assert_tree_bitwise_equal(old.param_groups[0]["params"][0].detach(), new.param_groups[0]["params"][0].detach())
    assert "sparse_optimizer_from_torch" not in ft.sparse.__all__


def test_no_two_public_classes_of_the_package_share_a_name():
    """A class's name says what it is: no two ``Layout``s (or any other pair) under one name."""
    where: dict[str, list[str]] = {}
    for info in pkgutil.walk_packages(ft.__path__, "functopk."):
        module = importlib.import_module(info.name)
        for name, obj in vars(module).items():
            if inspect.isclass(obj) and obj.__module__ == module.__name__ and not name.startswith("_"):
                where.setdefault(obj.__qualname__, []).append(module.__name__)
    assert {name: mods for name, mods in where.items() if len(mods) > 1} == {}


def test_group_scalar_sits_below_both_users_and_keeps_its_contract():
    """One home for torch's param-group values, importable by functopk.optim's tables and the adapter alike."""
    from functopk import _checks
    from functopk.optim import _shared

    assert not hasattr(_shared, "group_scalar")
    beta = torch.tensor([[0.9]], dtype=torch.float64)
    b1, b2 = _checks.group_scalar([beta, 0.99])
    assert b1.shape == () and b2 == 0.99
    beta.fill_(0.5)  # a scheduler's in-place change reaches the view
    assert b1.data_ptr() == beta.data_ptr() and b1 == 0.5
