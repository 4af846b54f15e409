"""Clipping and non-finite guards: ``clip``, ``clip_by_global_norm``, ``zero_nans``, ``apply_if_finite``.

None of these reads a value back to the host: norms, finiteness flags and step
decisions stay 0-d tensors, and the choice between two trees is a ``torch.where``
per leaf (there is no foreach ``where`` kernel; ``torch.compile`` fuses them).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import optree
import torch

from functopk._checks import check_hyperparam
from functopk.base import (
    GradientTransformation,
    OptState,
    Params,
    Updates,
    check_transformation,
    init_count,
    stateless,
)
from functopk.tree.foreach import keep_dtypes
from functopk.tree.foreach import where as select_leaves
from functopk.tree.maths import PyTree

__all__ = [
    "ApplyIfFiniteState",
    "all_finite",
    "apply_if_finite",
    "clip",
    "clip_by_global_norm",
    "global_norm",
    "zero_nans",
]


def _by_dtype(leaves: list[torch.Tensor]) -> dict[tuple[torch.device, torch.dtype], list[torch.Tensor]]:
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for x in leaves:
        groups.setdefault((x.device, x.dtype), []).append(x)
    return groups


def global_norm(tree: PyTree) -> torch.Tensor:
    """The L2 norm of all leaves together, as a 0-d tensor (no host sync).

    Computed like ``torch.nn.utils.clip_grad_norm_``: one ``torch._foreach_norm``
    per (device, dtype) group, then the norm of the per-leaf norms, in the
    promoted dtype of the leaves and float32 (half-precision leaves are summed in
    float32, so their norm does not overflow). Any NaN gives NaN, any infinity ``inf``.

    Example:
        >>> import torch, functopk as ft
        >>> ft.tree.norm({"a": torch.tensor([3.0]), "b": torch.tensor([[4.0]])})
        tensor(5.)
    """
    leaves = optree.tree_leaves(tree)
    if not leaves:
        return torch.zeros(())
    dtype = torch.float32
    for x in leaves:
        dtype = torch.promote_types(dtype, x.dtype)
    device = leaves[0].device
    norms = []
    for (_, group_dtype), group in _by_dtype(leaves).items():
        # fp16/bf16 norms are accumulated and returned in float32, so they cannot overflow.
        norms.append(torch.stack(torch._foreach_norm(group, 2, dtype=torch.promote_types(group_dtype, torch.float32))))
    return torch.linalg.vector_norm(torch.cat([n.to(device=device, dtype=dtype) for n in norms]))


def all_finite(tree: PyTree) -> torch.Tensor:
    """A 0-d bool tensor: True when no leaf holds a NaN or an infinity (no host sync).

    One ``torch._foreach_norm(ord=inf)`` per (device, dtype) group (the largest
    absolute value of each leaf: NaN if the leaf has a NaN, ``inf`` if it has an
    infinity, and never an overflow), then one ``isfinite().all()`` per group.

    Example:
        >>> import torch, functopk as ft
        >>> ft.tree.all_finite({"a": torch.ones(2), "b": torch.tensor([1.0, float("nan")])})
        tensor(False)
    """
    leaves = optree.tree_leaves(tree)
    result = None
    for group in _by_dtype(leaves).values():
        ok = torch.stack(torch._foreach_norm(group, ord=math.inf)).isfinite().all()
        result = ok if result is None else result.to(ok.device) & ok
    if result is None:
        return torch.ones((), dtype=torch.bool)
    return result


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

    def fn(updates: Updates, params: Params | None) -> Updates:
        leaves, treedef = optree.tree_flatten(updates)
        if not leaves:
            return updates
        if isinstance(max_delta, torch.Tensor):
            out = [torch.clamp(x, -max_delta, max_delta) for x in leaves]
        else:
            out = list(torch._foreach_clamp_min(leaves, -max_delta))
            torch._foreach_clamp_max_(out, max_delta)
        return optree.tree_unflatten(treedef, keep_dtypes(out, leaves))

    return stateless(fn)


def clip_by_global_norm(max_norm: float | torch.Tensor) -> GradientTransformation:
    """Scale the updates down so that their global L2 norm is at most ``max_norm``.

    ``updates * min(1, max_norm / (norm + 1e-6))``, the rule of
    ``torch.nn.utils.clip_grad_norm_`` (so the result's norm is strictly below
    ``max_norm`` when clipped). Updates whose norm is already below are returned
    unchanged in value. Non-finite input: a NaN anywhere makes every coordinate
    NaN, an infinity gives NaN or 0 coordinates (``inf * 0``); guard with
    :func:`zero_nans` or :func:`apply_if_finite` where that can happen.

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

    def fn(updates: Updates, params: Params | None) -> Updates:
        leaves, treedef = optree.tree_flatten(updates)
        if not leaves:
            return updates
        norm = global_norm(updates)
        factor = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        return optree.tree_unflatten(treedef, keep_dtypes(torch._foreach_mul(leaves, factor), leaves))

    return stateless(fn)


