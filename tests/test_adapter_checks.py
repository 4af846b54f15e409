"""What both ``torch.optim`` adapters refuse, side by side with what ``torch.optim`` does.

``ft.TorchOptimizer(params, tx)`` and ``ft.optimizer_from_torch(cls, params, ...)``
refuse a parameter listed twice in one group (torch warns and steps it twice) and
the implementation flags whose behaviour functopk does not give; both leave the
optimizer as it was.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import functopk as ft

ADAPTERS = {
    "TorchOptimizer": lambda params: ft.TorchOptimizer(params, ft.chain(ft.topk(3), ft.sgd(0.1))),
    "from_torch": lambda params: ft.optimizer_from_torch(torch.optim.SGD, params, ft.topk(3), lr=0.1),
}


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(3, 2).double()


def grads_(model: torch.nn.Module) -> None:
    model.zero_grad()
    model(torch.ones(4, 3, dtype=torch.float64)).square().sum().backward()


# --------------------------------------------------------------------------- a parameter listed twice


@pytest.mark.parametrize("make", ADAPTERS.values(), ids=list(ADAPTERS))
def test_a_parameter_listed_twice_is_refused_where_torch_warns(make):
    model = make_model()
    w, b = model.weight, model.bias
    with pytest.warns(UserWarning, match="duplicate parameters"):
        torch.optim.SGD([w, b, w], lr=0.1)  # torch: deprecated; it would step w twice
    with pytest.raises(ValueError, match="param group 0 lists one parameter twice, at positions 0 and 2"):
        make([w, b, w])
    with pytest.raises(ValueError, match="named 'w' and 'again'"):
        make([("w", w), ("b", b), ("again", w)])
    opt = make([w])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the error replaces torch's warning
        with pytest.raises(ValueError, match="param group 1 lists one parameter twice, at positions 0 and 1"):
            opt.add_param_group({"params": [b, b]})
    with pytest.raises(ValueError, match="some parameters appear in more than one parameter group"):  # torch's
        opt.add_param_group({"params": [b, w]})
    assert len(opt.param_groups) == 1 and opt.param_groups[0]["params"][0] is w
    grads_(model)
    before = w.detach().clone()
    opt.step()  # the optimizer still works, on w alone
    assert int((w != before).sum()) == 3


# --------------------------------------------------------------------------- implementation flags


@pytest.mark.parametrize("flag", ["capturable", "differentiable"])
def test_capturable_and_differentiable_are_refused_at_every_door(flag):
    model = make_model()
    refused = pytest.raises(NotImplementedError, match=f"{flag}=True is not supported")
    with refused:
        ft.optimizer_from_torch(torch.optim.Adam, model.parameters(), **{flag: True})
    with refused:
        ft.optimizer_class_from_torch(torch.optim.Adam)(model.parameters(), **{flag: True})
    opt = ft.optimizer_from_torch(torch.optim.Adam, [model.weight], lr=0.1)
    with refused:
        opt.add_param_group({"params": [model.bias], flag: True})
    assert len(opt.param_groups) == 1
    grads_(model)
    opt.step()
    # set by hand between steps: the next step refuses before changing anything
    opt.param_groups[0][flag] = True
    weight, exp_avg = model.weight.detach().clone(), opt.state[model.weight]["exp_avg"].clone()
    with refused:
        opt.step()
    assert torch.equal(model.weight, weight) and torch.equal(opt.state[model.weight]["exp_avg"], exp_avg)
    opt.param_groups[0][flag] = False
    opt.step()
    assert not torch.equal(model.weight, weight)


def test_fused_parameters_torch_refuses_raise_torchs_error_at_the_step_as_torch():
    """torch checks fused=True's devices and dtypes as it steps: construction and add_param_group accept them."""
    p = torch.zeros(2, dtype=torch.complex128, requires_grad=True)
    theirs = torch.optim.Adam([p], fused=True)
    p.grad = torch.ones_like(p)
    with pytest.raises(RuntimeError) as torch_error:
        theirs.step()
    ours = ft.optimizer_from_torch(torch.optim.Adam, [p], fused=True)
    with pytest.raises(RuntimeError) as our_error:
        ours.step()
    assert str(our_error.value) == str(torch_error.value) and not ours.state and torch.equal(p, torch.zeros(2))
    q = torch.zeros(2, requires_grad=True)
    opt = ft.optimizer_from_torch(torch.optim.Adam, [q], fused=True)
    opt.add_param_group({"params": [p]})
    q.grad = torch.ones_like(q)
    with pytest.raises(RuntimeError, match="`fused=True` requires all the params to be floating point"):
        opt.step()
    assert not opt.state and torch.equal(q, torch.zeros(2))
    p.grad = None  # the complex parameter without a gradient takes no part: the step runs
    opt.step()
    assert not torch.equal(q, torch.zeros(2))
