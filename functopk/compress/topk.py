"""Global top-k as a gradient transformation: :func:`topk` (see :mod:`functopk.sparse` for the selection)."""

from __future__ import annotations

import numbers
from collections.abc import Callable
from typing import Any, NamedTuple

import optree
import torch

from functopk.base import EmptyState, GradientTransformation, Params, Updates, init_count
from functopk.sparse.api import (
    KLike,
    _check_density,
    _check_k,
    _check_method,
    _dense_leaves,
    _float_leaves,
    _select,
    _sparse,
    k_from_density,
)
from functopk.sparse.updates import SparseUpdates

__all__ = ["TopKState", "topk"]


class TopKState(NamedTuple):
    """State of :func:`topk` when ``k`` or ``density`` is a schedule: the number of updates done."""

    count: torch.Tensor


def _schedule_value(fn: Callable[[torch.Tensor], Any], count: torch.Tensor, name: str) -> Any:
    value = fn(count)
    if isinstance(value, (torch.Tensor, numbers.Real)) and not isinstance(value, bool):
        return value
    raise TypeError(f"the {name} schedule must return a number or a 0-d tensor, got {type(value).__name__}")


def topk(
    k: int | torch.Tensor | Callable[[torch.Tensor], Any] | None = None,
    *,
    density: float | torch.Tensor | Callable[[torch.Tensor], Any] | None = None,
    method: str = "exact",
    sparse: bool = False,
) -> GradientTransformation:
    """Global top-k sparsification as a transformation (see :func:`topk_sparsify`).

    Give exactly one of ``k`` (a count) or ``density`` (a fraction of all
    coordinates, turned into ``k`` by :func:`k_from_density` from the size of
    the updates). Each may be a constant, a 0-d tensor (as
    :func:`~functopk.inject_hyperparams` passes them) or a schedule, a function of
    the step count (``count -> k`` or ``count -> density``). With a schedule the
    state is a :class:`TopKState` holding the count, and the selection runs with
    a 0-d tensor ``k``: ``"torch"`` and compiled ``"exact"`` then use a radix
    select (static shapes, a few histogram passes), eager ``"exact"`` reads ``k``
    on the host (it reads sizes anyway). Otherwise the state is empty.

    Args:
        k: Coordinates kept per step.
        density: Fraction of coordinates kept per step, in ``(0, 1]``.
        method: Selection algorithm, as for :func:`topk_sparsify`.
        sparse: Emit a :class:`~functopk.SparseUpdates` instead of a dense tree.
            It is meant to end a chain: apply it with
            :func:`~functopk.apply_sparse_updates` (``scale=-lr`` for plain SGD,
            which then costs the selection plus one copy of the parameters).

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
    if (k is None) == (density is None):
        raise ValueError("give exactly one of k or density")
    if not isinstance(sparse, bool):
        raise TypeError(f"sparse must be a bool, got {type(sparse).__name__}")
    method = _check_method(method)
    scheduled = callable(k) or callable(density)
    if k is not None and not callable(k):
        if isinstance(k, torch.Tensor):
            _check_k(k, 1)  # type and shape only
        else:
            if isinstance(k, bool) or not isinstance(k, numbers.Integral):
                raise TypeError(f"k must be an int, a 0-d tensor or a schedule, got {type(k).__name__} {k!r}")
            if k < 1:
                raise ValueError(f"k must be >= 1, got {k}")
            k = int(k)
    if density is not None and not callable(density):
        density = _check_density(density)

    def resolve_k(leaves: list[torch.Tensor], count: torch.Tensor | None) -> KLike:
        numel = sum(x.numel() for x in leaves)
        if k is not None:
            value = _schedule_value(k, count, "k") if callable(k) else k
            return _check_k(value, numel)
        if numel == 0:
            raise ValueError("cannot keep a fraction of an empty tree: it has no coordinates")
        value = _schedule_value(density, count, "density") if callable(density) else density
        return k_from_density(value, numel)

    def init(params: Params) -> EmptyState | TopKState:
        if params is not None and not scheduled:
            resolve_k(_float_leaves(params, "params")[0], None)
        return TopKState(count=init_count(params)) if scheduled else EmptyState()

    def update(
        updates: Updates, state: EmptyState | TopKState, params: Params | None = None
    ) -> tuple[Updates | SparseUpdates, EmptyState | TopKState]:
        del params
        leaves, treedef = _float_leaves(updates, "updates")
        if scheduled:
            if not isinstance(state, TopKState):
                raise TypeError(f"state must be a TopKState (k or density is a schedule), got {type(state).__name__}")
            kk = resolve_k(leaves, state.count)
            new_state = TopKState(count=state.count + 1)
        else:
            kk = resolve_k(leaves, None)
            new_state = state
        sel = _select(leaves, kk, method)
        out = _sparse(leaves, sel, kk) if sparse else optree.tree_unflatten(treedef, _dense_leaves(leaves, sel))
        return out, new_state

    return GradientTransformation(init, update)
