"""Schedules: functions of the step count, for learning rates and other hyperparameters.

A schedule maps the step count (a 0-d integer tensor, as kept in optimizer
states; a Python int works too) to a 0-d float32 tensor on the count's device.
The maths is done with tensor ops in float64 and cast at the end: no value is
read back to the host, so a compiled step that evaluates a schedule never
recompiles as the count grows.

Steps are counted from 0: ``schedule(0)`` is the value used for the first update.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from functopk._checks import check_bool, check_callable, check_density, check_int, check_number, describe
from functopk.base import Schedule, recorded

__all__ = [
    "constant_schedule",
    "cosine_decay_schedule",
    "dgc_density_warmup",
    "exponential_decay",
    "join_schedules",
    "linear_schedule",
    "piecewise_constant_schedule",
    "warmup_cosine_decay_schedule",
]


def _count(step: Any) -> torch.Tensor:
    """The step as a float64 tensor (on its own device when it is a tensor)."""
    if isinstance(step, torch.Tensor):
        return step.to(torch.float64)
    try:
        return torch.tensor(float(check_int(step, "step")), dtype=torch.float64)
    except TypeError:
        raise TypeError(f"a schedule takes the step count (an int or a 0-d tensor), got {describe(step)}") from None


def _out(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float32)


@recorded
def constant_schedule(value: float) -> Schedule:
    """Always ``value``.

    Example:
        >>> import functopk as ft
        >>> ft.constant_schedule(0.1)(7)
        tensor(0.1000)
    """
    value = check_number(value, "value")

    def schedule(step: Any) -> torch.Tensor:
        count = _count(step)
        return _out(torch.full_like(count, value))

    return schedule


@recorded
def linear_schedule(init_value: float, end_value: float, transition_steps: int, transition_begin: int = 0) -> Schedule:
    """Linear interpolation from ``init_value`` to ``end_value`` over ``transition_steps`` steps.

    Constant at ``init_value`` before ``transition_begin`` and at ``end_value``
    after ``transition_begin + transition_steps``.

    Example:
        >>> import functopk as ft
        >>> s = ft.linear_schedule(1.0, 0.0, transition_steps=4)
        >>> [round(float(s(i)), 2) for i in range(6)]
        [1.0, 0.75, 0.5, 0.25, 0.0, 0.0]
    """
    init_value, end_value = check_number(init_value, "init_value"), check_number(end_value, "end_value")
    transition_steps = check_int(transition_steps, "transition_steps", minimum=1)
    transition_begin = check_int(transition_begin, "transition_begin", minimum=0)

    def schedule(step: Any) -> torch.Tensor:
        frac = ((_count(step) - transition_begin) / transition_steps).clamp(0.0, 1.0)
        return _out(init_value + (end_value - init_value) * frac)

    return schedule


@recorded
def cosine_decay_schedule(init_value: float, decay_steps: int, alpha: float = 0.0) -> Schedule:
    """Cosine decay from ``init_value`` to ``alpha * init_value`` over ``decay_steps`` steps.

    ``value(t) = init_value * ((1 - alpha) * (1 + cos(pi * min(t, T) / T)) / 2 + alpha)``,
    which equals ``torch.optim.lr_scheduler.CosineAnnealingLR(T_max=T, eta_min=alpha * init_value)``
    for ``t <= T``.

    Example:
        >>> import functopk as ft
        >>> s = ft.cosine_decay_schedule(1.0, decay_steps=4)
        >>> [round(float(s(i)), 4) for i in (0, 2, 4, 9)]
        [1.0, 0.5, 0.0, 0.0]
    """
    init_value = check_number(init_value, "init_value")
    decay_steps = check_int(decay_steps, "decay_steps", minimum=1)
    alpha = check_number(alpha, "alpha")

    def schedule(step: Any) -> torch.Tensor:
        t = _count(step).clamp(0.0, decay_steps)
        cosine = 0.5 * (1.0 + torch.cos(math.pi * t / decay_steps))
        return _out(init_value * ((1.0 - alpha) * cosine + alpha))

    return schedule


@recorded
def warmup_cosine_decay_schedule(
    init_value: float, peak_value: float, warmup_steps: int, decay_steps: int, end_value: float = 0.0
) -> Schedule:
    """Linear warm-up from ``init_value`` to ``peak_value``, then cosine decay to ``end_value``.

    ``decay_steps`` counts the whole schedule, warm-up included (as in optax): the
    value reaches ``end_value`` at step ``decay_steps`` and stays there.

    Example:
        >>> import functopk as ft
        >>> s = ft.warmup_cosine_decay_schedule(0.0, 1.0, warmup_steps=2, decay_steps=6)
        >>> [round(float(s(i)), 3) for i in range(8)]
        [0.0, 0.5, 1.0, 0.854, 0.5, 0.146, 0.0, 0.0]
    """
    init_value, peak_value = check_number(init_value, "init_value"), check_number(peak_value, "peak_value")
    end_value = check_number(end_value, "end_value")
    warmup_steps = check_int(warmup_steps, "warmup_steps", minimum=0)
    decay_steps = check_int(decay_steps, "decay_steps", minimum=1)
    if warmup_steps >= decay_steps:
        raise ValueError(f"warmup_steps ({warmup_steps}) must be < decay_steps ({decay_steps})")
    cosine_steps = decay_steps - warmup_steps
    alpha = end_value / peak_value if peak_value != 0 else 0.0
    parts = [
        linear_schedule(init_value, peak_value, warmup_steps) if warmup_steps else constant_schedule(peak_value),
        cosine_decay_schedule(peak_value, cosine_steps, alpha=alpha) if peak_value != 0 else constant_schedule(0.0),
    ]
    return join_schedules(parts, [warmup_steps])


@recorded
def exponential_decay(
    init_value: float,
    transition_steps: int,
    decay_rate: float,
    transition_begin: int = 0,
    staircase: bool = False,
    end_value: float | None = None,
) -> Schedule:
    """``init_value * decay_rate ** ((t - transition_begin) / transition_steps)``.

    Constant before ``transition_begin``; with ``staircase`` the exponent is
    floored (``torch.optim.lr_scheduler.StepLR``); ``end_value`` bounds the value
    (a floor when decaying, a ceiling when growing).

    Example:
        >>> import functopk as ft
        >>> s = ft.exponential_decay(1.0, transition_steps=2, decay_rate=0.5, staircase=True)
        >>> [float(s(i)) for i in range(5)]
        [1.0, 1.0, 0.5, 0.5, 0.25]
    """
    init_value = check_number(init_value, "init_value")
    transition_steps = check_int(transition_steps, "transition_steps", minimum=1)
    decay_rate = check_number(decay_rate, "decay_rate")
    if decay_rate <= 0:
        raise ValueError(f"decay_rate must be > 0, got {decay_rate}")
    transition_begin = check_int(transition_begin, "transition_begin", minimum=0)
    check_bool(staircase, "staircase")
    end = None if end_value is None else check_number(end_value, "end_value")

    def schedule(step: Any) -> torch.Tensor:
        exponent = (_count(step) - transition_begin).clamp_min(0.0) / transition_steps
        if staircase:
            exponent = torch.floor(exponent)
        value = init_value * torch.pow(torch.full_like(exponent, decay_rate), exponent)
        if end is not None:
            value = value.clamp_min(end) if decay_rate < 1 else value.clamp_max(end)
        return _out(value)

    return schedule


@recorded
def piecewise_constant_schedule(
    init_value: float, boundaries_and_scales: Mapping[int, float] | None = None
) -> Schedule:
    """Start at ``init_value``; at each boundary step ``b``, multiply by its scale.

    ``torch.optim.lr_scheduler.MultiStepLR(milestones, gamma)`` is
    ``piecewise_constant_schedule(lr, {m: gamma for m in milestones})``.

    Example:
        >>> import functopk as ft
        >>> s = ft.piecewise_constant_schedule(1.0, {2: 0.1, 4: 0.5})
        >>> [round(float(s(i)), 3) for i in range(6)]
        [1.0, 1.0, 0.1, 0.1, 0.05, 0.05]
    """
    init_value = check_number(init_value, "init_value")
    items = sorted((boundaries_and_scales or {}).items())
    for b, s in items:
        check_int(b, "boundary", minimum=0)
        check_number(s, f"scale at boundary {b}")

    def schedule(step: Any) -> torch.Tensor:
        count = _count(step)
        value = torch.full_like(count, init_value)
        for boundary, scale in items:
            value = torch.where(count >= boundary, value * scale, value)
        return _out(value)

    return schedule


@recorded
def join_schedules(schedules: Sequence[Schedule], boundaries: Sequence[int]) -> Schedule:
    """Run ``schedules[i]`` between ``boundaries[i-1]`` and ``boundaries[i]``.

    Each schedule after the first sees the step counted from its own boundary.

    Example:
        >>> import functopk as ft
        >>> s = ft.join_schedules([ft.constant_schedule(1.0), ft.linear_schedule(1.0, 0.0, 2)], [3])
        >>> [float(s(i)) for i in range(6)]
        [1.0, 1.0, 1.0, 1.0, 0.5, 0.0]
    """
    schedules, boundaries = list(schedules), list(boundaries)
    if len(schedules) != len(boundaries) + 1:
        raise ValueError(
            f"join_schedules needs one more schedule than boundaries, got {len(schedules)} and {len(boundaries)}"
        )
    for i, s in enumerate(schedules):
        check_callable(s, f"schedules[{i}]")
    for b in boundaries:
        check_int(b, "boundary", minimum=0)
    if boundaries != sorted(boundaries):
        raise ValueError(f"boundaries must be increasing, got {boundaries}")

    def schedule(step: Any) -> torch.Tensor:
        count = step if isinstance(step, torch.Tensor) else torch.tensor(check_int(step, "step", minimum=0))
        value = torch.as_tensor(schedules[0](count), dtype=torch.float32, device=count.device)
        for boundary, s in zip(boundaries, schedules[1:]):
            later = torch.as_tensor(s(count - boundary), dtype=torch.float32, device=count.device)
            value = torch.where(count >= boundary, later, value)
        return value

    return schedule


@recorded
def dgc_density_warmup(final_density: float, steps_per_epoch: int, warmup_epochs: int = 4) -> Schedule:
    """Deep Gradient Compression's exponential density warm-up (Lin et al. 2018).

    During epoch ``e < warmup_epochs`` (epoch ``e`` is steps
    ``[e * steps_per_epoch, (e + 1) * steps_per_epoch)``) the density is
    ``final_density ** ((e + 1) / (warmup_epochs + 1))``; from epoch
    ``warmup_epochs`` on it is ``final_density``. The density thus falls by the
    same factor ``final_density ** (1 / (warmup_epochs + 1))`` every epoch, as in
    the reference implementation's ``warmup_coeff``. For ``final_density=0.001``
    and 4 warm-up epochs: 25.1%, 6.31%, 1.58%, 0.398%, then 0.1% (the paper
    quotes these as 25%, 6.25%, 1.5625%, 0.4%, 0.1%). ``warmup_epochs=0`` gives
    the constant ``final_density``.

    Use it as the ``density`` of ``ft.topk`` / ``ft.dgc`` (where ``topk`` takes a
    schedule), together with a learning-rate warm-up.

    Args:
        final_density: The density after warm-up, in ``(0, 1]``.
        steps_per_epoch: Optimizer steps per epoch, ``>= 1``.
        warmup_epochs: Number of warm-up epochs, ``>= 0``.

    Example:
        >>> import functopk as ft
        >>> s = ft.dgc_density_warmup(0.001, steps_per_epoch=10, warmup_epochs=4)
        >>> [round(float(s(i)), 6) for i in (0, 9, 10, 20, 30, 40, 1000)]
        [0.251189, 0.251189, 0.063096, 0.015849, 0.003981, 0.001, 0.001]
    """
    final = float(check_density(final_density, "final_density", allow_tensor=False))
    steps_per_epoch = check_int(steps_per_epoch, "steps_per_epoch", minimum=1)
    warmup_epochs = check_int(warmup_epochs, "warmup_epochs", minimum=0)

    def schedule(step: Any) -> torch.Tensor:
        epoch = torch.floor(_count(step).clamp_min(0.0) / steps_per_epoch)
        exponent = ((epoch + 1.0) / (warmup_epochs + 1)).clamp_max(1.0)
        return _out(torch.pow(torch.full_like(exponent, final), exponent))

    return schedule
