"""adafactor against torch.optim.Adafactor, step by step, on a small tree with a non-linear gradient field.

Both sides run free from the same start for 40 steps, each evaluating the
gradient ``sin(3 p) + p**3`` at its own parameters, and the parameters are
compared after every step (1e-12 relative to each leaf's size in float64); the
states are compared at the end through ``TORCH_STATE_NAMES``. The configurations
follow ``optim_inputs_func_adafactor`` of torch's ``optim_db``, plus a large lr
(so that ``rho = 1/sqrt(t)``, not ``lr``) and explicit epsilons.
"""

from __future__ import annotations

import functools

import pytest
import torch

import functopk as ft
from functopk.optim.adafactor import TORCH_BUILDERS, TORCH_STATE_NAMES, AdafactorState, adafactor
from tests.optim.common import run_pure
from tests.optim.torch_parity import assert_float32_like_torch, assert_histories, field, rel_err, run_ours, torch_runner
from tests.optim.torch_parity import start as start_with

SHAPES = {"scalar": (), "vec": (5,), "mat": (4, 3), "cube": (2, 3, 4)}
TORCH_DEFAULT_LR = 1e-2


def assert_states(state, opt, tp, rtol=1e-12):
    """Our state equals torch's per-parameter entries, key for key through TORCH_STATE_NAMES."""
    names = TORCH_STATE_NAMES["Adafactor"]
    for k, p in tp.items():
        torch_state = opt.state[p]
        for field_name, key in names.items():
            ours = getattr(state, field_name)
            ours = ours if field_name == "count" else ours[k]
            if field_name != "count" and ours.numel() == 0 and p.numel() != 0:
                assert key not in torch_state, (k, key)
                continue
            theirs = torch_state[key]
            assert ours.shape == theirs.shape, (k, key, ours.shape, theirs.shape)
            torch.testing.assert_close(ours.to(theirs.device, theirs.dtype), theirs, rtol=rtol, atol=0.0)


# torch's foreach Adafactor (its default on a GPU) rounds differently; test_parity_with_torch_foreach covers it
run_torch = functools.partial(torch_runner(torch.optim.Adafactor), foreach=False)


def start(device, dtype=torch.float64, shapes=SHAPES):
    return start_with(shapes, device, dtype)


CASES = {
    "default": {},
    "weight_decay": {"weight_decay": 0.1, "lr": 0.01},
    "maximize": {"weight_decay": 0.1, "maximize": True},
    "beta2_decay": {"beta2_decay": -1.0},
    "clip_d": {"d": 1.5},
    "large_lr_eps": {"lr": 0.3, "eps": (1e-3, 1e-2), "weight_decay": 0.05},
    "eps1_zero": {"eps": (0.0, 1e-3), "d": 2.0},
}


def ours_for(kwargs):
    kw = dict(kwargs)
    return adafactor(kw.pop("lr", TORCH_DEFAULT_LR), **kw)


@pytest.mark.parametrize("kwargs", CASES.values(), ids=CASES.keys())
def test_parity_float64(device, kwargs):
    p0 = start(device)
    theirs, opt, tp = run_torch(p0, **kwargs)
    ours, state = run_ours(ours_for(kwargs), p0)
    assert_histories(ours, theirs)
    assert_states(state, opt, tp)
    assert rel_err(ours[-1], p0) > 1e-3  # the run really moved


def test_parity_with_torch_foreach(device):
    """torch's foreach implementation rounds its last step differently; both agree with this one."""
    kwargs = {"lr": 0.2, "weight_decay": 0.1, "d": 1.2}
    p0 = start(device)
    theirs, _, _ = run_torch(p0, foreach=True, **kwargs)
    ours, _ = run_ours(ours_for(kwargs), p0)
    assert_histories(ours, theirs)


@pytest.mark.parametrize("name", ["default", "maximize", "large_lr_eps"])
def test_float32_error_like_torch(device, name):
    """In float32, the error against torch's float64 run is at most 4x torch float32's own (plus 1e-7)."""
    kwargs = CASES[name]
    p64 = start(device)
    assert_float32_like_torch(run_torch, ours_for(kwargs), p64, 1e-7, **kwargs)


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"lr": torch.tensor(0.3), "weight_decay": 0.1}, {"lr": torch.tensor([0.05]), "maximize": True,
                                                         "eps": (1e-4, 1e-2), "d": 1.3, "beta2_decay": -0.6}],
    ids=["defaults", "tensor_lr", "one_element_lr_all_options"],
)
def test_torch_builder(device, kwargs):
    """The builder, given torch's own complete param group, reproduces torch."""
    p0 = start(device)
    kwargs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    group = dict(torch.optim.Adafactor([torch.nn.Parameter(torch.zeros(1))], **kwargs).param_groups[0])
    del group["params"]
    theirs, _, _ = run_torch(p0, **kwargs)
    ours, _ = run_ours(TORCH_BUILDERS["Adafactor"](group), p0)
    assert_histories(ours, theirs)