def zero_nans() -> GradientTransformation:
    """Replace NaN coordinates of the updates by 0 (infinities are kept).

    One ``torch.nan_to_num`` per leaf (there is no foreach kernel for it).

    Example:
        >>> import torch, functopk as ft
        >>> tx = ft.zero_nans()
        >>> tx.update({"w": torch.tensor([1.0, float("nan"), float("inf")])}, tx.init(None))[0]
        {'w': tensor([1., 0., inf])}
    """

    def fn(updates: Updates, params: Params | None) -> Updates:
        leaves, treedef = optree.tree_flatten(updates)
        out = [torch.nan_to_num(x, nan=0.0, posinf=math.inf, neginf=-math.inf) for x in leaves]
        return optree.tree_unflatten(treedef, out)

    return stateless(fn)


class ApplyIfFiniteState(NamedTuple):
    """State of :func:`apply_if_finite`.

    Attributes:
        notfinite_count: Consecutive non-finite steps so far (0-d int64).
        last_finite: Whether the last step's updates were finite (0-d bool).
        total_notfinite: All non-finite (skipped or forced) steps so far (0-d int64).
        inner_state: The inner transformation's state, as of the last applied step.
    """

    notfinite_count: torch.Tensor
    last_finite: torch.Tensor
    total_notfinite: torch.Tensor
    inner_state: OptState


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
    check_transformation(inner, "inner")
    if max_consecutive_errors is not None:
        if isinstance(max_consecutive_errors, torch.Tensor):
            if max_consecutive_errors.dim() != 0:
                raise TypeError("max_consecutive_errors must be an int or a 0-d tensor")
        elif isinstance(max_consecutive_errors, bool) or not isinstance(max_consecutive_errors, int):
            raise TypeError(
                f"max_consecutive_errors must be an int or None, got {type(max_consecutive_errors).__name__}"
            )
        elif max_consecutive_errors < 0:
            raise ValueError(f"max_consecutive_errors must be >= 0, got {max_consecutive_errors}")

    def init(params: Params) -> ApplyIfFiniteState:
        count = init_count(params)
        return ApplyIfFiniteState(
            notfinite_count=count,
            last_finite=torch.ones((), dtype=torch.bool, device=count.device),
            total_notfinite=count.clone(),
            inner_state=inner.init(params),
        )

    def update(
        updates: Updates, state: ApplyIfFiniteState, params: Params | None = None
    ) -> tuple[Updates, ApplyIfFiniteState]:
        if not isinstance(state, ApplyIfFiniteState):
            raise ValueError(f"state must be an ApplyIfFiniteState, got {type(state).__name__}")
        new_updates, new_inner = inner.update(updates, state.inner_state, params)
        finite = all_finite(new_updates).to(state.notfinite_count.device)
        apply = finite
        if max_consecutive_errors is not None:
            apply = finite | (state.notfinite_count >= max_consecutive_errors)
        leaves, treedef = optree.tree_flatten(new_updates)
        out = [torch.where(apply, x, torch.zeros((), dtype=x.dtype, device=x.device)) for x in leaves]
        old_inner, inner_def = optree.tree_flatten(state.inner_state)
        new_inner_leaves, new_def = optree.tree_flatten(new_inner)
        if new_def != inner_def:
            raise ValueError(f"inner transformation changed its state structure from {inner_def} to {new_def}")
        kept_inner = optree.tree_unflatten(inner_def, select_leaves(apply, new_inner_leaves, old_inner))
        notfinite = (~finite).to(state.notfinite_count.dtype)
        return optree.tree_unflatten(treedef, out), ApplyIfFiniteState(
            notfinite_count=(state.notfinite_count + 1) * notfinite,
            last_finite=finite,
            total_notfinite=state.total_notfinite + notfinite,
            inner_state=kept_inner,
        )

    return GradientTransformation(init, update)
