"""Clipping and non-finite guards: ``clip``, ``clip_by_global_norm``, ``zero_nans``, ``apply_if_finite``.

None of these reads a value back to the host: norms, finiteness flags and step
decisions stay 0-d tensors, and the choice between two trees is a ``torch.where``
per leaf (there is no foreach ``where`` kernel; ``torch.compile`` fuses them).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from functopk._checks import check_hyperparam
from functopk.base import EmptyState, GradientTransformation, OptState, Params, Updates, init_count, recorded
from functopk.build import leafwise, wrapper
from functopk.optim._shared import Leaves, check_count, step_or_skip
from functopk.tree import foreach
from functopk.tree.maths import all_finite

__all__ = ["ApplyIfFiniteState", "apply_if_finite", "clip", "clip_by_global_norm", "zero_nans"]


@recorded
def clip(max_delta: float | torch.Tensor) -> GradientTransformation:
    """Clamp every coordinate of the updates to ``[-max_delta, max_delta]`` (NaN stays NaN).

    Two foreach kernels (``clamp_min``, ``clamp_max``) for a Python ``max_delta``;
    for a 0-d tensor (``inject_hyperparams``) there is no foreach clamp taking a
    tensor bound, so it is one ``torch.clamp`` per leaf.

    Args:
        max_delta: The bound, ``>= 0``.

    Example:
        >>> import torch, functopk as ft
        >>> tx = ft.clip(1.0)
        >>> tx.update({"w": torch.tensor([-3.0, 0.5, 2.0])}, tx.init(None))[0]
        {'w': tensor([-1.0000,  0.5000,  1.0000])}
    """
    max_delta = check_hyperparam(max_delta, "max_delta", minimum=0.0)

    def update(grads: Leaves, state: EmptyState, params: Leaves | None) -> tuple[Leaves, EmptyState]:
        return foreach.clamp(grads, -max_delta, max_delta), state

    return leafwise("clip", update)


@recorded
def clip_by_global_norm(max_norm: float | torch.Tensor) -> GradientTransformation:
    """Scale the updates down so that their global L2 norm is at most ``max_norm``.

    ``updates * min(1, max_norm / (norm + 1e-6))``, the rule of
    ``torch.nn.utils.clip_grad_norm_`` (so the result's norm is strictly below
    ``max_norm`` when clipped). Updates whose norm is already below are returned
    unchanged in value. optax's rule differs slightly: ``updates * max_norm / norm``
    where ``norm >= max_norm`` (no ``1e-6``). The norm is :func:`functopk.tree.norm`'s.
    Non-finite input: a NaN anywhere makes every coordinate NaN, an infinity gives
    NaN or 0 coordinates (``inf * 0``); guard with :func:`zero_nans` or :func:`apply_if_finite` where that can happen.

    Args:
        max_norm: The largest allowed global norm, ``>= 0``.

    Example:
        >>> import torch, functopk as ft
        >>> tx = ft.clip_by_global_norm(1.0)
        >>> updates, _ = tx.update({"a": torch.tensor([3.0]), "b": torch.tensor([4.0])}, tx.init(None))
        >>> [round(float(x), 4) for x in (updates["a"], updates["b"])]
        [0.6, 0.8]
    """
    max_norm = check_hyperparam(max_norm, "max_norm", minimum=0.0)

    def update(grads: Leaves, state: EmptyState, params: Leaves | None) -> tuple[Leaves, EmptyState]:
        factor = torch.clamp(max_norm / (foreach.global_norm(grads) + 1e-6), max=1.0)
        return foreach.mul(grads, factor), state

    return leafwise("clip_by_global_norm", update)


@recorded
def zero_nans() -> GradientTransformation:
    """Replace NaN coordinates of the updates by 0 (infinities are kept).

    One ``torch.nan_to_num`` per leaf (there is no foreach kernel for it).

    Example:
        >>> import torch, functopk as ft
        >>> tx = ft.zero_nans()
        >>> tx.update({"w": torch.tensor([1.0, float("nan"), float("inf")])}, tx.init(None))[0]
        {'w': tensor([1., 0., inf])}
    """

    def update(grads: Leaves, state: EmptyState, params: Leaves | None) -> tuple[Leaves, EmptyState]:
        return foreach.nan_to_zero(grads), state

    return leafwise("zero_nans", update)


class ApplyIfFiniteState(NamedTuple):
    """State of :func:`apply_if_finite`.

    Attributes:
        notfinite_count: Consecutive non-finite steps so far (0-d int64).
        last_finite: Whether the last step's updates were finite (0-d bool).
        total_notfinite: All non-finite (skipped or forced) steps so far (0-d int64).
        inner_state: The inner transformation's state, as of the last applied step.

    Example:
        >>> import torch, functopk as ft
        >>> state = ft.apply_if_finite(ft.sgd(0.1)).init({"w": torch.zeros(2)})
        >>> state.notfinite_count, state.last_finite
        (tensor(0), tensor(True))
    """

    notfinite_count: torch.Tensor
    last_finite: torch.Tensor
    total_notfinite: torch.Tensor
    inner_state: OptState


@recorded
def apply_if_finite(
    inner: GradientTransformation, max_consecutive_errors: int | torch.Tensor | None = None
) -> GradientTransformation:
    """Skip steps whose updates are not finite: emit zeros and keep ``inner``'s state as it was.

    ``inner`` runs at every step; when its output updates contain a NaN or an
    infinity, the emitted updates are zeros and the inner state is the old one
    (so e.g. Adam's moments and step count are not polluted), and the skip is
    counted. Everything is decided on device (``torch.where`` per leaf), so a step
    never syncs with the host and compiles as one graph. The check is on the
    inner transformation's *output* (a NaN that the inner transformation removes,
    e.g. with :func:`zero_nans`, does not skip the step).

    Args:
        inner: The transformation to guard (typically the whole optimizer).
        max_consecutive_errors: After this many consecutive skipped steps, apply the
            next non-finite one anyway (as optax does); ``None`` (default) never does.

    Example:
        >>> import torch, functopk as ft
        >>> tx = ft.apply_if_finite(ft.sgd(0.1, momentum=0.9))
        >>> params = {"w": torch.ones(2)}
        >>> state = tx.init(params)
        >>> updates, state = tx.update({"w": torch.tensor([1.0, float("nan")])}, state, params)
        >>> updates["w"], int(state.total_notfinite)
        (tensor([0., 0.]), 1)
    """
    if max_consecutive_errors is not None:
        max_consecutive_errors = check_count(max_consecutive_errors, "max_consecutive_errors", minimum=0)

    def init(params: Params, inner_state: OptState) -> ApplyIfFiniteState:
        count = init_count(params)
        return ApplyIfFiniteState(
            notfinite_count=count,
            last_finite=torch.ones((), dtype=torch.bool, device=count.device),
            total_notfinite=count.clone(),
            inner_state=inner_state,
        )

    def update(
        updates: Updates, state: ApplyIfFiniteState, params: Params | None = None
    ) -> tuple[Updates, ApplyIfFiniteState]:
        new_updates, new_inner = inner.update(updates, state.inner_state, params)
        finite = all_finite(new_updates).to(state.notfinite_count.device)
        apply = finite
        if max_consecutive_errors is not None:
            apply = finite | (state.notfinite_count >= max_consecutive_errors)
        out, inner_state = step_or_skip(apply, new_updates, new_inner, state.inner_state)
        notfinite = (~finite).to(state.notfinite_count.dtype)
        return out, ApplyIfFiniteState(
            notfinite_count=(state.notfinite_count + 1) * notfinite,
            last_finite=finite,
            total_notfinite=state.total_notfinite + notfinite,
            inner_state=inner_state,
        )

    return wrapper("apply_if_finite", inner, update, init=init, state=ApplyIfFiniteState)
