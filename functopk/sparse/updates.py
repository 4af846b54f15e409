"""Sparse updates: :class:`SparseUpdates` (ascending flat indices and values) and how to apply them."""

from __future__ import annotations

from typing import Any, NamedTuple

import optree
import torch

from functopk.base import Params
from functopk.tree.layout import FlatLayout
from functopk.tree.maths import PyTree

__all__ = ["SparseUpdates", "apply_sparse_updates", "apply_sparse_updates_"]


class SparseUpdates(NamedTuple):
    """A sparse update of a tree: which flat coordinates change, and by how much.

    Produced by :func:`functopk.topk_indices` and by ``functopk.topk(..., sparse=True)``;
    consumed by :func:`apply_sparse_updates`, :func:`apply_sparse_updates_` and
    :meth:`to_dense`. Flat indices refer to the flat order of the tree the
    coordinates were selected from (``optree.tree_leaves`` order, each leaf
    row-major; see :class:`functopk.tree.FlatLayout`), so they apply to any tree with
    the same leaves (same structure, shapes and ``None`` positions), such as the
    parameters that the gradients came from.

    Attributes:
        indices: 1-d int64 tensor of distinct flat indices in ascending order.
        values: 1-d tensor, one value per index, in the common (promoted) dtype of
            the tree's leaves. That dtype represents every value of every leaf
            exactly, so for a tree of one dtype the values are the selected
            coordinates bit for bit.
        numel: The total number of coordinates of the tree (an int), checked
            against the tree the update is applied to.

    Example:
        >>> import torch, functopk as ft
        >>> sparse = ft.topk_indices({"a": torch.tensor([0.5, -3.0]), "b": torch.tensor([2.0])}, 2)
        >>> sparse
        SparseUpdates(indices=tensor([1, 2]), values=tensor([-3.,  2.]), numel=3)
        >>> sparse.to_dense({"a": torch.zeros(2), "b": torch.zeros(1)})
        {'a': tensor([ 0., -3.]), 'b': tensor([2.])}
    """

    indices: torch.Tensor
    values: torch.Tensor
    numel: int

    def to_dense(self, like: PyTree) -> PyTree:
        """The dense tree with ``like``'s structure, shapes, dtypes and device: zeros except at ``indices``.

        Values are cast to each leaf's dtype (exact when they came from that leaf).
        Compiled, or off CPU: static shapes, no host sync. In eager mode on CPU the
        indices are split by leaf on the host (see :func:`apply_sparse_updates`).
        """
        leaves, treedef = optree.tree_flatten(like)
        _check_sparse(self, leaves, "like")
        return optree.tree_unflatten(treedef, _scatter(leaves, self.indices, self.values, base=False))


def _check_sparse(sparse: Any, leaves: list[torch.Tensor], name: str) -> None:
    if not isinstance(sparse, SparseUpdates):
        raise TypeError(f"sparse must be a functopk.SparseUpdates, got {type(sparse).__name__}")
    for path_leaf in leaves:
        if not isinstance(path_leaf, torch.Tensor):
            raise TypeError(f"{name} leaves must be tensors, got a {type(path_leaf).__name__}")
    numel = sum(x.numel() for x in leaves)
    if numel != sparse.numel:
        raise ValueError(
            f"sparse update covers {sparse.numel} coordinates, but {name} has {numel}; the tree must have the "
            "leaves (structure, shapes, None positions) of the tree the update was selected from"
        )
    if sparse.indices.dim() != 1 or sparse.values.dim() != 1 or sparse.indices.shape != sparse.values.shape:
        raise ValueError(
            f"sparse.indices and sparse.values must be 1-d of one length, got shapes "
            f"{tuple(sparse.indices.shape)} and {tuple(sparse.values.shape)}"
        )
    if sparse.indices.dtype != torch.int64:
        raise TypeError(f"sparse.indices must be int64, got {sparse.indices.dtype}")


