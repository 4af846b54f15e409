"""Pickling and deep copies of transformations and of the torch.optim adapters (torch.save(opt), spawn, Ray).

A model and its optimizer are copied together (as ``torch.save((model, opt))``
or a spawned worker would), then both pairs take the same steps: the copy must
step bit for bit as the original, from state it does not share with it.
"""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch

import functopk as ft


def sgd_factory(lr):
    """A module-level factory lr -> transformation: it pickles by name."""
    return ft.chain(ft.error_feedback(ft.topk(3)), ft.sgd(lr, momentum=0.9))


def _torch_save(obj):
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


ROUND_TRIPS = {
    "pickle": lambda obj: pickle.loads(pickle.dumps(obj)),
    "deepcopy": copy.deepcopy,
    "torch.save": _torch_save,
}

OPTIMIZERS = {
    "from_torch": lambda ps: ft.optimizer_from_torch(
        torch.optim.AdamW, ps, sparsify=ft.error_feedback(ft.topk(3)), lr=0.1
    ),
    "from_torch_class": lambda ps: ft.optimizer_class_from_torch(torch.optim.SGD, ft.topk(2))(
        ps, lr=0.1, momentum=0.9
    ),
    "transformation": lambda ps: ft.TorchOptimizer(ps, ft.chain(ft.error_feedback(ft.topk(3)), ft.adam(0.1))),
    "factory": lambda ps: ft.TorchOptimizer(ps, sgd_factory, lr=0.1),
}


def _step(model, opt, seed):
    opt.zero_grad()
    x = torch.randn(2, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    model(x).square().sum().backward()
    opt.step()


def _tensors(opt):
    """Every tensor of the optimizer's state, in a fixed order."""
    if isinstance(opt, ft.ParamGroupOptimizer):
        return [v for g in opt.param_groups for p in g["params"] for _, v in sorted(opt.state[p].items())]
    return [t for t in torch.utils._pytree.tree_leaves(opt.transform_state) if isinstance(t, torch.Tensor)]


@pytest.mark.parametrize("round_trip", ROUND_TRIPS)
@pytest.mark.parametrize("make", OPTIMIZERS)
def test_a_copied_optimizer_steps_as_the_original_bitwise(make, round_trip):
    model = torch.nn.Linear(4, 3).double()
    opt = OPTIMIZERS[make](model.parameters())
    _step(model, opt, 0)
    _step(model, opt, 1)
    model2, opt2 = ROUND_TRIPS[round_trip]((model, opt))
    assert type(opt2).__name__ == type(opt).__name__
    assert all(a is b for a, b in zip(opt2.param_groups[0]["params"], model2.parameters()))  # steps the copied model
    assert len(_tensors(opt2)) == len(_tensors(opt)) > 0
    for a, b in zip(_tensors(opt), _tensors(opt2)):
        assert torch.equal(a, b) and a.data_ptr() != b.data_ptr()  # equal, not shared
    for seed in (2, 3):
        _step(model, opt, seed)
        _step(model2, opt2, seed)
    for p, q in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p, q)
    for a, b in zip(_tensors(opt), _tensors(opt2)):
        assert torch.equal(a, b)


def test_the_generated_classes_are_found_again_in_a_fresh_process(monkeypatch):
    from functopk.adapter import classes

    model = torch.nn.Linear(4, 3).double()
    cls = ft.optimizer_class_from_torch(torch.optim.SGD, ft.topk(2))
    opt = cls(model.parameters(), lr=0.1)
    _step(model, opt, 0)
    assert pickle.loads(pickle.dumps(cls)) is cls  # in this process: the class itself
    data = pickle.dumps((model, opt, cls))
    monkeypatch.setattr(classes, "_CLASSES", {})  # a fresh process: no class made yet
    monkeypatch.setattr(classes, "_BY_TOKEN", {})
    model2, opt2, cls2 = pickle.loads(data)
    assert type(opt2) is cls2 and cls2.__name__ == "SGD" and issubclass(cls2, torch.optim.SGD)
    _step(model, opt, 1)
    _step(model2, opt2, 1)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), model2.parameters()))


def test_transformations_pickle_recursively():
    schedule = ft.warmup_cosine_decay_schedule(0.0, 0.1, warmup_steps=1, decay_steps=10)
    tx = ft.chain(ft.error_feedback(ft.topk(2)), ft.inject_hyperparams(ft.sgd)(learning_rate=schedule, momentum=0.9))
    copied = pickle.loads(pickle.dumps(tx))
    params = {"w": torch.tensor([1.0, 2.0, 3.0])}
    ours, theirs = tx.init(params), copied.init(params)
    for grads in ({"w": torch.tensor([0.5, -4.0, 2.0])}, {"w": torch.tensor([3.0, 1.0, -2.0])}):
        ours_updates, ours = tx.update(grads, ours, params)
        theirs_updates, theirs = copied.update(grads, theirs, params)
        assert torch.equal(ours_updates["w"], theirs_updates["w"])
    assert ours_updates["w"].abs().sum() > 0  # (the schedule's second value is its peak)
    assert torch.equal(ours[0].residual["w"], theirs[0].residual["w"])


def _hand_built():
    def update(updates, state, params=None):
        return updates, state

    return ft.GradientTransformation(lambda params: ft.EmptyState(), update)


def test_what_cannot_be_pickled_is_named():
    with pytest.raises(TypeError, match=r"sgd\(\.\.\.\) made: its argument learning_rate is the lambda"):
        pickle.dumps(ft.chain(ft.topk(1), ft.sgd(lambda count: 0.1)))
    with pytest.raises(TypeError, match="GradientTransformation .*records no recipe"):
        pickle.dumps(ft.chain(ft.topk(1), _hand_built()))
    params = [torch.zeros(2, requires_grad=True)]
    with pytest.raises(TypeError, match="factory.args.0. is the lambda"):
        pickle.dumps(ft.TorchOptimizer(params, lambda lr: ft.sgd(lr), lr=0.1))
    with pytest.raises(TypeError, match="records no recipe"):
        pickle.dumps(ft.optimizer_from_torch(torch.optim.SGD, params, sparsify=_hand_built(), lr=0.1))


def test_deepcopy_makes_a_recorded_transformation_again_and_keeps_any_other():
    tx = ft.chain(ft.topk(1), ft.sgd(0.5, momentum=0.9))
    copied = copy.deepcopy(tx)
    assert copied is not tx and repr(copied) == repr(tx) == "chain(topk(1), sgd(0.5, momentum=0.9))"
    hand_built = _hand_built()
    assert copy.deepcopy(hand_built) is hand_built and copy.copy(hand_built) is hand_built  # functions are atomic



def test_deepcopy_works_where_pickle_cannot():
    """Functions are atomic for deepcopy: lambdas and hand-built transformations are kept, state is copied."""
    p = torch.zeros(2, requires_grad=True)
    opt = ft.TorchOptimizer([p], lambda lr: ft.sgd(lr, momentum=0.9), lr=0.1)
    p.grad = torch.ones(2)
    opt.step()
    p2, opt2 = copy.deepcopy((p, opt))
    p2.grad = torch.ones(2)
    opt.step()
    opt2.step()
    assert torch.equal(p, p2)
    tx = _hand_built()
    assert copy.deepcopy(tx) is tx
