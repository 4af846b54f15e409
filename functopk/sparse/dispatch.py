"""The one dispatch point of the top-k engine: which kernel runs, and what ``k`` it gets.

:func:`select` is the only place that decides between the exact CPU kernel
(which reads sizes and thresholds on the host), its custom-operator form for
compiled graphs, and the static kernels, and the only place that turns a tensor
``k`` into what a kernel takes. The route (:func:`route`) depends on where the
leaves are and how the code runs (kernels in :mod:`~functopk.sparse.kernels`,
result types in :mod:`~functopk.sparse.selection` and :mod:`~functopk.sparse.ops`, all
of them a :class:`~functopk.sparse.selection.Selection`):

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

Before the table: where :attr:`~.config.KernelConfig.backend` says so
(``"auto"``: CUDA leaves where Triton imports; ``"triton"``: always),
``"exact"`` runs the Triton kernel instead, eager or compiled
(:class:`~functopk.sparse.ops.TritonTopK`), unless a leaf requires grad
(the static kernel is the differentiable one). Same coordinates again.

What ``k`` becomes is decided in :mod:`functopk.sparse.k`: the exact CPU
kernel reads it on the host anyway (:func:`~functopk.sparse.k.k_on_host`;
eager, or inside the operator: a CPU scalar, no device synchronisation), and
there a NaN ``k`` is a ``ValueError``; the static kernels never read it
(:func:`~functopk.sparse.k.k_on_device`), and there NaN becomes ``n`` ("keep
everything": nothing is lost).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from functopk._checks import check_choice
from functopk.sparse.config import KernelConfig, config_or_default
from functopk.sparse.k import KLike, clamp_k, k_on_device, k_on_host
from functopk.sparse.kernels import triton_select
from functopk.sparse.kernels.approx import gaussian_threshold_flat, sample_threshold
from functopk.sparse.kernels.base import common_dtype, magnitudes_
from functopk.sparse.kernels.exact import select_exact
from functopk.sparse.kernels.static import mask_static, topk_static
from functopk.sparse.ops import ExactOp, TritonTopK
from functopk.sparse.selection import HostThreshold, Indices, Mask, Selection, Threshold

__all__ = [
    "EXACT_METHODS",
    "METHODS",
    "SLOW_STATIC_NUMEL",
    "SlowPathWarning",
    "TENSOR_K_FRACTION",
    "check_method",
    "route",
    "select",
]

METHODS = ("exact", "torch", "approx", "gaussian")
EXACT_METHODS = ("exact", "torch")
"""The methods that keep exactly ``k`` coordinates (the others keep about ``k``, a data-dependent count)."""


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
    if leaves[0].device.type != "cpu" or _differentiable(leaves):
        return "static"
    return "op" if torch.compiler.is_compiling() else "eager"


def _differentiable(leaves: list[torch.Tensor]) -> bool:
    """Whether the selection must be differentiable (the static kernel's ``Mask`` is, the others are not)."""
    return torch.is_grad_enabled() and any(x.requires_grad for x in leaves)


SLOW_STATIC_NUMEL = 1 << 20
"""Trees this large get :class:`SlowPathWarning` when ``"exact"`` falls back to the static kernel on the CPU."""

TENSOR_K_FRACTION = 0.01
"""The share of kept coordinates :class:`~.selection.HostThreshold` tunes its scan for when ``k`` is a tensor.

The share only picks the scan strategy, never the result, and a tensor ``k``
is not read on the host to learn it; 1% is a typical compression density, for
which the default config scans directly over int64 words (between
``column_max_fraction`` and ``words_max_fraction``).
"""


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


def select(leaves: list[torch.Tensor], k: KLike, method: str, config: KernelConfig | None = None) -> Selection:
    """Run the kernel that ``method`` and the context call for on ``leaves`` (see the module table).

    Args:
        leaves: The checked leaves (supported floats, one device, at least one coordinate).
        k: An int in ``[1, n]`` (checked), or a 0-d tensor (clamped by :func:`~functopk.sparse.k.clamp_k`).
        method: One of :data:`METHODS` (checked).
        config: The kernels' tuning constants (default: :data:`~.config.DEFAULT_CONFIG`).

    Returns:
        A :class:`~.selection.Selection`: ask it for the output (``dense``, ``masks`` or ``sparse``).

    Example:
        >>> import torch
        >>> select([torch.tensor([1.0, -3.0, 2.0])], 2, "exact")
        Indices(indices=tensor([1, 2]), values=tensor([-3.,  2.]))
        >>> select([torch.tensor([1.0, -3.0, 2.0])], torch.tensor(2), "torch").mask
        tensor([False,  True,  True])
    """
    config = config_or_default(config)
    n = sum(x.numel() for x in leaves)
    if method == "exact" and not _differentiable(leaves) and triton_select.serves(leaves, n, config.backend):
        if isinstance(k, int):
            return TritonTopK(k, None, config)
        return TritonTopK(0, clamp_k(k, n).to(leaves[0].device), config)
    where = route(leaves)
    if method == "exact" and where == "op":  # the operator does the rest, on the real tensors
        return ExactOp(k, None, config) if isinstance(k, int) else ExactOp(0, k, config)
    dtype = common_dtype(leaves)
    if method == "exact" and where == "eager":
        return Indices(*select_exact([x.detach().reshape(-1) for x in leaves], k_on_host(k, n), dtype, config))
    k = k_on_device(k, n)
    if method == "exact" and leaves[0].device.type == "cpu" and n >= SLOW_STATIC_NUMEL:
        _warn_static_on_cpu(n)
    if method in EXACT_METHODS:
        # kept for the outputs (see Mask), and differentiable, as where() per leaf is
        values = torch.cat([x.reshape(-1) if x.dtype == dtype else x.reshape(-1).to(dtype) for x in leaves])
        mags = magnitudes_(values.detach().abs())
        if isinstance(k, int):
            mask, idx = topk_static(mags, k)
            return Mask(mask, k, values, idx)
        return Mask(mask_static(mags, k), k, values)
    flats = [x.detach().reshape(-1) for x in leaves]
    if method == "approx":
        t = sample_threshold(flats, k, dtype)
    else:
        t = gaussian_threshold_flat(flats, k / n, dtype)
    if where == "eager":
        return HostThreshold(t, k / n if isinstance(k, int) else TENSOR_K_FRACTION, config)
    return Threshold(t)