def _scatter(leaves: list[torch.Tensor], idx: torch.Tensor, vals: torch.Tensor, *, base: bool) -> list[torch.Tensor]:
    """New leaves: ``leaves`` plus ``vals`` at ``idx`` (``base=True``), or zeros set to ``vals`` there.

    One flat buffer per leaf dtype (a ``torch.cat`` of the leaves, or zeros),
    one ``index_add_``/``index_copy_`` into it, then views cut back out: static
    shapes, no host sync, differentiable. With several dtypes, each index is
    routed to its dtype's buffer through the leaf offsets (tensor ops); indices
    belonging to other dtypes land in a scratch slot at the end that is dropped.
    """
    if not leaves:
        return []
    device = leaves[0].device
    if device.type == "cpu" and not torch.compiler.is_compiling():
        return _scatter_per_leaf(leaves, idx, vals, base=base)
    dtypes = list(dict.fromkeys(x.dtype for x in leaves))
    if len(dtypes) == 1:
        groups = [(dtypes[0], list(range(len(leaves))), idx, 0)]
    else:
        leaf_ids, positions = FlatLayout.from_tree(leaves).locate(idx)
        groups = []
        for dtype in dtypes:
            members = [i for i, x in enumerate(leaves) if x.dtype == dtype]
            size = sum(leaves[i].numel() for i in members)
            starts, acc = [size] * len(leaves), 0  # non-members point at the scratch slot
            for i in members:
                starts[i], acc = acc, acc + leaves[i].numel()
            member = torch.tensor([x.dtype == dtype for x in leaves], device=device)
            start = torch.tensor(starts, dtype=torch.int64, device=device)
            local = torch.where(member[leaf_ids], start[leaf_ids] + positions, size)
            groups.append((dtype, members, local, 1))
    out: list[torch.Tensor] = list(leaves)
    for dtype, members, local, scratch in groups:
        size = sum(leaves[i].numel() for i in members)
        src = vals.to(dtype)
        if base:
            parts = [leaves[i].reshape(-1) for i in members]
            if scratch:
                parts.append(torch.zeros(scratch, dtype=dtype, device=device))
            flat = torch.cat(parts).index_add_(0, local, src)
        else:
            flat = torch.zeros(size + scratch, dtype=dtype, device=device).index_copy_(0, local, src)
        for i, piece in zip(members, torch.split(flat[:size], [leaves[i].numel() for i in members])):
            out[i] = piece.view(leaves[i].shape)
    return out


def _scatter_per_leaf(
    leaves: list[torch.Tensor], idx: torch.Tensor, vals: torch.Tensor, *, base: bool
) -> list[torch.Tensor]:
    """Eager CPU version of :func:`_scatter`: one buffer per leaf, indices split on the host.

    A fresh n-sized CPU buffer costs a page fault per 4 KiB on first touch
    (several times the work of filling it), while per-leaf buffers are reused
    by the allocator from step to step. Reads how many indices fall in each
    leaf (one small host read). With ``base=True``, a leaf that no index falls
    in is returned as it is, not copied.
    """
    offsets = [0]
    for x in leaves:
        offsets.append(offsets[-1] + x.numel())
    bounds = torch.searchsorted(idx, torch.tensor(offsets, dtype=idx.dtype, device=idx.device)).tolist()
    if bounds[0] != 0 or bounds[-1] != idx.numel():
        raise ValueError(f"sparse.indices must lie in [0, {offsets[-1]}) (the coordinates of the tree)")
    out = []
    for x, off, lo, hi in zip(leaves, offsets, bounds, bounds[1:]):
        if base and hi == lo:
            out.append(x)
            continue
        if base:
            y = x.clone(memory_format=torch.contiguous_format)
        else:
            y = torch.zeros(x.shape, dtype=x.dtype, device=x.device)
        if hi > lo:
            pos, src = idx[lo:hi] - off, vals[lo:hi].to(x.dtype)
            y = y.view(-1).index_add_(0, pos, src) if base else y.view(-1).index_copy_(0, pos, src)
            y = y.view(x.shape)
        out.append(y)
    return out


def _check_scale(scale: Any) -> float | torch.Tensor:
    from functopk._checks import check_hyperparam

    return check_hyperparam(scale, "scale")


