"""What a selection kernel produced, as small result types that know how to become each output.

:func:`functopk.sparse.dispatch.select` returns one of them, typed as the
one protocol they all follow, :class:`Selection`; the public functions only
ask it for the output they return:

* :meth:`~Selection.dense` the sparsified leaves (kept values bit-exact, zeros elsewhere);
* :meth:`~Selection.masks` boolean leaves;
* :meth:`~Selection.sparse` a :class:`~functopk.sparse.SparseUpdates`.

=====================  =============================================  ==========================
type                   made by                                        shapes
=====================  =============================================  ==========================
:class:`Indices`       the eager exact kernel (sorted indices)         data-dependent, eager only
:class:`Mask`          the static exact kernel (flat boolean mask)     static
:class:`Threshold`     an approximate threshold, static comparisons    static (dense outputs)
:class:`HostThreshold` the same in eager CPU mode, read on the host    data-dependent, eager only
``ops.ExactOp``        the eager exact kernel as custom operators     as :class:`Indices`, compiled
                       (compiling on the CPU)
``ops.TritonTopK``     the Triton kernel (a custom operator when      static (data-dependent
                       compiling)                                     indices for a tensor ``k``)
=====================  =============================================  ==========================
"""

from __future__ import annotations

from typing import NamedTuple, Protocol, runtime_checkable

import torch

from functopk.sparse.config import KernelConfig
from functopk.sparse.kernels.base import common_dtype, round_down
from functopk.sparse.kernels.scan import scan_above
from functopk.sparse.updates import SparseUpdates, zeros_with

__all__ = ["HostThreshold", "Indices", "Mask", "Selection", "Threshold", "leaf_views", "sparse_updates"]


@runtime_checkable
class Selection(Protocol):
    """What :func:`functopk.sparse.dispatch.select` returns: a selection that can become each output.

    Every result type of this module follows it, and so does
    :class:`~functopk.sparse.ops.ExactOp`; each method takes the leaves the
    selection was made from.
    """

    def dense(self, leaves: list[torch.Tensor]) -> list[torch.Tensor]:
        """The sparsified leaves: the selected values (bit-exact), zeros elsewhere."""
        ...

    def masks(self, leaves: list[torch.Tensor]) -> list[torch.Tensor]:
        """Boolean leaves, True at the selected coordinates."""
        ...

    def sparse(self, leaves: list[torch.Tensor]) -> SparseUpdates:
        """The selected coordinates as a :class:`~functopk.SparseUpdates`."""
        ...


def sparse_updates(leaves: list[torch.Tensor], idx: torch.Tensor, vals: torch.Tensor) -> SparseUpdates:
    """A :class:`~functopk.SparseUpdates` of ``idx`` and ``vals`` selected from ``leaves`` (their sizes recorded)."""
    sizes = tuple(x.numel() for x in leaves)
    return SparseUpdates(idx, vals, sum(sizes), sizes)


def _flat(leaves: list[torch.Tensor]) -> torch.Tensor:
    """The concatenation of the leaves in their common dtype (a new n-sized tensor)."""
    dtype = common_dtype(leaves)
    return torch.cat([x.reshape(-1).to(dtype) for x in leaves])


class Indices(NamedTuple):
    """The exact top-k as sorted flat indices and their values in the common dtype (the eager exact kernel)."""

    indices: torch.Tensor
    values: torch.Tensor

    def dense(self, leaves: list[torch.Tensor]) -> list[torch.Tensor]:
        """Per leaf: zeros, with the selected coordinates copied in (:func:`~.updates.zeros_with`)."""
        one_dtype = all(x.dtype == self.values.dtype for x in leaves)
        return zeros_with(leaves, self.indices, self.values if one_dtype else None)  # mixed: the leaf's own bits

    def masks(self, leaves: list[torch.Tensor]) -> list[torch.Tensor]:
        """Per leaf: a boolean tensor, True at the selected coordinates."""
        return zeros_with(leaves, self.indices, masks=True)

    def sparse(self, leaves: list[torch.Tensor]) -> SparseUpdates:
        """The indices and values as they are."""
        return sparse_updates(leaves, self.indices, self.values)


