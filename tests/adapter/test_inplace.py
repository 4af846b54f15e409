"""The adapter's in-place steps (functopk.inplace's engine): bit for bit the pure transformation, in the old tensors."""

from __future__ import annotations

import copy

import optree
import pytest
import torch

import functopk as ft
from functopk.adapter import registry
from functopk.inplace import check_disjoint, plan_step, split
from functopk.tree import chunked
from tests.helpers import assert_tree_bitwise_equal

SHAPES = [(3, 4), (5,), ()]

CASES = [
    (torch.optim.AdamW, {"lr": 0.01}),
    (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1, "amsgrad": True, "maximize": True}),
    (torch.optim.Adam, {"lr": 0.01, "weight_decay": 0.1}),
    (torch.optim.Adam, {"lr": 0.01, "weight_decay": 0.1, "decoupled_weight_decay": True}),
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 0.1}),
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "dampening": 0.3, "maximize": True}),
    (torch.optim.RMSprop, {"lr": 0.01}),
    (torch.optim.RMSprop, {"lr": 0.01, "momentum": 0.9, "centered": True, "weight_decay": 0.1, "maximize": True}),
    (torch.optim.Adagrad, {"lr": 0.1}),
    (torch.optim.Adagrad, {"lr": 0.1, "lr_decay": 0.1, "weight_decay": 0.1, "initial_accumulator_value": 0.5}),
    (torch.optim.Adamax, {"lr": 0.01}),
    (torch.optim.Adamax, {"lr": 0.01, "weight_decay": 0.1, "maximize": True}),
    (torch.optim.NAdam, {"lr": 0.01}),
    (torch.optim.NAdam, {"lr": 0.01, "weight_decay": 0.1, "momentum_decay": 0.01, "maximize": True}),
    (torch.optim.NAdam, {"lr": 0.01, "weight_decay": 0.1, "decoupled_weight_decay": True}),
    (torch.optim.RAdam, {"lr": 0.01}),  # (rectified from the 6th step: 7 steps run both branches)
    (torch.optim.RAdam, {"lr": 0.01, "weight_decay": 0.1, "maximize": True}),
    (torch.optim.RAdam, {"lr": 0.01, "weight_decay": 0.1, "decoupled_weight_decay": True}),
    (torch.optim.Adadelta, {}),
    (torch.optim.Adadelta, {"lr": 0.5, "rho": 0.8, "eps": 1e-3, "weight_decay": 0.1, "maximize": True}),
    (torch.optim.Rprop, {"lr": 0.01}),
    (torch.optim.Rprop, {"lr": 0.01, "etas": (0.3, 1.5), "step_sizes": (0.005, 0.02), "maximize": True}),
    (torch.optim.ASGD, {"lr": 0.01}),
    (torch.optim.ASGD, {"lr": 0.01, "lambd": 0.01, "alpha": 0.5, "t0": 0, "weight_decay": 0.1, "maximize": True}),
]


def _params(dtype: torch.dtype) -> list[torch.Tensor]:
    torch.manual_seed(0)
    return [torch.randn(s, dtype=dtype, requires_grad=True) for s in SHAPES]


