"""TorchOptimizer's learning rates: group lrs as factors, the factory form's injected lr, schedulers, float64."""

from __future__ import annotations

import copy

import pytest
import torch

import functopk as ft
from tests.helpers import assert_tree_bitwise_equal, small_cnn
from tests.test_torch_optimizer import K, imperative_step


def test_group_lrs_are_factors_on_the_global_updates():
    model = small_cnn()
    head = list(model[7].parameters())
    body = [p for p in model.parameters() if all(p is not h for h in head)]
    tx = ft.chain(ft.topk(K), ft.sgd(0.1, momentum=0.9))
    opt = ft.TorchOptimizer([{"params": body}, {"params": head, "lr": 0.5}], tx)
    state = tx.init(body + head)
    for i in range(4):
        before = [p.detach().clone() for p in body + head]
        imperative_step(model, opt, i)
        updates, state = tx.update([p.grad for p in body + head], state, before)
        for j, (p, b, u) in enumerate(zip(body + head, before, updates)):
            expected = b + (0.5 * u if j >= len(body) else u)  # 0.5 * u is exact
            assert torch.equal(p.detach(), expected)
    assert_tree_bitwise_equal(opt.transform_state, state)


def test_group_lrs_match_torch_optim_sgd():
    model = small_cnn()
    ref_model = copy.deepcopy(model)

    def groups(m):
        return [{"params": list(m[:7].parameters())}, {"params": list(m[7].parameters()), "lr": 0.3}]

    opt = ft.TorchOptimizer(groups(model), ft.sgd(0.1, momentum=0.9))
    ref = torch.optim.SGD([{**g, "lr": 0.1 * g.get("lr", 1.0)} for g in groups(ref_model)], lr=0.1, momentum=0.9)
    for i in range(5):
        imperative_step(model, opt, i)
        imperative_step(ref_model, ref, i)
    for p, q in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_lr_scheduler_sets_the_learning_rate_the_transform_sees():
    model = small_cnn()
    ref_model = copy.deepcopy(model)
    opt = ft.TorchOptimizer(model.parameters(), lambda lr: ft.chain(ft.topk(K), ft.sgd(lr)), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    ref = torch.optim.SGD(ref_model.parameters(), lr=0.1)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref, step_size=2, gamma=0.5)
    seen = []
    for i in range(6):
        lr = opt.param_groups[0]["lr"]
        before = [p.detach().clone() for p in model.parameters()]
        imperative_step(model, opt, i)
        seen.append(opt.transform_state.hyperparams["learning_rate"])
        assert seen[-1].dtype == torch.float32 and seen[-1].item() == torch.tensor(lr, dtype=torch.float32).item()
        # the step taken is -lr * (top-k of the gradient)
        sparse = ft.topk_sparsify([p.grad for p in model.parameters()], K)
        for p, b, g in zip(model.parameters(), before, sparse):
            torch.testing.assert_close(p.detach(), b - lr * g, rtol=0, atol=1e-7)
        sched.step()
        # torch.optim.SGD sees the same schedule; with k = all coordinates it would match exactly
        imperative_step(ref_model, ref, i)
        ref_sched.step()
    assert [round(s.item(), 6) for s in seen] == [0.1, 0.1, 0.05, 0.05, 0.025, 0.025]
    assert opt.param_groups[0]["lr"] == ref.param_groups[0]["lr"]


def test_lr_scheduler_with_a_plain_transformation_scales_its_updates():
    model = small_cnn()
    ref_model = copy.deepcopy(model)
    opt = ft.TorchOptimizer(model.parameters(), ft.sgd(0.1, momentum=0.9))
    ref = torch.optim.SGD(ref_model.parameters(), lr=0.1, momentum=0.9)
    scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5) for o in (opt, ref)]
    assert opt.param_groups[0]["lr"] == 1.0
    for i in range(5):
        imperative_step(model, opt, i)
        imperative_step(ref_model, ref, i)
        for s in scheds:
            s.step()
    assert opt.param_groups[0]["lr"] == 0.5**5
    # torch.optim.SGD applies lr to the momentum buffer when stepping, as a factor on the update does
    for p, q in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_factory_needs_one_lr_for_all_groups_and_fails_cleanly():
    model = small_cnn()
    opt = ft.TorchOptimizer(
        [{"params": model[:7].parameters()}, {"params": model[7].parameters(), "lr": 0.01}],
        lambda lr: ft.sgd(lr, momentum=0.9),
        lr=0.1,
    )
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=r"same lr; got \[0.1, 0.01\]"):
        imperative_step(model, opt, 0)
    assert opt.transform_state is None
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))


def test_factory_form_steps_float64_models_with_a_float64_learning_rate():
    """The injected lr is float64 when a parameter is (it was float32: 1.3e-7 off torch.optim after 30 steps)."""
    torch.manual_seed(0)
    m1 = torch.nn.Linear(5, 3).double()
    m2 = torch.nn.Linear(5, 3).double()
    m2.load_state_dict(m1.state_dict())
    x = torch.randn(8, 5, dtype=torch.float64)
    o1 = torch.optim.SGD(m1.parameters(), lr=0.1, momentum=0.9)
    o2 = ft.TorchOptimizer(m2.parameters(), lambda lr: ft.sgd(lr, momentum=0.9), lr=0.1)
    sched = [torch.optim.lr_scheduler.ExponentialLR(o, 0.9) for o in (o1, o2)]
    for _ in range(30):
        for m, o, s in zip((m1, m2), (o1, o2), sched):
            o.zero_grad()
            m(x).sin().sum().backward()
            o.step()
            s.step()
    assert o2.transform_state.hyperparams["learning_rate"].dtype == torch.float64
    for a, b in zip(m1.parameters(), m2.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-13, atol=1e-15)
