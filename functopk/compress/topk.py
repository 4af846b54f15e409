"""Global top-k as a gradient transformation: :func:`topk` (see :mod:`functopk.sparse` for the selection)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from functopk._checks import check_k_or_density
from functopk.base import EmptyState, GradientTransformation, recorded
from functopk.build import leafwise
from functopk.sparse import dispatch
from functopk.sparse.config import KernelConfig
from functopk.sparse.k import KLike, k_at_step
from functopk.sparse.kernels.base import SUPPORTED_DTYPES

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
    config: KernelConfig | None = None,
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

    ``params`` are neither needed nor read (nor checked) by ``update``, as for
    every transformation that maps the updates alone (``randk``, ``threshold``,
    ``clip``, ...); at ``init`` they are checked, when given, against ``k``.

    The output is always a dense tree. For a sparse update (``O(k)`` indices and
    values), call :func:`~functopk.topk_indices` and apply it with
    :func:`~functopk.apply_sparse_updates`.

    Args:
        k: Coordinates kept per step.
        density: Fraction of coordinates kept per step, in ``(0, 1]``.
        method: Selection algorithm, as for :func:`~functopk.topk_sparsify`.
        config: The kernels' settings, as for :func:`~functopk.topk_sparsify`
            (``KernelConfig(backend="aten")``: the static kernel on CUDA instead
            of the Triton kernel; the same selection).

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
    if config is not None and not isinstance(config, KernelConfig):
        raise TypeError(f"config must be a functopk.sparse.KernelConfig or None, got {type(config).__name__}")
    scheduled = callable(k) or callable(density)

    def k_of(leaves: list[torch.Tensor], step: torch.Tensor | None, name: str) -> KLike:
        return k_at_step(k, density, step, sum(x.numel() for x in leaves), name=name)

    def validate(leaves: list[torch.Tensor], treedef: Any, name: str) -> None:
        if name == "params" and not scheduled:  # a constant k must fit the parameters (updates: checked below)
            k_of(leaves, None, name)

    def update(
        grads: list[torch.Tensor], state: Any, params: list[torch.Tensor] | None
    ) -> tuple[list[torch.Tensor], Any]:
        kk = k_of(grads, state.count if scheduled else None, "updates")  # EmptyState.count is tuple.count
        return dispatch.select(grads, kk, method, config).dense(grads), state

    return leafwise(
        "topk", update, state=TopKState if scheduled else EmptyState, counted=scheduled, dtypes=SUPPORTED_DTYPES,
        same_device=True, validate=validate,
    )