def _set_grads(params: list[torch.Tensor], step: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    grads = [torch.randn(p.shape, dtype=p.dtype, generator=gen) for p in params]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    return grads


def _steps_against_pure(cls, kwargs, params, steps):
    """The adapter's steps on ``params``, each checked bit for bit against the pure transformation's.

    Returns ``(opt, torch_opt, theirs, ptrs)``: the adapter, torch's foreach optimizer (which stepped
    copies of the same parameters with the same gradients), and after each step the data pointers
    of the adapter's parameter-shaped state tensors.
    """
    theirs = [p.detach().clone().requires_grad_() for p in params]
    kwargs = {**kwargs, "foreach": True}  # torch's foreach kernels, which functopk's round like (ASGD: when told)
    opt, torch_opt = ft.optimizer_from_torch(cls, params, **kwargs), cls(theirs, **kwargs)
    tx = ft.from_torch(cls, **kwargs)
    ref = {i: p.detach().clone() for i, p in enumerate(params)}
    state, ptrs = tx.init(ref), []
    for step in range(steps):
        grads = _set_grads(params, step)
        for q, g in zip(theirs, grads):
            q.grad = g.clone()
        opt.step()
        torch_opt.step()
        updates, state = tx.update(dict(enumerate(grads)), state, ref)
        ref = ft.apply_updates(ref, updates)
        assert_tree_bitwise_equal([p.detach() for p in params], list(ref.values()))
        ptrs.append({(i, n): v.data_ptr() for i, p in enumerate(params) if p.dim()
                     for n, v in opt.state[p].items() if v.shape == p.shape})  # fmt: skip
    return opt, torch_opt, theirs, ptrs


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize(("cls", "kwargs"), CASES)
def test_inplace_step_is_the_pure_transformation_bit_for_bit(cls, kwargs, dtype):
    params = _params(dtype)
    opt, torch_opt, theirs, ptrs = _steps_against_pure(cls, kwargs, params, 7 if cls is torch.optim.RAdam else 3)
    assert all(p == ptrs[0] for p in ptrs) and len(ptrs[0]) >= 2  # the in-place step ran: the same state tensors
    rtol = 1e-12 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close([p.detach() for p in params], [q.detach() for q in theirs], rtol=rtol, atol=0.0)
    ours, torchs = opt.state[params[0]], torch_opt.state[theirs[0]]
    for name in ours:
        if name in torchs and name != "step":
            torch.testing.assert_close(ours[name], torchs[name], rtol=rtol, atol=0.0)


@pytest.mark.parametrize("sparsify", [None, ft.topk(4)])
def test_adamw_writes_into_its_state_as_torch_does(sparsify):
    params = _params(torch.float32)
    opt = ft.optimizer_from_torch(torch.optim.AdamW, params, sparsify, lr=0.01)
    torch_opt = torch.optim.AdamW([p.detach().clone().requires_grad_() for p in params], lr=0.01, foreach=True)
    pointers = []
    for step in range(3):
        _set_grads(params, step)
        for q, p in zip(torch_opt.param_groups[0]["params"], params):
            q.grad = p.grad.clone()
        opt.step()
        torch_opt.step()
        pointers.append([opt.state[p][n].data_ptr() for p in params for n in ("exp_avg", "exp_avg_sq")])
        pointers[-1] += [torch_opt.state[q][n].data_ptr() for q in torch_opt.param_groups[0]["params"]
                         for n in ("exp_avg", "exp_avg_sq")]  # fmt: skip
    assert pointers[0] == pointers[1] == pointers[2]


def test_state_dicts_in_and_out_are_copies_a_step_leaves_alone():
    params = _params(torch.float64)
    opt = ft.optimizer_from_torch(torch.optim.AdamW, params, lr=0.01)
    _set_grads(params, 0)
    opt.step()
    saved = opt.state_dict()
    kept = copy.deepcopy(saved)
    opt.step()
    assert_tree_bitwise_equal(saved["state"], kept["state"])
    opt.load_state_dict(saved)
    opt.step()
    assert_tree_bitwise_equal(saved["state"], kept["state"])


def _planned(h, edit=None, dtype=torch.float32):
    """The engine's in-place plans of one Adam step (torch's hyperparameters ``h``) on a state ``edit`` may change."""
    tx = ft.from_torch(torch.optim.Adam, **h)
    params, grads = {0: torch.zeros(3, dtype=dtype)}, {0: torch.ones(3, dtype=dtype)}
    state = tx.init(params)
    state = edit(state) if edit else state
    return split(tx, state, list(grads.values()), list(params.values()), optree.tree_structure(params))[2]


def test_no_inplace_step_for_tensor_betas_or_unfit_state():
    h = {"lr": 0.01, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "amsgrad": False, "maximize": False}
    assert _planned(h)
    assert not _planned({**h, "betas": (torch.tensor(0.9), torch.tensor(0.999))})  # state kernels would take them
    for bad in (lambda s: s._replace(mu={0: torch.zeros(3, dtype=torch.float64)}),
                lambda s: s._replace(nu={0: torch.zeros(3).to_sparse()})):  # fmt: skip
        assert not _planned(h, bad)
    assert not _planned(h, dtype=torch.bfloat16)  # mul_ rounds unlike mul there
    # one tensor twice: written twice by an in-place step; the engine refuses it, the adapter takes the pure path
    tx, params, grads = ft.from_torch(torch.optim.Adam, **h), {0: torch.zeros(3)}, {0: torch.ones(3)}
    state = tx.init(params)
    twice = plan_step(tx, grads, state._replace(nu=state.mu), params)
    assert twice.plans
    with pytest.raises(ValueError, match="share"):
        check_disjoint(twice, [], list(grads.values()), optree.tree_structure(grads))
    p = torch.zeros(3, requires_grad=True)
    opt = ft.optimizer_from_torch(torch.optim.Adam, [p], **h)
    p.grad = torch.ones(3)
    opt.step()
    opt.state[p]["exp_avg_sq"] = shared = opt.state[p]["exp_avg"]
    expected = tx.update({0: torch.ones(3)}, state._replace(count=torch.tensor(1), mu={0: shared}, nu={0: shared}),
                         {0: p.detach().clone()})  # fmt: skip
    before = p.detach().clone()
    opt.step()
    assert_tree_bitwise_equal(p.detach(), before + expected[0][0])
    new = [opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"]]
    assert_tree_bitwise_equal(new, [expected[1].mu[0], expected[1].nu[0]])


def test_a_step_that_fails_in_a_later_group_changes_nothing():
    first, second = _params(torch.float64)[:2], [torch.randn(4, dtype=torch.float64, requires_grad=True)]
    groups = [{"params": first}, {"params": second, "lr": torch.tensor(0.01)}]  # in place, then the pure path
    opt = ft.optimizer_from_torch(torch.optim.AdamW, groups, lr=0.01)
    _set_grads(first + second, 0)
    opt.step()
    opt.state[second[0]]["exp_avg"] = torch.zeros(5, dtype=torch.float64)  # broken by hand: the pure update raises
    before = copy.deepcopy((opt.state_dict()["state"], [p.detach() for p in first + second]))
    with pytest.raises(ValueError):
        opt.step()
    assert_tree_bitwise_equal((opt.state_dict()["state"], [p.detach() for p in first + second]), before)


@pytest.mark.parametrize(
    ("cls", "key", "in_place"),
    [(torch.optim.NAdam, "momentum_decay", True), (torch.optim.RAdam, "lr", True), (torch.optim.Adam, "lr", True),
     (torch.optim.Rprop, "etas", True), (torch.optim.ASGD, "lambd", True), (torch.optim.Adadelta, "rho", False),
     (torch.optim.Adam, "betas", False), (torch.optim.SGD, "momentum", False), (torch.optim.RMSprop, "alpha", False)],
)  # fmt: skip
def test_a_tensor_hyperparameter_is_the_pure_transformation_bit_for_bit(cls, key, in_place):
    """In place where the tensor meets no state kernel (its scalars are computed before), purely where one would
    take it (``mul_`` with a tensor rounds unlike ``mul``)."""
    h = registry.torch_hyperparams(cls, {"lr": 0.01, "momentum": 0.9} if cls is torch.optim.SGD else {})
    h = {k: v for k, v in h.items() if k not in ("foreach", "fused", "differentiable", "capturable")}
    value = h[key]
    h[key] = tuple(torch.tensor(v) for v in value) if isinstance(value, tuple) else torch.tensor(value)
    params = _params(torch.float64)
    ptrs = _steps_bit_for_bit(ft.optimizer_from_torch(cls, params, **h), ft.from_torch(cls, **h), params)
    assert ptrs[0] and (ptrs[1] == ptrs[2]) == in_place


def _steps_bit_for_bit(opt, tx, params):
    """Three steps of ``opt``, each checked bit for bit against ``tx``'s; the data pointers of ``params[0]``'s
    parameter-shaped state tensors after each."""
    ref = [p.detach().clone() for p in params]
    state, ptrs = tx.init(ref), []
    for step in range(3):
        grads = _set_grads(params, step)
        opt.step()
        updates, state = tx.update(grads, state, ref)
        ref = ft.apply_updates(ref, updates)
        assert_tree_bitwise_equal([p.detach() for p in params], ref)
        ptrs.append([v.data_ptr() for v in opt.state[params[0]].values() if v.shape == params[0].shape])
    return ptrs


def _option_combinations():
    """Every option torch.optim has for the three classes whose CPU step runs slice by slice."""
    flags = (False, True)
    sgd = [{"lr": 0.1, "momentum": 0.9, "nesterov": n, "dampening": d, "weight_decay": w, "maximize": m}
           for n in flags for d in (0.0, 0.3) if not (n and d) for w in (0.0, 0.1) for m in flags]  # fmt: skip
    rms = [{"lr": 0.01, "momentum": mo, "centered": c, "weight_decay": w, "maximize": m}
           for mo in (0.0, 0.9) for c in flags for w in (0.0, 0.1) for m in flags]  # fmt: skip
    adamax = [{"lr": 0.01, "weight_decay": w, "maximize": m} for w in (0.0, 0.1) for m in flags]
    return ([(torch.optim.SGD, k) for k in sgd] + [(torch.optim.RMSprop, k) for k in rms]
            + [(torch.optim.Adamax, k) for k in adamax])  # fmt: skip


def _sliced_params() -> list[torch.Tensor]:
    """Leaves cut into several slices at ``CHUNK = 7``, one not contiguous, one float64 among float32 ones."""
    gen = torch.Generator().manual_seed(1)
    shapes = [(4, 5), (16,), (3,), ()]
    params = [torch.randn(s, generator=gen) for s in shapes]
    params += [torch.randn(5, 4, generator=gen).t(), torch.randn(9, generator=gen, dtype=torch.float64)]
    return [p.requires_grad_() for p in params]


@pytest.mark.parametrize(("cls", "kwargs"), _option_combinations())
def test_sliced_step_is_the_pure_transformation_bit_for_bit(cls, kwargs, monkeypatch):
    monkeypatch.setattr(chunked, "CHUNK", 7)
    params = _sliced_params()
    _, _, theirs, ptrs = _steps_against_pure(cls, kwargs, params, 3)
    assert all(p == ptrs[0] for p in ptrs) and len(ptrs[0]) >= len(params) - 1  # the same state tensors
    for p, q in zip(params, theirs):  # torch's fused kernels round once where update-then-add rounds twice
        rtol = 1e-12 if p.dtype == torch.float64 else 1e-5
        torch.testing.assert_close(p.detach(), q.detach(), rtol=rtol, atol=1e-7)


@pytest.mark.parametrize(
    ("cls", "kwargs"),
    [(torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 0.1}),
     (torch.optim.RMSprop, {"lr": 0.01, "momentum": 0.9, "centered": True}),
     (torch.optim.Adamax, {"lr": 0.01, "maximize": True})],
)  # fmt: skip
def test_sliced_step_allocates_no_parameter_sized_tree_and_resumes(cls, kwargs, monkeypatch):
    monkeypatch.setattr(chunked, "CHUNK", 256)
    params = [torch.randn(64, 64, requires_grad=True), torch.randn(64, requires_grad=True)]
    opt = ft.optimizer_from_torch(cls, params, **kwargs)
    _set_grads(params, 0)
    opt.step()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        opt.step()
    largest = max(e.cpu_memory_usage for e in prof.events())
    assert 0 < largest <= 2 * 256 * 4 < params[0].numel() * 4  # the two scratch rows, not a 64 x 64 tree
    again = [p.detach().clone().requires_grad_() for p in params]
    resumed = ft.optimizer_from_torch(cls, again, **kwargs)
    resumed.load_state_dict(opt.state_dict())
    for o, ps in ((opt, params), (resumed, again)):
        _set_grads(ps, 1)
        o.step()
    assert_tree_bitwise_equal([p.detach() for p in params], [q.detach() for q in again])
    assert_tree_bitwise_equal(opt.state_dict()["state"], resumed.state_dict()["state"])


@pytest.mark.parametrize(("cls", "kwargs"), _option_combinations())
def test_whole_tensor_step_of_the_sliced_classes_is_the_pure_transformation_bit_for_bit(cls, kwargs):
    """The form an accelerator runs, reached on the CPU through ``sparsify_on="update"`` (which needs the updates):
    a top-k of every coordinate keeps them all, so the step is the optimizer's own."""
    params = _params(torch.float64)
    n = sum(p.numel() for p in params)
    opt = ft.optimizer_from_torch(cls, params, sparsify=ft.topk(n), sparsify_on="update", **kwargs)
    _steps_bit_for_bit(opt, ft.from_torch(cls, **kwargs), params)
