"""``from_torch`` rounds as the ``torch.optim`` implementation torch would run, with float64 parameters under
torch's default float32 dtype (its per-parameter scalars, NAdam's ``mu_product`` and ASGD's ``eta`` and ``mu``,
are then float32) and with a float32 tensor ``lr``.

torch's for-loop (its CPU default) and foreach implementations round a few scalars differently (ASGD's ``eta``;
a tensor ``lr`` enters Adam's, Adamax's and NAdam's step sizes in its own dtype in the for-loop, RAdam's in the
foreach kernels, Adagrad's ``lr_decay`` in both, every decoupled decay ``1 - lr * weight_decay``). In float64
those differences were 1e-9 to 1e-6 relative: here both doors must agree with torch to 1e-12.
"""

from __future__ import annotations

import pytest
import torch

import functopk as ft

STEPS = 10  # (RAdam rectifies from its 6th step with b2 = 0.999)
CASES = {
    "Adam": (torch.optim.Adam, {"weight_decay": 0.1, "amsgrad": True}),
    "AdamW": (torch.optim.AdamW, {"weight_decay": 0.1}),
    "Adamax": (torch.optim.Adamax, {"weight_decay": 0.1}),
    "NAdam": (torch.optim.NAdam, {"weight_decay": 0.1, "momentum_decay": 0.01}),
    "NAdamW": (torch.optim.NAdam, {"weight_decay": 0.1, "decoupled_weight_decay": True}),
    "RAdamW": (torch.optim.RAdam, {"weight_decay": 0.1, "decoupled_weight_decay": True}),
    "Adagrad-lr_decay": (torch.optim.Adagrad, {"lr_decay": 0.1}),
    "ASGD": (torch.optim.ASGD, {}),
    "ASGD-t0": (torch.optim.ASGD, {"lambd": 0.01, "alpha": 0.5, "t0": 3, "weight_decay": 0.1}),
}
FOREACH = [None, False, True, "yes"]  # (torch takes any value for its truth; so does functopk)


def _params() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randn(shape, generator=gen, dtype=torch.float64) for shape in ((4, 3), (5,), ())]


def _grad(p: torch.Tensor) -> torch.Tensor:
    return torch.sin(3 * p) + 0.1 * p**3


def _run(make, steps: int = STEPS) -> list[torch.Tensor]:
    params = [p.requires_grad_() for p in _params()]
    opt = make(params)
    for _ in range(steps):
        for p in params:
            p.grad = _grad(p.detach())
        opt.step()
    return [p.detach() for p in params]


def _functional(cls: type, kwargs: dict) -> list[torch.Tensor]:
    tx = ft.from_torch(cls, **kwargs)
    params = _params()
    state = tx.init(params)
    for _ in range(STEPS):
        updates, state = tx.update([_grad(p) for p in params], state, params)
        params = ft.apply_updates(params, updates)
    return params


def _assert_close(ours: list[torch.Tensor], theirs: list[torch.Tensor]) -> None:
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("lr", ["number", "tensor"])
@pytest.mark.parametrize("foreach", FOREACH, ids=repr)
@pytest.mark.parametrize("case", list(CASES))
def test_both_doors_round_as_the_torch_implementation_that_runs(case, foreach, lr):
    assert torch.get_default_dtype() == torch.float32
    cls, kwargs = CASES[case]
    kwargs = {**kwargs, "lr": torch.tensor(0.01) if lr == "tensor" else 0.01, "foreach": foreach}
    try:
        theirs = _run(lambda ps: cls(ps, **kwargs))
    except (RuntimeError, ValueError) as err:  # torch refuses the combination (Adam: foreach with a tensor lr)
        with pytest.raises(type(err)):
            ft.from_torch(cls, **kwargs)
        return
    _assert_close(_run(lambda ps: ft.optimizer_from_torch(cls, ps, **kwargs)), theirs)
    _assert_close(_functional(cls, kwargs), theirs)
