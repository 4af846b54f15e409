"""The one dispatch point of the top-k engine: which kernel runs, and what ``k`` it gets.

:func:`select` is the only place that decides between the exact CPU kernel
(which reads sizes and thresholds on the host), its custom-operator form for
compiled graphs, and the static kernels, and the only place that turns a tensor
``k`` into what a kernel takes. The route (:func:`route`) depends on where the
leaves are and how the code runs (kernels in :mod:`~functopk.sparse.kernels`,
result types in :mod:`~functopk.sparse.selection` and :mod:`~functopk.sparse.ops`):

===============  ==============================  ===============================  ============================
``method``       ``"eager"`` (eager, CPU)        ``"op"`` (compiling, CPU)        ``"static"`` (other devices,
                                                                                  or a leaf requires grad)
===============  ==============================  ===============================  ============================
``"exact"``      ``select_exact`` ->             the same kernel as a custom      ``mask_static`` -> ``Mask``
                 ``Indices``                     operator -> ``ExactOp``
``"torch"``      ``mask_static`` -> ``Mask``     the same                         the same
``"approx"``     ``sample_threshold`` ->         ``Threshold``                    ``Threshold``
                 ``HostThreshold``
``"gaussian"``   ``gaussian_threshold_flat``,    ``Threshold``                    ``Threshold``
                 as ``"approx"``
===============  ==============================  ===============================  ============================

So ``"exact"`` selects the same coordinates on every route, and eager and
compiled CPU code run the very same kernel (bit-identical outputs).

A tensor ``k`` (rounded if it is a float) is clamped to ``[1, n]`` by
:func:`tensor_count`: ``inf`` or a value beyond int64 becomes ``n``, ``-inf``
becomes 1. The exact CPU kernel reads ``k`` on the host anyway (eager, or
inside the operator: a CPU scalar, no device synchronisation), and there a NaN
``k`` is a ``ValueError``; the static kernels never read it, and there NaN
becomes ``n`` ("keep everything": nothing is lost).
"""

from __future__ import annotations

import warnings
from typing import Any, Union

import torch

from functopk._checks import check_choice
from functopk.sparse.config import DEFAULT_CONFIG, KernelConfig
from functopk.sparse.kernels.approx import gaussian_threshold_flat, sample_threshold
from functopk.sparse.kernels.base import common_dtype, flat_magnitudes
from functopk.sparse.kernels.exact import select_exact
from functopk.sparse.kernels.static import mask_static
from functopk.sparse.ops import ExactOp, host_count
from functopk.sparse.selection import HostThreshold, Indices, Mask, Selection, Threshold

__all__ = [
    "KLike",
    "METHODS",
    "SLOW_STATIC_NUMEL",
    "SlowPathWarning",
    "check_method",
    "device_count",
    "route",
    "select",
    "tensor_count",
]

METHODS = ("exact", "torch", "approx", "gaussian")

KLike = Union[int, torch.Tensor]
"""A count: a Python int, or a 0-d tensor (integer, or float rounded to the nearest integer)."""


def check_method(method: Any) -> str:
    """``method`` if it is one of :data:`METHODS`, else ``TypeError`` (not a str) or ``ValueError``."""
    return check_choice(method, "method", METHODS)


def route(leaves: list[torch.Tensor]) -> str:
    """Which exact kernel serves ``leaves`` here: ``"eager"``, ``"op"`` or ``"static"`` (see the module table).

    Example:
        >>> import torch
        >>> route([torch.ones(3)]), route([torch.ones(3, requires_grad=True)]), route([torch.ones(3, device="meta")])
        ('eager', 'static', 'static')
    """
    if leaves[0].device.type != "cpu" or (torch.is_grad_enabled() and any(x.requires_grad for x in leaves)):
        return "static"
    return "op" if torch.compiler.is_compiling() else "eager"


