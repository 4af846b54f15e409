"""Schedules against torch.optim.lr_scheduler and hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

import functopk as ft


def torch_lrs(make_scheduler, steps, lr=0.1):
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    sched = make_scheduler(opt)
    lrs = []
    for _ in range(steps):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return lrs


def ours(schedule, steps):
    return [float(schedule(torch.tensor(i))) for i in range(steps)]


@pytest.mark.parametrize(
    "schedule, make_scheduler",
    [
        (ft.cosine_decay_schedule(0.1, 10, alpha=0.1),
         lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, 10, eta_min=0.01)),
        (ft.exponential_decay(0.1, 3, 0.5, staircase=True), lambda o: torch.optim.lr_scheduler.StepLR(o, 3, gamma=0.5)),
        (ft.exponential_decay(0.1, 1, 0.9), lambda o: torch.optim.lr_scheduler.ExponentialLR(o, gamma=0.9)),
        (ft.piecewise_constant_schedule(0.1, {4: 0.1, 7: 0.1}),
         lambda o: torch.optim.lr_scheduler.MultiStepLR(o, [4, 7], 0.1)),
        (ft.linear_schedule(0.05, 0.1, 5), lambda o: torch.optim.lr_scheduler.LinearLR(o, 0.5, 1.0, total_iters=5)),
        (ft.constant_schedule(0.1), lambda o: torch.optim.lr_scheduler.ConstantLR(o, factor=1.0)),
    ],
    ids=["cosine", "step", "exponential", "multistep", "linear", "constant"],
)
def test_matches_torch_lr_scheduler(schedule, make_scheduler):
    steps = 11  # CosineAnnealingLR is periodic after T_max=10; ours stays at its floor
    torch.testing.assert_close(ours(schedule, steps), torch_lrs(make_scheduler, steps), rtol=1e-6, atol=1e-9)


def test_output_is_float32_tensor_on_count_device_and_accepts_ints():
    s = ft.cosine_decay_schedule(1.0, 10)
    out = s(torch.tensor(3, device="meta"))
    assert out.dtype == torch.float32 and out.shape == () and out.device.type == "meta"
    assert float(s(3)) == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.3)))
    with pytest.raises(TypeError, match="step count"):
        s(1.5)


def test_warmup_cosine_and_join_hand_computed():
    s = ft.warmup_cosine_decay_schedule(0.0, 1.0, warmup_steps=4, decay_steps=8, end_value=0.2)
    expected = [0.0, 0.25, 0.5, 0.75, 1.0]
    expected += [0.2 + 0.8 * 0.5 * (1 + math.cos(math.pi * t / 4)) for t in range(1, 5)] + [0.2, 0.2]
    assert ours(s, 11) == pytest.approx(expected, rel=1e-6)
    j = ft.join_schedules([ft.constant_schedule(2.0), ft.exponential_decay(1.0, 1, 0.5)], [2])
    assert ours(j, 5) == [2.0, 2.0, 1.0, 0.5, 0.25]


def test_exponential_end_value_bounds():
    assert ours(ft.exponential_decay(1.0, 1, 0.5, end_value=0.3), 4) == pytest.approx([1.0, 0.5, 0.3, 0.3])
    assert ours(ft.exponential_decay(1.0, 1, 2.0, end_value=3.0), 4) == pytest.approx([1.0, 2.0, 3.0, 3.0])
    assert ours(ft.exponential_decay(1.0, 1, 0.5, transition_begin=2), 4) == pytest.approx([1.0, 1.0, 1.0, 0.5])


@pytest.mark.parametrize(
    "make, exc, match",
    [
        (lambda: ft.linear_schedule(1.0, 0.0, 0), ValueError, "transition_steps must be >= 1"),
        (lambda: ft.linear_schedule("1", 0.0, 3), TypeError, "init_value must be a real number"),
        (lambda: ft.cosine_decay_schedule(1.0, 2.5), TypeError, "decay_steps must be an int"),
        (lambda: ft.exponential_decay(1.0, 1, 0.0), ValueError, "decay_rate must be > 0"),
        (lambda: ft.warmup_cosine_decay_schedule(0.0, 1.0, 5, 5), ValueError, "warmup_steps"),
        (lambda: ft.join_schedules([ft.constant_schedule(1.0)], [3]), ValueError, "one more schedule"),
        (lambda: ft.join_schedules([ft.constant_schedule(1.0)] * 3, [5, 2]), ValueError, "increasing"),
        (lambda: ft.piecewise_constant_schedule(1.0, {-1: 0.5}), ValueError, "boundary must be >= 0"),
        (lambda: ft.constant_schedule(float("nan")), ValueError, "value must not be NaN"),
        (lambda: ft.cosine_decay_schedule(1.0, 4, alpha=True), TypeError, "alpha must be a real number, got bool"),
        (lambda: ft.exponential_decay(1.0, 1, 0.5, staircase=1), TypeError, "staircase must be a bool, got int 1"),
        (lambda: ft.dgc_density_warmup(0.0, 10), ValueError, r"final_density must be in \(0, 1\], got 0.0"),
        (lambda: ft.dgc_density_warmup(0.1, 10, 1.5), TypeError, "warmup_epochs must be an int, got float 1.5"),
        (lambda: ft.join_schedules([1.0, ft.constant_schedule(1.0)], [2]), TypeError, r"schedules\[0\] must be a call"),
        (lambda: ft.constant_schedule(1.0)(1.5), TypeError, "a schedule takes the step count .* got float 1.5"),
    ],
)
def test_bad_arguments(make, exc, match):
    with pytest.raises(exc, match=match):
        make()