class Mask(NamedTuple):
    """The exact top-k as a flat boolean mask with exactly ``k`` entries set (the static kernel).

    ``indices``, when the kernel found them (an int ``k``), are the set entries in ascending order.
    ``values``, when the kernel kept it, is the concatenation of the leaves in
    their common dtype: the dense and sparse outputs then read it instead of
    concatenating again or working leaf by leaf (one kernel each instead of one
    per leaf, which is what a GPU step pays for).
    """

    mask: torch.Tensor
    k: int | torch.Tensor
    values: torch.Tensor | None = None
    indices: torch.Tensor | None = None  # the set entries in ascending order, when the kernel had them

    def masks(self, leaves: list[torch.Tensor]) -> list[torch.Tensor]:
        """The mask cut into leaf-shaped views (no offsets needed: one ``torch.split``)."""
        return leaf_views(self.mask, leaves)

    def dense(self, leaves: list[torch.Tensor]) -> list[torch.Tensor]:
        """``where(mask, x, 0)``: over ``values`` at once (views of one buffer) when every leaf has its dtype."""
        if self.values is not None and all(x.dtype == self.values.dtype for x in leaves):
            return leaf_views(torch.where(self.mask, self.values, 0.0), leaves)
        return [torch.where(m, x, 0.0) for m, x in zip(self.masks(leaves), leaves)]

    def sparse(self, leaves: list[torch.Tensor]) -> SparseUpdates:
        """``nonzero`` of the mask; with an int ``k`` of static size ``k`` (``nonzero_static``)."""
        flat = _flat(leaves) if self.values is None else self.values
        if self.indices is not None:
            idx = self.indices
        elif isinstance(self.k, int):  # exactly k entries are set: the output size is static
            idx = torch.nonzero_static(self.mask, size=self.k).view(-1)
        else:
            idx = self.mask.nonzero().view(-1)
        return sparse_updates(leaves, idx, flat[idx])


def leaf_views(flat: torch.Tensor, leaves: list[torch.Tensor]) -> list[torch.Tensor]:
    """``flat`` cut into views shaped like ``leaves`` (contiguous, in flat order).

    Example:
        >>> import torch
        >>> leaf_views(torch.arange(5), [torch.ones(2, 1), torch.ones(3)])
        [tensor([[0],
                [1]]), tensor([2, 3, 4])]

    A 1-d leaf's piece is its view already: skipping ``view`` there saves host time (biases and norms
    are most of a network's leaves), which is what a GPU call is bound by.
    """
    pieces = torch.split(flat, [x.numel() for x in leaves])
    return [p if x.dim() == 1 else p.view(x.shape) for p, x in zip(pieces, leaves)]


def _above(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """``|x| > t`` or NaN, compared in ``t``'s (common) dtype: static shapes, no host read."""
    return ~((x if x.dtype == t.dtype else x.to(t.dtype)).abs() <= t)


class Threshold(NamedTuple):
    """An approximate selection: every coordinate with ``|x| > t`` or NaN (``t`` a 0-d tensor, common dtype)."""

    t: torch.Tensor

    def masks(self, leaves: list[torch.Tensor]) -> list[torch.Tensor]:
        """``|x| > t`` or NaN per leaf, compared in the common dtype."""
        return [_above(x.detach(), self.t) for x in leaves]

    def dense(self, leaves: list[torch.Tensor]) -> list[torch.Tensor]:
        """``where(|x| > t or NaN, x, 0)`` per leaf."""
        return [torch.where(m, x, 0.0) for m, x in zip(self.masks(leaves), leaves)]

    def sparse(self, leaves: list[torch.Tensor]) -> SparseUpdates:
        """``nonzero`` over the concatenation (a data-dependent length)."""
        flat = _flat(leaves)
        idx = _above(flat, self.t).nonzero().view(-1)
        return sparse_updates(leaves, idx, flat[idx])


class HostThreshold(NamedTuple):
    """:class:`Threshold` in eager CPU mode: ``t`` is read on the host and compared in each leaf's dtype.

    ``fraction`` (the expected share of kept coordinates) picks the scan strategy of :meth:`sparse`.
    """

    t: torch.Tensor
    fraction: float
    config: KernelConfig

    def _limits(self, leaves: list[torch.Tensor]) -> list[float]:
        """``t`` rounded down into each leaf's dtype (exact there, see :func:`~.kernels.base.round_down`)."""
        value, limits = self.t.item(), {}
        for x in leaves:
            if x.dtype not in limits:
                limits[x.dtype] = round_down(value, x.dtype, self.t.dtype)
        return [limits[x.dtype] for x in leaves]

    def masks(self, leaves: list[torch.Tensor]) -> list[torch.Tensor]:
        """``not |x| <= limit`` per leaf (NaN in)."""
        return [~(x.detach().abs() <= t) for x, t in zip(leaves, self._limits(leaves))]

    def dense(self, leaves: list[torch.Tensor]) -> list[torch.Tensor]:
        """One ``hardshrink`` per leaf: keeps ``|x| > t`` and NaN, zeros the rest."""
        return [torch.nn.functional.hardshrink(x, t) for x, t in zip(leaves, self._limits(leaves))]

    def sparse(self, leaves: list[torch.Tensor]) -> SparseUpdates:
        """The exact kernel's scan for ``t >= 0`` (no dense copy); else as :class:`Threshold`."""
        t = float(self.t)
        if not t >= 0:  # negative (keep everything) or NaN
            return Threshold(self.t).sparse(leaves)
        flats = [x.detach().reshape(-1) for x in leaves]
        idx, vals = scan_above(flats, t, common_dtype(leaves), self.fraction, self.config)
        return sparse_updates(leaves, idx, vals)