def test_tensor_hyperparameters(device):
    """Every numeric hyperparameter as a 0-d tensor (float64: exact parity)."""
    kwargs = {"lr": 0.2, "beta2_decay": -0.7, "eps": (1e-5, 2e-3), "d": 1.4, "weight_decay": 0.05}

    def t(x):
        return torch.tensor(x, dtype=torch.float64, device=device)

    tx = adafactor(t(0.2), beta2_decay=t(-0.7), eps=(t(1e-5), t(2e-3)), d=t(1.4), weight_decay=t(0.05))
    p0 = start(device)
    theirs, _, _ = run_torch(p0, **kwargs)
    ours, _ = run_ours(tx, p0)
    assert_histories(ours, theirs)


def test_inject_hyperparams(device):
    """Under inject_hyperparams (float32 tensors) the float32 run equals the plain one to float32 rounding."""
    kwargs = {"beta2_decay": -0.75, "d": 1.25, "weight_decay": 0.1}
    p0 = start(device, torch.float32)
    plain, _ = run_ours(adafactor(0.25, **kwargs), p0, steps=10)
    injected, state = run_ours(ft.inject_hyperparams(adafactor)(learning_rate=0.25, **kwargs), p0, steps=10)
    assert rel_err(injected[-1], plain[-1]) < 1e-5
    assert set(state.hyperparams) == {"learning_rate", "beta2_decay", "d", "weight_decay"}


def test_schedule(device):
    """An lr schedule equals torch with the same lr set by a scheduler at every step."""
    p0 = start(device)
    theirs, _, _ = run_torch(p0, lr=0.5, weight_decay=0.1, scheduler=lambda o: torch.optim.lr_scheduler.LambdaLR(
        o, lambda step: 0.8**step))
    ours, _ = run_ours(adafactor(lambda count: 0.5 * 0.8 ** count.double(), weight_decay=0.1), p0)
    assert_histories(ours, theirs)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"learning_rate": -1.0}, ValueError, "learning_rate"),
        ({"learning_rate": "0.1"}, TypeError, "learning_rate"),
        ({"beta2_decay": 0.5}, ValueError, "beta2_decay"),
        ({"beta2_decay": None}, TypeError, "beta2_decay"),
        ({"eps": (-1e-30, 1e-3)}, ValueError, "eps1"),
        ({"eps": (None, -1.0)}, ValueError, "eps2"),
        ({"eps": 1e-3}, TypeError, "eps"),
        ({"eps": (None, 1e-3, 1.0)}, ValueError, "eps"),
        ({"eps": ("a", 1e-3)}, TypeError, "eps1"),
        ({"d": 0.5}, ValueError, "d must"),
        ({"weight_decay": -0.1}, ValueError, "weight_decay"),
        ({"maximize": 1}, TypeError, "maximize"),
    ],
)
def test_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        adafactor(**kwargs)


def test_pure(device):
    params = start(device)
    grads = {k: field(v) for k, v in params.items()}
    run_pure(adafactor(0.1, weight_decay=0.1, maximize=True), params=params, grads=grads)


def test_state_layout_and_torch_keys(device):
    """Placeholders stand where torch has no key; the mapped names are exactly torch's keys."""
    p0 = start(device)
    state = adafactor().init(p0)
    assert isinstance(state, AdafactorState) and state.count.dtype == torch.int64
    _, opt, tp = run_torch(p0, steps=1)
    names = TORCH_STATE_NAMES["Adafactor"]
    for k, p in tp.items():
        present = {names["count"]} | {
            names[f] for f in ("row_var", "col_var", "variance") if getattr(state, f)[k].numel() > 0
        }
        assert present == set(opt.state[p]), (k, present, set(opt.state[p]))
        for f in ("row_var", "col_var", "variance"):
            leaf = getattr(state, f)[k]
            assert leaf.dtype == p0[k].dtype and leaf.device == p0[k].device
            if f in opt.state[p]:
                assert leaf.shape == opt.state[p][f].shape
            else:
                assert leaf.shape == (0,)


def test_state_checks(device):
    p0 = start(device)
    tx = adafactor()
    state = tx.init(p0)
    grads = {k: field(v) for k, v in p0.items()}
    with pytest.raises(ValueError, match="needs the parameters"):
        tx.update(grads, state)
    with pytest.raises(TypeError, match="AdafactorState"):
        tx.update(grads, tuple(state), p0)
    bad = state._replace(row_var={**state.row_var, "mat": torch.zeros(4, 3, device=device, dtype=torch.float64)})
    with pytest.raises(ValueError, match=r"row_var\) leaf at \['mat'\].*needs shape \(4, 1\)"):
        tx.update(grads, bad, p0)
    with pytest.raises(ValueError, match=r"state \(row_var\) does not have the tree structure"):
        tx.update({**grads, "extra": grads["vec"]}, state, {**p0, "extra": p0["vec"]})
    with pytest.raises(TypeError, match="floating-point"):
        tx.init({"w": torch.zeros(2, dtype=torch.int64)})


def test_empty_tree_and_mixed_dtypes(device):
    tx = adafactor()
    updates, state = tx.update({}, tx.init({}), {})
    assert updates == {} and state.count == 1
    params = {"h": torch.ones(3, 2, dtype=torch.bfloat16, device=device), "f": torch.ones(2, device=device)}
    updates, state = tx.update(params, tx.init(params), params)
    assert updates["h"].dtype == torch.bfloat16 and state.row_var["h"].dtype == torch.bfloat16
    torch.testing.assert_close(updates["f"], torch.full((2,), -1e-2, device=device))
