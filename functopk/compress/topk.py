"""Global top-k as a gradient transformation: :func:`topk` (see :mod:`functopk.sparse` for the selection).

Its pure update builds a new dense tree per step. A constant exact top-k also
has an in-place form (:mod:`functopk.inplace`), which :func:`functopk.update_`
and the ``torch.optim`` adapter (its ``sparsify``) run: a :class:`KeptBuffer`,
one flat gradient-sized buffer kept between steps by the transformation, into
which each step's selection is written after the last step's indices are
zeroed again; the output is views of it, the same numbers as the dense tree.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from functopk._checks import check_k_or_density
from functopk.base import EmptyState, GradientTransformation, recorded
from functopk.build import leafwise
from functopk.inplace import Planned, register_inplace
from functopk.sparse import dispatch
from functopk.sparse.config import KernelConfig, config_or_default
from functopk.sparse.k import KLike, k_at_step
from functopk.sparse.kernels.base import SUPPORTED_DTYPES
from functopk.sparse.selection import Indices

__all__ = ["KeptBuffer", "TopKState", "topk"]


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
    config_or_default(config)  # (checked here; None stays None below)
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

    tx = leafwise(
        "topk", update, state=TopKState if scheduled else EmptyState, counted=scheduled, dtypes=SUPPORTED_DTYPES,
        same_device=True, validate=validate,
    )
    constant = not scheduled and not isinstance(k, torch.Tensor) and not isinstance(density, torch.Tensor)
    return register_inplace(tx, KeptBuffer(k_of)) if constant and method == "exact" else tx


class KeptBuffer:
    """A constant exact top-k's in-place stage: its selection written into one flat buffer kept between steps.

    Each step zeroes the buffer at the last step's indices (``O(k)``), writes
    the new values at the new ones, and returns views of it shaped like the
    leaves: the same numbers as :func:`topk`'s dense tree, with no tree
    allocated per step. The views are valid until the next step. Leaves of one
    dtype on one device only; the static kernel's result (off the CPU, under
    compile) is the dense tree, as without the buffer. Memory: the buffer (one
    gradient-sized tensor) and the last ``k`` indices, for the transformation's lifetime.

    Example:
        >>> import torch, functopk as ft
        >>> params, tx = {"w": torch.zeros(3)}, ft.topk(1)
        >>> ft.update_(tx, {"w": torch.tensor([1.0, -3.0, 2.0])}, tx.init(params), params)[0]["w"]
        tensor([ 0., -3.,  0.])
        >>> ft.inplace.stage_of(tx).buffer
        tensor([ 0., -3.,  0.])
    """

    def __init__(self, k_of: Callable[[list[torch.Tensor], Any, str], KLike]) -> None:
        self.k_of = k_of
        self.buffer: torch.Tensor | None = None
        self._last: torch.Tensor | None = None  # where the buffer is not zero: the last step's indices
        self._views: tuple[Any, list[torch.Tensor]] = ((), [])

    def __call__(self, grads: list[torch.Tensor], state: Any, params: list[torch.Tensor], treedef: Any) -> Any:
        first = params[0]
        if type(state) is not EmptyState or first.dtype not in SUPPORTED_DTYPES or not all(
            type(p) in (torch.Tensor, torch.nn.Parameter) and p.dtype == first.dtype and p.device == first.device
            for p in params
        ):
            return None
        k = self.k_of(params, None, "updates")  # (its checks, as the pure update's, before anything is written)
        return Planned([], lambda updates, writer: self.select(updates, k), state, sparse=True)

    def select(self, grads: list[torch.Tensor], k: KLike) -> list[torch.Tensor]:
        """The top-``k`` of ``grads``, as views of the buffer (the static kernel: a new dense tree)."""
        sel = dispatch.select(grads, k, "exact")
        if not isinstance(sel, Indices):
            return sel.dense(grads)
        n = sum(g.numel() for g in grads)
        buf = self.buffer
        if buf is None or buf.numel() < n or buf.dtype != grads[0].dtype or buf.device != grads[0].device:
            buf = self.buffer = torch.zeros(n, dtype=grads[0].dtype, device=grads[0].device)
            self._last = None
        if self._last is not None:
            buf.index_fill_(0, self._last, 0)
        buf.index_copy_(0, sel.indices, sel.values)
        self._last = sel.indices
        key = (buf.data_ptr(), tuple(g.shape for g in grads))
        if self._views[0] != key:
            pieces = torch.split(buf[:n], [g.numel() for g in grads])
            self._views = (key, [x.view(g.shape) for x, g in zip(pieces, grads)])
        return list(self._views[1])
