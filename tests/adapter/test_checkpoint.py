"""``optimizer_from_torch`` checkpoints against ``torch.optim``'s, in both directions.

Each test runs a torch.optim optimizer and the adapter side by side on the same
float64 parameters, moves a checkpoint between them through ``torch.save`` /
``torch.load`` (as a user would), and compares the parameters after further
steps; or checks that a bad checkpoint raises before anything changes.
"""

from __future__ import annotations

import copy
import io
import math

import pytest
import torch

import functopk as ft
from functopk._compat import torch_older_than
from tests.test_from_torch import default_dtype_for

SHAPES = ((3, 2), (2,))


def make_params(n: int = 2) -> list[list[torch.Tensor]]:
    """``n`` copies of the same float64 parameters, each copy its own leaf tensors."""
    g = torch.Generator().manual_seed(0)
    values = [torch.randn(s, generator=g, dtype=torch.float64) for s in SHAPES]
    return [[v.clone().requires_grad_() for v in values] for _ in range(n)]


def run(opt: torch.optim.Optimizer, params: list[torch.Tensor], steps: int) -> None:
    for _ in range(steps):
        for p in params:
            p.grad = torch.sin(3 * p.detach()) + 0.1 * p.detach() ** 3  # a non-linear gradient field
        opt.step()


