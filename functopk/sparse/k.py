"""What ``k`` is: the one place that turns a ``k`` or a ``density`` into the count a kernel keeps.

The types of what a user gives are checked in :mod:`functopk._checks`
(``check_k``, ``check_density``, ``check_k_or_density``, shared with every
other argument check); everything after that is here, in the order a
selection meets it:

====================  ============================================================  ===============
function              gives                                                         host read
====================  ============================================================  ===============
:func:`k_at_step`     the ``k`` or ``density`` of a schedule at a step, resolved    none
:func:`resolve_k`     the count from exactly one of ``k`` and ``density``           none
:func:`k_from_density` ``round(density * numel)``, at least 1                       none
:func:`k_on_device`   ``k`` as the static kernels take it (an int, or a tensor      none
                      through :func:`clamp_k`)
:func:`clamp_k`       a 0-d tensor ``k`` as int64 in ``[1, n]``, on its device      none
:func:`k_on_host`     ``k`` as a Python int in ``[1, n]`` (the eager exact kernel)  a CPU scalar
====================  ============================================================  ===============

Rules for a 0-d tensor ``k`` (a schedule, :func:`functopk.inject_hyperparams`):
a float is rounded half to even, then clamped to ``[1, n]``; ``inf`` or a value
beyond int64 becomes ``n``, ``-inf`` becomes 1. NaN becomes ``n`` ("keep
everything": nothing is lost) where ``k`` stays on the device, and is a
``ValueError`` where it is read on the host anyway (:func:`k_on_host`).

Names: ``k`` is always this count (``k_tensor`` when it is a tensor); the step
counter of a transformation's state is ``count``, as in optax.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from typing import Any, Union

import torch

from functopk._checks import check_density, check_k

__all__ = ["KLike", "clamp_k", "k_at_step", "k_from_density", "k_on_device", "k_on_host", "resolve_k"]

KLike = Union[int, torch.Tensor]
"""A count: a Python int, or a 0-d tensor (integer, or float rounded to the nearest integer)."""


def clamp_k(k: torch.Tensor, n: int, *, rounded: bool = False) -> torch.Tensor:
    """A 0-d tensor ``k`` as int64 in ``[1, n]``, on its device, without reading it.

    A float ``k`` is rounded half to even (unless ``rounded``: already an
    integer value); ``+inf`` and values beyond int64 become ``n``, ``-inf``
    becomes 1, NaN becomes ``n`` (keep everything: nothing is lost).

    Example:
        >>> import torch
        >>> [int(clamp_k(torch.tensor(v), 10)) for v in (2.5, float("nan"), float("inf"), 1e30, -3.0)]
        [2, 10, 10, 10, 1]
    """
    if k.is_floating_point():
        k = k if rounded else torch.round(k.to(torch.float64))
        # before the int64 cast: NaN and values beyond int64 have no int64 value
        k = torch.nan_to_num(k, nan=float(n), posinf=float(n), neginf=1.0).clamp(1, n)
    return k.to(torch.int64).clamp(1, n)


def k_on_device(k: KLike, n: int) -> KLike:
    """``k`` as the static kernels take it: an int as it is, a tensor through :func:`clamp_k` (no host read).

    Example:
        >>> import torch
        >>> k_on_device(3, 10), k_on_device(torch.tensor(12.0), 10)
        (3, tensor(10))
    """
    return k if isinstance(k, int) else clamp_k(k, n)


def k_on_host(k: KLike, n: int) -> int:
    """``k`` as a Python int in ``[1, n]`` (a tensor is read on the host); a NaN tensor ``k`` is a ``ValueError``.

    Example:
        >>> import torch
        >>> k_on_host(torch.tensor(2.5), 10), k_on_host(7, 10)
        (2, 7)
    """
    if not isinstance(k, torch.Tensor):
        return k
    if k.is_floating_point() and bool(torch.isnan(k)):
        raise ValueError(f"k is NaN; expected a count in [1, {n}] (a 0-d tensor k is rounded and clamped to it)")
    return int(clamp_k(k, n))


def k_from_density(density: float | torch.Tensor, numel: int) -> KLike:
    """The number of coordinates kept at ``density``: ``round(density * numel)``, at least 1.

    A 0-d tensor ``density`` gives a 0-d int64 tensor clamped to ``[1, numel]``
    on device (no host sync): ``inf`` or a product beyond int64 gives
    ``numel``, and so does NaN (keep everything: nothing is lost).

    Example:
        >>> import torch, functopk as ft
        >>> ft.sparse.k_from_density(0.01, 25_557_032)
        255570
        >>> ft.sparse.k_from_density(1e-9, 1000)
        1
        >>> ft.sparse.k_from_density(torch.tensor(float("nan")), 1000)
        tensor(1000)
    """
    density = check_density(density)
    if numel < 1:
        raise ValueError(f"numel must be >= 1, got {numel}")
    if isinstance(density, torch.Tensor):
        return clamp_k(torch.floor(density.to(torch.float64) * numel + 0.5), numel, rounded=True)
    return min(numel, max(1, math.floor(density * numel + 0.5)))


def resolve_k(k: Any, density: Any, numel: int, *, name: str = "updates") -> KLike:
    """The count to keep from exactly one of ``k`` and ``density`` (already type-checked), for a tree of ``numel``.

    An int ``k`` must be at most ``numel``; a 0-d tensor ``k`` is returned as it
    is (the selection rounds and clamps it, see
    :func:`functopk.sparse.k.clamp_k`); a density becomes
    :func:`k_from_density`. A tree with no coordinates (for example all-``None``
    gradients) is a ``ValueError`` that says so.

    Example:
        >>> import functopk as ft
        >>> ft.sparse.resolve_k(None, 0.5, 10), ft.sparse.resolve_k(3, None, 10)
        (5, 3)
    """
    if numel < 1:
        raise ValueError(
            f"{name} has no coordinates: every leaf is empty or None (were all gradients None? "
            "check that the loss depends on the parameters and that they require grad)"
        )
    if k is None:
        return k_from_density(density, numel)
    if not isinstance(k, torch.Tensor) and k > numel:
        raise ValueError(f"k={k} exceeds the number of coordinates in {name} ({numel})")
    return k


def _scheduled(schedule: Callable[..., Any], step: torch.Tensor | None, name: str) -> Any:
    """The value of ``schedule`` at ``step``, checked as a ``k`` or a ``density`` (``name``)."""
    value = schedule(step)
    if not isinstance(value, (torch.Tensor, numbers.Real)) or isinstance(value, bool):
        raise TypeError(f"the {name} schedule must return a number or a 0-d tensor, got {type(value).__name__}")
    return check_k(value) if name == "k" else check_density(value)


def k_at_step(k: Any, density: Any, step: torch.Tensor | None, numel: int, *, name: str = "updates") -> KLike:
    """:func:`resolve_k`, where ``k`` or ``density`` may be a schedule (a callable of the step count).

    A schedule is called with ``step`` (a transformation's state counter) and
    its value checked as :func:`functopk._checks.check_k_or_density` checks a
    constant; constants are used as they are.

    Example:
        >>> import torch
        >>> k_at_step(lambda step: 1 + step, None, torch.tensor(2), 10), k_at_step(None, 0.5, None, 10)
        (tensor(3), 5)
    """
    k = _scheduled(k, step, "k") if callable(k) else k
    density = _scheduled(density, step, "density") if callable(density) else density
    return resolve_k(k, density, numel, name=name)