def tensor_count(k: torch.Tensor, n: int, *, rounded: bool = False) -> torch.Tensor:
    """A 0-d count tensor as int64 in ``[1, n]``, on device, without reading it.

    A float ``k`` is rounded half to even (unless ``rounded``: already an
    integer value); ``+inf`` and values beyond int64 become ``n``, ``-inf``
    becomes 1, NaN becomes ``n`` (keep everything: nothing is lost).

    Example:
        >>> import torch
        >>> [int(tensor_count(torch.tensor(v), 10)) for v in (2.5, float("nan"), float("inf"), 1e30, -3.0)]
        [2, 10, 10, 10, 1]
    """
    if k.is_floating_point():
        k = k if rounded else torch.round(k.to(torch.float64))
        k = torch.nan_to_num(k, nan=float(n), posinf=float(n), neginf=1.0).clamp(1, n)
    return k.to(torch.int64).clamp(1, n)


def device_count(k: KLike, n: int) -> KLike:
    """``k`` as the static kernels take it: an int as it is, a tensor through :func:`tensor_count` (no host read)."""
    return k if isinstance(k, int) else tensor_count(k, n)


SLOW_STATIC_NUMEL = 1 << 20
"""Trees this large get :class:`SlowPathWarning` when ``"exact"`` falls back to the static kernel on the CPU."""


class SlowPathWarning(UserWarning):
    """``method="exact"`` ran the static kernel on a large CPU tree (leaves require grad): about 10x slower.

    Example:
        >>> import warnings, functopk as ft
        >>> warnings.simplefilter("ignore", ft.sparse.SlowPathWarning)   # when the fallback is intended
    """


def _warn_static_on_cpu(n: int) -> None:
    """Warn (eager mode; a warning would break a compiled graph) that the exact CPU kernel could not run."""
    if not torch.compiler.is_compiling():
        warnings.warn(
            f"top-k of {n} coordinates on the CPU runs the static kernel (torch.topk over a concatenated copy, "
            "about 10x slower than functopk's exact kernel) because a leaf requires grad; select from detached "
            "gradients (x.detach(), or torch.no_grad()) unless you differentiate through the selection",
            SlowPathWarning,
            stacklevel=4,
        )


def select(
    leaves: list[torch.Tensor], k: KLike, method: str, config: KernelConfig | None = None
) -> Selection | ExactOp:
    """Run the kernel that ``method`` and the context call for on ``leaves`` (see the module table).

    Args:
        leaves: The checked leaves (supported floats, one device, at least one coordinate).
        k: An int in ``[1, n]`` (checked), or a 0-d tensor (clamped by :func:`tensor_count`).
        method: One of :data:`METHODS` (checked).
        config: The kernels' tuning constants (default: :data:`~.config.DEFAULT_CONFIG`).

    Example:
        >>> import torch
        >>> select([torch.tensor([1.0, -3.0, 2.0])], 2, "exact")
        Indices(indices=tensor([1, 2]), values=tensor([-3.,  2.]))
        >>> select([torch.tensor([1.0, -3.0, 2.0])], torch.tensor(2), "torch")
        Mask(mask=tensor([False,  True,  True]), k=tensor(2))
    """
    config = DEFAULT_CONFIG if config is None else config
    if not isinstance(config, KernelConfig):
        raise TypeError(f"config must be a functopk.sparse.KernelConfig or None, got {type(config).__name__}")
    where = route(leaves)
    if method == "exact" and where == "op":  # the operator does the rest, on the real tensors
        return ExactOp(k, None, config) if isinstance(k, int) else ExactOp(0, k, config)
    dtype = common_dtype(leaves)
    n = sum(x.numel() for x in leaves)
    flats = [x.detach().reshape(-1) for x in leaves]
    if method == "exact" and where == "eager":
        return Indices(*select_exact(flats, host_count(k, n), dtype, config))
    count = device_count(k, n)
    if method == "exact" and leaves[0].device.type == "cpu" and n >= SLOW_STATIC_NUMEL:
        _warn_static_on_cpu(n)
    if method in ("exact", "torch"):
        return Mask(mask_static(flat_magnitudes(flats, dtype), count), count)
    if method == "approx":
        t = sample_threshold(flats, count, dtype)
    else:
        t = gaussian_threshold_flat(flats, count / n, dtype)
    if where == "eager":
        return HostThreshold(t, count / n if isinstance(count, int) else 0.01, config)
    return Threshold(t)