def through_file(state_dict: dict) -> dict:
    buffer = io.BytesIO()
    torch.save(state_dict, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def assert_same_params(ours: list[torch.Tensor], theirs: list[torch.Tensor]) -> None:
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def snapshot(opt: torch.optim.Optimizer) -> tuple:
    """The groups' hyperparameters and every state entry, by value."""
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    state = {i: {k: v.clone() for k, v in s.items()} for i, s in enumerate(opt.state.values())}
    return groups, state


def assert_unchanged(opt: torch.optim.Optimizer, before: tuple) -> None:
    groups, state = snapshot(opt)
    assert groups == before[0]
    assert state.keys() == before[1].keys()
    for i in state:
        assert state[i].keys() == before[1][i].keys()
        for k in state[i]:
            assert torch.equal(state[i][k], before[1][i][k])


def test_torch_sgd_checkpoint_resumes_with_damped_momentum():
    kwargs = {"lr": 0.1, "momentum": 0.9, "dampening": 0.5}
    theirs_p, ours_p = make_params()
    theirs = torch.optim.SGD(theirs_p, **kwargs)
    run(theirs, theirs_p, 2)
    with torch.no_grad():
        for a, b in zip(ours_p, theirs_p):
            a.copy_(b)
    ours = ft.optimizer_from_torch(torch.optim.SGD, ours_p, **kwargs)
    ours.load_state_dict(through_file(theirs.state_dict()))  # torch's SGD keeps no step count
    run(theirs, theirs_p, 2)
    run(ours, ours_p, 2)
    assert_same_params(ours_p, theirs_p)


@pytest.mark.parametrize(
    "cls, kwargs",
    [
        (torch.optim.Adam, {}),
        (torch.optim.AdamW, {}),
        (torch.optim.Adagrad, {"lr_decay": 0.5}),
        (torch.optim.NAdam, {}),
        (torch.optim.RAdam, {}),
        (torch.optim.Adamax, {}),
        (torch.optim.ASGD, {"lambd": 0.5, "t0": 1.0}),
        (torch.optim.Adafactor, {}),
    ],
)
def test_functopk_checkpoint_loads_into_torch_with_per_parameter_steps(cls, kwargs):
    with default_dtype_for(torch.float64):  # NAdam's and ASGD's scalars in float64 too
        theirs_p, ours_p, loaded_p = make_params(3)
        theirs = cls(theirs_p, lr=0.05, **kwargs)
        ours = ft.optimizer_from_torch(cls, ours_p, lr=0.05, **kwargs)
        run(theirs, theirs_p, 2)
        run(ours, ours_p, 2)
        with torch.no_grad():
            for a, b in zip(loaded_p, ours_p):
                a.copy_(b)
        loaded = cls(loaded_p, lr=0.05, **kwargs)
        loaded.load_state_dict(through_file(ours.state_dict()))
        run(theirs, theirs_p, 2)
        run(loaded, loaded_p, 2)
    assert_same_params(loaded_p, theirs_p)
    # functopk's own resume still steps each group as one tree
    ours.load_state_dict(through_file(ours.state_dict()))
    steps = [ours.state[p]["step"] for p in ours_p]
    assert steps[0] is steps[1]


def test_unknown_state_keys_raise_before_changing_anything():
    (params,) = make_params(1)
    ours = ft.optimizer_from_torch(torch.optim.Adam, params, lr=0.05)
    run(ours, params, 1)
    saved = through_file(ours.state_dict())
    saved["state"][1]["exp_avgg"] = saved["state"][1].pop("exp_avg")
    before = snapshot(ours)
    with pytest.raises(ValueError, match=r"'exp_avgg'.*parameter 1.*'exp_avg', 'exp_avg_sq', 'step'"):
        ours.load_state_dict(saved)
    assert_unchanged(ours, before)


def test_checkpoint_of_another_class_or_shape_raises_before_changing_anything():
    sgd_p, params = make_params()
    sgd = torch.optim.SGD(sgd_p, lr=0.1, momentum=0.9)
    run(sgd, sgd_p, 1)
    ours = ft.optimizer_from_torch(torch.optim.Adam, params, lr=0.05)
    run(ours, params, 1)
    before = snapshot(ours)
    with pytest.raises(ValueError, match=r"param group 0 lacks 'betas'.*another optimizer class"):
        ours.load_state_dict(through_file(sgd.state_dict()))
    assert_unchanged(ours, before)
    wrong = through_file(ours.state_dict())
    wrong["state"][0]["exp_avg"] = torch.zeros(2, 3, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"'exp_avg'.*parameter 0.*shape \(2, 3\).*\(3, 2\)"):
        ours.load_state_dict(wrong)
    assert_unchanged(ours, before)
    run(ours, params, 1)  # and it still steps


@pytest.mark.parametrize("step", [torch.tensor(2.7), 2.7, torch.tensor(-1.0), float("nan"), torch.tensor(math.inf)])
def test_a_step_count_that_is_not_a_whole_number_raises_before_changing_anything(step):
    """torch.optim would carry 2.7 steps on (3.7 after its next step); functopk's counts are integers: no silent 2."""
    (params,) = make_params(1)
    ours = ft.optimizer_from_torch(torch.optim.Adam, params, lr=0.05)
    run(ours, params, 2)
    saved = through_file(ours.state_dict())
    saved["state"][1]["step"] = step
    before = snapshot(ours)
    with pytest.raises(ValueError, match=r"state_dict\['state'\]\[1\]\['step'\] is .*whole number >= 0"):
        ours.load_state_dict(saved)
    assert_unchanged(ours, before)
    saved["state"][1]["step"] = torch.tensor(2.0)  # torch's float step, whole: loads as the count 2
    ours.load_state_dict(saved)
    assert ours.state[params[1]]["step"].dtype == torch.int64 and int(ours.state[params[1]]["step"]) == 2


@pytest.mark.parametrize("older", ["group keys", "number steps"])
def test_older_torch_checkpoints_get_torchs_defaults_and_tensor_steps(older):
    theirs_p, ours_p, old_p = make_params(3)
    theirs = torch.optim.Adam(theirs_p, lr=0.05)
    run(theirs, theirs_p, 2)
    old = through_file(theirs.state_dict())
    if older == "group keys":  # keys that newer torch versions added
        for group in old["param_groups"]:
            for key in ("maximize", "foreach", "capturable", "differentiable", "fused", "decoupled_weight_decay"):
                del group[key]
    else:
        for entry in old["state"].values():
            entry["step"] = int(entry["step"])  # a Python number, as older torch versions saved it
    with torch.no_grad():
        for a, b, c in zip(ours_p, old_p, theirs_p):
            a.copy_(c)
            b.copy_(c)
    ours = ft.optimizer_from_torch(torch.optim.Adam, ours_p, lr=0.05)
    ours.load_state_dict(copy.deepcopy(old))
    old_torch = torch.optim.Adam(old_p, lr=0.05)
    old_torch.load_state_dict(old)
    assert ours.param_groups[0].keys() == old_torch.param_groups[0].keys()
    run(ours, ours_p, 2)
    run(old_torch, old_p, 2)
    assert_same_params(ours_p, old_p)


def test_sgd_without_momentum_keeps_no_per_parameter_entries():
    theirs_p, ours_p = make_params()
    theirs = torch.optim.SGD(theirs_p, lr=0.1)
    ours = ft.optimizer_from_torch(torch.optim.SGD, ours_p, lr=0.1)
    run(theirs, theirs_p, 1)
    run(ours, ours_p, 1)
    assert len(ours.state) == len(theirs.state) == 0
    assert ours.state_dict()["state"] == theirs.state_dict()["state"] == {}


def run_skipping_last(opt: torch.optim.Optimizer, params: list[torch.Tensor]) -> None:
    """One step of :func:`run` in which the last parameter has no gradient (torch skips it: no step counted)."""
    run(opt, params, 1)
    params[-1].grad = None
    run(opt, params[:-1], 1)


def assert_same_steps(ours: torch.optim.Optimizer, theirs: torch.optim.Optimizer) -> None:
    """The same per-parameter keys, and the same step count for each parameter (functopk's is an integer)."""
    for p, q in zip(ours.param_groups[0]["params"], theirs.param_groups[0]["params"]):
        assert set(ours.state[p]) == set(theirs.state[q])
        assert ours.state[p]["step"].item() == theirs.state[q]["step"].item()


@pytest.mark.parametrize("cls", [torch.optim.RMSprop, torch.optim.Adagrad])
def test_without_momentum_or_lr_decay_torchs_step_is_kept_and_loads_both_ways(cls):
    """The maths needs no step count here, but torch.optim keeps one per parameter, and its loading wants it."""
    theirs_p, ours_p, loaded_p, resumed_p = make_params(4)
    theirs = cls(theirs_p, lr=0.05)
    ours = ft.optimizer_from_torch(cls, ours_p, lr=0.05)
    for opt, params in ((theirs, theirs_p), (ours, ours_p)):
        run_skipping_last(opt, params)
    assert_same_steps(ours, theirs)  # steps 2 and 1
    with torch.no_grad():
        for a, b, c in zip(loaded_p, resumed_p, ours_p):
            a.copy_(c)
            b.copy_(c)
    loaded = cls(loaded_p, lr=0.05)  # functopk -> torch.optim
    loaded.load_state_dict(through_file(ours.state_dict()))
    resumed = ft.optimizer_from_torch(cls, resumed_p, lr=0.05)  # torch.optim -> functopk
    resumed.load_state_dict(through_file(theirs.state_dict()))
    for opt, params in ((theirs, theirs_p), (ours, ours_p), (loaded, loaded_p), (resumed, resumed_p)):
        run(opt, params, 2)
    for opt, params in ((ours, ours_p), (loaded, loaded_p), (resumed, resumed_p)):
        assert_same_params(params, theirs_p)
        assert_same_steps(opt, theirs)  # steps 4 and 3
    # functopk's own resume: bit for bit
    again_p = [p.detach().clone().requires_grad_() for p in ours_p]
    again = ft.optimizer_from_torch(cls, again_p, lr=0.05)
    again.load_state_dict(through_file(ours.state_dict()))
    run(ours, ours_p, 2)
    run(again, again_p, 2)
    assert all(torch.equal(a, b) for a, b in zip(again_p, ours_p))
    assert_same_steps(again, ours)


def test_adagrad_state_starts_at_a_parameters_first_step_and_loads_both_ways():
    """A known difference: torch.optim.Adagrad makes every entry (step 0, sum) at construction, functopk at the
    parameter's first step; a parameter without a gradient yet has no entry, and both loads still continue.
    (torch's Adagrad before 2.12 needs every entry at its step: there the first load is checked to fail so.)"""
    theirs_p, ours_p, loaded_p, resumed_p = make_params(4)
    theirs = torch.optim.Adagrad(theirs_p, lr=0.05, initial_accumulator_value=0.1)
    ours = ft.optimizer_from_torch(torch.optim.Adagrad, ours_p, lr=0.05, initial_accumulator_value=0.1)
    assert len(theirs.state) == 2 and len(ours.state) == 0
    for opt, params in ((theirs, theirs_p), (ours, ours_p)):
        params[-1].grad = None
        run(opt, params[:-1], 1)
    assert set(theirs.state[theirs_p[-1]]) == {"step", "sum"} and ours_p[-1] not in ours.state
    loaded = torch.optim.Adagrad(loaded_p, lr=0.05, initial_accumulator_value=0.1)
    loaded.load_state_dict(through_file(ours.state_dict()))
    resumed = ft.optimizer_from_torch(torch.optim.Adagrad, resumed_p, lr=0.05, initial_accumulator_value=0.1)
    resumed.load_state_dict(through_file(theirs.state_dict()))
    with torch.no_grad():
        for a, b, c in zip(loaded_p, resumed_p, ours_p):
            a.copy_(c)
            b.copy_(c)
    runs = [(theirs, theirs_p), (ours, ours_p), (loaded, loaded_p), (resumed, resumed_p)]
    if torch_older_than("2.12"):  # torch's Adagrad made entries only at construction then (docs/interop.md)
        with pytest.raises(KeyError, match="sum"):
            run(loaded, loaded_p, 1)
        runs.remove((loaded, loaded_p))
    for opt, params in runs:
        run(opt, params, 2)
    for opt, params in runs[1:]:
        assert_same_params(params, theirs_p)
        assert_same_steps(opt, theirs)
