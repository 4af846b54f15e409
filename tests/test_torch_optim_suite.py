"""PyTorch's own optimizer tests (test/test_optim.py, ``TestOptimRenewed``) that ``optimizer_from_torch`` once failed.

Run on CPU with each of the 13 classes swapped for ``ft.optimizer_class_from_torch(cls)``, every test of
torch's suite that passes with ``torch.optim`` passes with functopk, except where functopk refuses on purpose
(``differentiable=True``; a parameter listed twice): docs/interop.md lists those. torch's test file is not
in the wheel; these are the cases that failed, written against the same configurations
(``torch.testing._internal.common_optimizers.optim_db``), so that they stay fixed.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.testing._internal.common_optimizers import optim_db

import functopk as ft
from tests.test_from_torch import COVERED

INFOS = [pytest.param(info, id=info.optim_cls.__name__) for info in optim_db if info.optim_cls.__name__ in COVERED]


def _configurations(info) -> list[dict]:
    """Each configuration torch tests for the class, with its implementation flags (foreach, fused) varied as
    torch's suite varies them, ``differentiable=True`` left out (refused on purpose)."""
    out = []
    for cfg in info.optim_inputs_func(device="cpu"):
        out.append(dict(cfg.kwargs))
        for flag in ("foreach", "fused"):
            if flag in info.supported_impls and (flag != "fused" or "cpu" in info.supports_fused_on):
                out.append({**cfg.kwargs, flag: True})
    return out


@pytest.mark.parametrize("info", INFOS)
def test_a_state_dict_pre_hook_may_put_any_entry_into_the_state(info):
    """torch's ``test_state_dict_pre_hook``: the hook sets ``optimizer.state["test"] = 1``."""
    cls = ft.optimizer_class_from_torch(info.optim_cls)
    for kwargs in _configurations(info):
        param = torch.rand(2, 3, requires_grad=True)
        opt = cls([param], **kwargs)
        param.grad = torch.rand_like(param)
        opt.step()  # (and with a state of its own, which state_dict copies)
        opt.register_state_dict_pre_hook(lambda o: o.state.__setitem__("test", 1))
        saved = opt.state_dict()
        assert saved["state"]["test"] == 1
        entry = saved["state"].get(0, {})  # (none for SGD without momentum, as in torch)
        assert set(entry) == set(opt.state.get(param, {})) and all(
            v is not opt.state[param][k] for k, v in entry.items() if isinstance(v, torch.Tensor)
        )


@pytest.mark.parametrize("info", INFOS)
def test_load_state_dict_pre_hooks_run_in_order_and_their_dict_is_loaded(info):
    """torch's ``test_load_state_dict_pre_hook_and_prepend``, loading twice into one optimizer."""

    def set_lr(opt, state_dict):
        state_dict["param_groups"][0]["lr"] = 0.002

    def replace(opt, state_dict):
        mine = copy.deepcopy(state_dict)
        mine["param_groups"][0]["lr"] = 0.003
        return mine

    cls = ft.optimizer_class_from_torch(info.optim_cls)
    for kwargs in _configurations(info):
        opt = cls([torch.rand(2, 3, requires_grad=True)], **kwargs)
        saved = opt.state_dict()
        opt.register_load_state_dict_pre_hook(set_lr)
        opt.load_state_dict(saved)
        assert opt.param_groups[0]["lr"] == 0.002
        opt.register_load_state_dict_pre_hook(replace, prepend=True)
        opt.load_state_dict(saved)  # (torch's own load added 'differentiable' to defaults: not a group key here)
        assert opt.param_groups[0]["lr"] == 0.002


@pytest.mark.parametrize("cls", [torch.optim.Adagrad, torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD])
def test_fused_on_meta_parameters_raises_at_the_step_and_steps_once_they_are_real(cls):
    """PyTorch's own test_fused_error_on_params_on_meta, for the four classes with a fused CPU kernel."""
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Sigmoid(), torch.nn.Linear(3, 1))
    opt = ft.optimizer_from_torch(cls, model.parameters(), fused=True)
    with torch.device("meta"):
        for p in model.parameters():
            p.grad = torch.rand_like(p)
    with pytest.raises(RuntimeError, match="`fused=True` requires all the params to be floating point Tensors"):
        opt.step()
    assert not opt.state
    opt.zero_grad(set_to_none=True)
    model.to_empty(device="cpu")  # (new Parameter objects: the optimizer's keep no gradient, the step does nothing)
    for p in model.parameters():
        with torch.no_grad():
            p.copy_(torch.randn_like(p))  # (to_empty leaves them uninitialised)
        p.grad = torch.rand_like(p)
    opt.step()
    opt.param_groups[0]["params"] = list(model.parameters())  # the real ones: they step
    before = [p.detach().clone() for p in opt.param_groups[0]["params"]]
    opt.step()
    assert all(not torch.equal(p, b) for p, b in zip(opt.param_groups[0]["params"], before))
