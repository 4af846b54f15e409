"""Global top-k as a gradient transformation: :func:`topk` (see :mod:`functopk.sparse` for the selection)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import optree
import torch

from functopk._checks import check_k_or_density, check_state
from functopk.base import EmptyState, GradientTransformation, Params, Updates, init_count, recorded
from functopk.sparse import dispatch
from functopk.sparse.api import sparse_leaves
from functopk.sparse.k import k_at_step, resolve_k

__all__ = ["TopKState", "topk"]


class TopKState(NamedTuple):
    """State of :func:`topk` when ``k`` or ``density`` is a schedule: the number of updates done.

    Example:
        >>> import torch, functopk as ft
        >>> ft.topk(lambda count: 1 + count).init({"w": torch.zeros(4)})
        TopKState(count=tensor(0))
    """

    count: torch.Tensor  # type: ignore[assignment]


@recorded
def topk(
    k: int | torch.Tensor | Callable[[torch.Tensor], Any] | None = None,
    *,
    density: float | torch.Tensor | Callable[[torch.Tensor], Any] | None = None,
    method: str = "exact",
) -> GradientTransformation:
    """Global top-k sparsification as a transformation (see :func:`~functopk.topk_sparsify`).

    Give exactly one of ``k`` (a count) or ``density`` (a fraction of all
    coordinates, turned into ``k`` by :func:`~functopk.sparse.k_from_density` from
    the size of the updates). Each may be a constant, a 0-d tensor (as
    :func:`~functopk.inject_hyperparams` passes them) or a schedule, a function of
    the step count (``count -> k`` or ``count -> density``). With a schedule the
    state is a :class:`TopKState` holding the count, and the selection runs with
    a 0-d tensor ``k``: ``"torch"`` and compiled ``"exact"`` then use a radix
    select (static shapes, a few histogram passes), eager ``"exact"`` reads ``k``
    on the host (it reads sizes anyway). Otherwise the state is empty. A tensor
    ``k`` or ``density`` that is NaN, infinite or huge follows the rules of
    :mod:`functopk.sparse.api` (clamped; NaN keeps everything, or raises in the
    eager exact kernel).

    The output is always a dense tree. For a sparse update (``O(k)`` indices and
    values), call :func:`~functopk.topk_indices` and apply it with
    :func:`~functopk.apply_sparse_updates`.

    Args:
        k: Coordinates kept per step.
        density: Fraction of coordinates kept per step, in ``(0, 1]``.
        method: Selection algorithm, as for :func:`~functopk.topk_sparsify`.

    Example:
        >>> import torch, functopk as ft
        >>> tx = ft.topk(density=0.5)
        >>> tx.update({"w": torch.tensor([1.0, -4.0, 2.0, 0.5])}, tx.init(None))[0]
        {'w': tensor([ 0., -4.,  2.,  0.])}
        >>> tx = ft.topk(lambda count: 1 + count)       # keep 1, then 2, 3, ... coordinates
        >>> state = tx.init(None)
        >>> for _ in range(2):
        ...     out, state = tx.update({"w": torch.tensor([1.0, -4.0, 2.0, 0.5])}, state)
        >>> out["w"], state.count
        (tensor([ 0., -4.,  2.,  0.]), tensor(2))
    """
    k, density = check_k_or_density(k, density, allow_schedule=True)
    method = dispatch.check_method(method)
    scheduled = callable(k) or callable(density)

    def init(params: Params) -> EmptyState | TopKState:
        if params is not None and not scheduled:
            resolve_k(k, density, sum(x.numel() for x in sparse_leaves(params, "params")[0]), name="params")
        return TopKState(count=init_count(params)) if scheduled else EmptyState()

    def update(
        updates: Updates, state: EmptyState | TopKState, params: Params | None = None
    ) -> tuple[Updates, EmptyState | TopKState]:
        del params
        leaves, treedef = sparse_leaves(updates, "updates")
        numel = sum(x.numel() for x in leaves)
        if scheduled:
            step = check_state(state, TopKState, "topk").count
            kk, state = k_at_step(k, density, step, numel), TopKState(count=step + 1)
        else:
            kk, state = k_at_step(k, density, None, numel), check_state(state, EmptyState, "topk")
        return optree.tree_unflatten(treedef, dispatch.select(leaves, kk, method).dense(leaves)), state

    return GradientTransformation(init, update)