def apply_sparse_updates(params: Params, sparse: SparseUpdates, scale: float | torch.Tensor = 1.0) -> Params:
    """Return ``params + scale * sparse`` as a new tree (pure; inputs are not changed).

    The sparse twin of :func:`apply_updates`: for SGD on top-k gradients,
    ``apply_sparse_updates(params, ft.topk_indices(grads, k), -lr)``. Cost: a
    copy of each parameter that receives an update (purity needs new tensors;
    parameters that receive none are returned as they are) plus ``O(k)`` for the
    ``index_add_``. In eager mode on CPU it splits the indices by leaf on the host
    (one small read); compiled, or on other devices, it uses static shapes and no
    host sync instead (a ``torch.cat`` per leaf dtype into one flat buffer, one
    ``index_add_``, views cut back out) and compiles with ``fullgraph=True``.
    Values are multiplied by ``scale`` in their own dtype, then cast to each
    parameter's dtype, so a float32 tree gets exactly the bits of the dense
    ``apply_updates(params, scaled dense update)``.

    Args:
        params: A tree with the leaves of the tree ``sparse`` was selected from.
        sparse: The sparse update (ascending distinct indices).
        scale: A number or a 0-d float tensor multiplying the values (``-lr`` for SGD).

    Example:
        >>> import torch, functopk as ft
        >>> params = {"w": torch.ones(3), "b": torch.zeros(1)}
        >>> grads = {"w": torch.tensor([0.1, -2.0, 0.3]), "b": torch.tensor([1.0])}
        >>> ft.apply_sparse_updates(params, ft.topk_indices(grads, 2), -0.5)
        {'w': tensor([1., 2., 1.]), 'b': tensor([-0.5000])}
    """
    scale = _check_scale(scale)
    leaves, treedef = optree.tree_flatten(params)
    _check_sparse(sparse, leaves, "params")
    vals = sparse.values if isinstance(scale, float) and scale == 1.0 else sparse.values * scale
    if vals.dtype != sparse.values.dtype:  # a 0-d tensor scale of a wider dtype must not widen the values
        vals = vals.to(sparse.values.dtype)
    return optree.tree_unflatten(treedef, _scatter(leaves, sparse.indices, vals, base=True))


def apply_sparse_updates_(params: Params, sparse: SparseUpdates, scale: float | torch.Tensor = 1.0) -> Params:
    """In place: add ``scale * sparse`` into the tensors of ``params`` and return ``params``.

    The eager fast path: ``O(k)`` work and no new parameter tensors, one
    ``index_add_`` into a flat view of each leaf that has selected coordinates.
    **Mutates** ``params`` (under ``torch.no_grad``, so ``nn.Parameter`` leaves
    are fine). It reads how many indices fall in each leaf on the host (one
    small transfer; free on CPU), checks the indices (ascending, in range)
    before writing anything, and is eager-only. Non-contiguous leaves are
    updated through a temporary copy.

    Args:
        params: A tree with the leaves of the tree ``sparse`` was selected from.
        sparse: The sparse update.
        scale: A number or a 0-d float tensor multiplying the values (``-lr`` for SGD).

    Example:
        >>> import torch, functopk as ft
        >>> params = {"w": torch.ones(3)}
        >>> _ = ft.apply_sparse_updates_(params, ft.topk_indices({"w": torch.tensor([0.0, 4.0, 1.0])}, 1), -0.5)
        >>> params["w"]
        tensor([ 1., -1.,  1.])
    """
    scale = _check_scale(scale)
    leaves = optree.tree_leaves(params)
    _check_sparse(sparse, leaves, "params")
    idx = sparse.indices
    if idx.numel() > 1 and not bool((idx[1:] > idx[:-1]).all()):
        raise ValueError("sparse.indices must be strictly ascending (as functopk produces them)")
    offsets = [0]
    for x in leaves:
        offsets.append(offsets[-1] + x.numel())
    bounds = torch.searchsorted(idx, torch.tensor(offsets, dtype=torch.int64, device=idx.device)).tolist()
    if bounds[0] != 0 or bounds[-1] != idx.numel():
        raise ValueError(f"sparse.indices must lie in [0, {sparse.numel}) (the coordinates of params)")
    vals = sparse.values if isinstance(scale, float) and scale == 1.0 else sparse.values * scale
    with torch.no_grad():
        for leaf, off, lo, hi in zip(leaves, offsets, bounds[:-1], bounds[1:]):
            if hi == lo:
                continue
            src = vals[lo:hi].to(leaf.dtype)
            if leaf.is_contiguous():
                leaf.view(-1).index_add_(0, idx[lo:hi] - off, src)
            else:
                flat = leaf.reshape(-1).index_add(0, idx[lo:hi] - off, src)
                leaf.copy_(flat.view(leaf.shape))
    return params
