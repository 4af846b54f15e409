"""Sparse updates: :class:`SparseUpdates` (ascending flat indices and values) and how to apply them.

All three consumers (:func:`apply_sparse_updates`, :func:`apply_sparse_updates_`,
:meth:`SparseUpdates.to_dense`) check the same contract before writing
anything: the tree has the leaf sizes the update was selected from, and the
indices are 1-d int64, strictly ascending (so distinct) and in range. The last two
read a few values on the host: skipped while compiled or captured (no host syncs).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import optree
import torch

from functopk._checks import check_hyperparam, check_int, check_leaves, describe, path_str
from functopk._overlap import check_writable
from functopk.base import Params
from functopk.sparse.config import KernelConfig, config_or_default
from functopk.sparse.kernels import triton_scatter, triton_select
from functopk.sparse.kernels.triton_layout import capturing
from functopk.tree.layout import FlatLayout, offsets_of
from functopk.tree.maths import PyTree

__all__ = [
    "SparseUpdates",
    "apply_sparse_updates",
    "apply_sparse_updates_",
    "check_ascending_indices",
    "check_update_of",
    "shift_indices",
    "zeros_with",
]

ZEROS_CHUNK_BYTES = 1 << 20
"""A piece size for :func:`zeros_with`'s ``chunk_bytes``: about a core's L2 cache.

Zeroing a densely hit leaf piece by piece and writing each piece's values at
once keeps the writes in cache; measured on ResNet-50's gradient tree at 1% of
its coordinates, the extra calls cost more than the cache saves (whole leaves
were 15-17% faster, ``docs/topk.md``), so :func:`zeros_with` writes whole
leaves unless given a ``chunk_bytes``. Changes the speed, never the result.
"""

ZEROS_MIN_PER_CHUNK = 256
"""A leaf is written piece by piece only when it has this many indices per piece on average.

Below that, one cache miss per index costs less than handling one more piece.
"""


class _Fields(NamedTuple):
    indices: torch.Tensor
    values: torch.Tensor
    numel: int
    sizes: tuple[int, ...] | None = None


def _check_counts(numel: Any, sizes: Any) -> None:
    """``numel`` an int ``>= 0``; ``sizes`` ``None`` or ints ``>= 0`` adding up to it (a traced ``SymInt`` passes)."""
    if isinstance(numel, torch.SymInt):
        return
    check_int(numel, "numel", minimum=0)
    if sizes is None:
        return
    if not isinstance(sizes, (tuple, list)) or not all(isinstance(x, int) and not isinstance(x, bool) for x in sizes):
        raise TypeError(f"sizes must be None or a tuple of ints (one per leaf), got {describe(sizes)}")
    if any(x < 0 for x in sizes) or sum(sizes) != numel:
        raise ValueError(f"sizes must be counts >= 0 adding up to numel={numel}, got {tuple(sizes)}")


class SparseUpdates(_Fields):
    """A sparse update of a tree: which flat coordinates change, and by how much.

    Produced by :func:`functopk.topk_indices`; consumed by
    :func:`apply_sparse_updates`, :func:`apply_sparse_updates_` and
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
        sizes: The number of coordinates of each leaf of that tree, in flat
            order (``None``: unknown, only ``numel`` is checked). Checked too, so
            an update is never applied to a tree whose leaves split the flat
            indices differently. Not shown in the ``repr``.

    Example:
        >>> import torch, functopk as ft
        >>> sparse = ft.topk_indices({"a": torch.tensor([0.5, -3.0]), "b": torch.tensor([2.0])}, 2)
        >>> sparse
        SparseUpdates(indices=tensor([1, 2]), values=tensor([-3.,  2.]), numel=3)
        >>> sparse.sizes
        (2, 1)
        >>> sparse.to_dense({"a": torch.zeros(2), "b": torch.zeros(1)})
        {'a': tensor([ 0., -3.]), 'b': tensor([2.])}

    Raises:
        TypeError: ``numel`` is not an int, or ``sizes`` is neither ``None`` nor ints.
        ValueError: ``numel`` is negative, or ``sizes`` has a negative count or does not add up to ``numel``.
        (The tensors are checked where the update is used: their values need a host read.)
    """

    __slots__ = ()

    def __new__(
        cls, indices: torch.Tensor, values: torch.Tensor, numel: int, sizes: tuple[int, ...] | None = None
    ) -> SparseUpdates:
        _check_counts(numel, sizes)
        return super().__new__(cls, indices, values, numel, sizes)

    def __repr__(self) -> str:
        return f"SparseUpdates(indices={self.indices!r}, values={self.values!r}, numel={self.numel})"

    def to_dense(self, like: PyTree) -> PyTree:
        """The dense tree with ``like``'s structure, shapes, dtypes and device: zeros except at ``indices``.

        Values are cast to each leaf's dtype (exact when they came from that leaf).
        Checks the contract first (see the module docstring). Compiled, or off CPU:
        static shapes, no host sync. In eager mode on CPU the indices are split by
        leaf on the host (see :func:`apply_sparse_updates`).

        Example:
            >>> import torch, functopk as ft
            >>> ft.SparseUpdates(torch.tensor([2]), torch.tensor([5.0]), 3).to_dense({"w": torch.ones(3)})
            {'w': tensor([0., 0., 5.])}
        """
        leaves, treedef = check_update_of(self, like, "like")
        return optree.tree_unflatten(treedef, _scatter(leaves, self.indices, self.values, base=False))


def _check_sizes(sizes: tuple[int, ...], leaves: list[torch.Tensor], treedef: optree.PyTreeSpec, name: str) -> None:
    """``ValueError`` naming the first leaf whose size differs from the one the update was selected from."""
    if len(sizes) != len(leaves):
        raise ValueError(
            f"sparse update was selected from a tree of {len(sizes)} leaves, but {name} has {len(leaves)}; the tree "
            "must have the leaves (structure, shapes, None positions) of the tree the update was selected from"
        )
    for path, leaf, size in zip(treedef.paths(), leaves, sizes):
        if leaf.numel() != size:
            raise ValueError(
                f"{name} leaf at {path_str(path)} has {leaf.numel()} coordinates, but the tree the sparse update "
                f"was selected from has {size} there; the flat indices would land in the wrong leaves"
            )


def check_ascending_indices(idx: torch.Tensor, numel: int, name: str = "sparse.indices") -> None:
    """Strictly ascending (so distinct) and in ``[0, numel)``: a few values read on the host; skipped when compiling
    and while a CUDA graph is captured."""
    if torch.compiler.is_compiling() or idx.numel() == 0 or capturing(idx.device):  # (no host reads there)
        return
    ascending, lowest, highest = torch.stack([(idx[1:] > idx[:-1]).all().long(), idx[0], idx[-1]]).tolist()
    if not ascending:
        raise ValueError(f"{name} must be strictly ascending, so distinct (as functopk produces them)")
    if lowest < 0 or highest >= numel:
        raise ValueError(f"{name} must lie in [0, {numel}) (the coordinates of the tree)")


def check_update_of(sparse: Any, tree: PyTree, name: str) -> tuple[list[torch.Tensor], optree.PyTreeSpec]:
    """The leaves of ``tree`` after checking the whole contract between ``sparse`` and it (nothing written yet)."""
    if not isinstance(sparse, SparseUpdates):
        raise TypeError(f"sparse must be a functopk.SparseUpdates, got {type(sparse).__name__}")
    leaves, treedef = check_leaves(tree, name, floating=True)
    numel = sum(x.numel() for x in leaves)
    if numel != sparse.numel:
        raise ValueError(
            f"sparse update covers {sparse.numel} coordinates, but {name} has {numel}; the tree must have the "
            "leaves (structure, shapes, None positions) of the tree the update was selected from"
        )
    if sparse.sizes is not None:
        _check_sizes(tuple(sparse.sizes), leaves, treedef, name)
    if sparse.indices.dim() != 1 or sparse.values.dim() != 1 or sparse.indices.shape != sparse.values.shape:
        raise ValueError(
            f"sparse.indices and sparse.values must be 1-d of one length, got shapes "
            f"{tuple(sparse.indices.shape)} and {tuple(sparse.values.shape)}"
        )
    if sparse.indices.dtype != torch.int64:
        raise TypeError(f"sparse.indices must be int64, got {sparse.indices.dtype}")
    for field in ("indices", "values"):
        device = getattr(sparse, field).device
        if leaves and device != leaves[0].device:
            raise ValueError(
                f"sparse.{field} is on {device} but {name} is on {leaves[0].device}; move the update "
                f"(sparse._replace(indices=..., values=...)) to the tree's device"
            )
    check_ascending_indices(sparse.indices, numel)
    return leaves, treedef


def shift_indices(indices: torch.Tensor, sizes: list[int], present: list[bool], *, to_all: bool) -> torch.Tensor:
    """Flat indices over the leaves where ``present`` moved over all the leaves (``to_all``), or back.

    A selection from gradients with ``None`` leaves (``topk_indices`` skips
    them) counts only the leaves that are there; the same coordinates over the
    whole tree lie further on by the sizes of the missing leaves before them.
    Tensor ops: one ``searchsorted`` over the leaf starts, no host read.

    Example:
        >>> import torch
        >>> shift_indices(torch.tensor([0, 2]), [2, 3, 1], [True, False, True], to_all=True)
        tensor([0, 5])
    """
    starts_all, starts_present, at_all, at_present = [], [], 0, 0
    for size, here in zip(sizes, present):
        if here:
            starts_all.append(at_all)
            starts_present.append(at_present)
            at_present += size
        at_all += size
    if at_present == at_all or not indices.numel():
        return indices
    device = indices.device
    shifts = torch.tensor([a - p for a, p in zip(starts_all, starts_present)], device=device)
    starts = torch.tensor(starts_present if to_all else starts_all, device=device)
    leaf = torch.searchsorted(starts, indices, right=True) - 1
    return indices + shifts[leaf] if to_all else indices - shifts[leaf]


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
    in is returned as it is, not copied; with ``base=False`` see :func:`zeros_with`.
    """
    if not base:
        return zeros_with(leaves, idx, vals)
    out = []
    for x, (off, lo, hi) in zip(leaves, FlatLayout.from_tree(leaves).bounds(idx, name="sparse.indices")):
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


def _pieces(
    idx: torch.Tensor, numels: list[int], steps: list[int], min_per_chunk: int
) -> tuple[list[tuple[int, int, int]], list[int], list[int]]:
    """Cut each leaf into runs of ``steps[i]`` coordinates where many indices fall in it, else keep it whole.

    Returns ``(leaf, start, stop)`` per piece (empty leaves have none), how
    many indices fall in each piece and each piece's flat start: one
    ``searchsorted`` over the run starts and one small host read.
    """
    offsets = offsets_of(numels)
    runs = [(i, a, min(a + step, m)) for i, (m, step) in enumerate(zip(numels, steps)) for a in range(0, m, step)]
    starts = [offsets[i] + a for i, a, _ in runs]
    cuts = torch.searchsorted(idx, torch.tensor(starts + [offsets[-1]], device=idx.device)).tolist()
    if cuts[0] != 0 or cuts[-1] != idx.numel():
        raise ValueError(f"indices must lie in [0, {offsets[-1]}) (the coordinates of the tree)")
    pieces, counts, piece_starts, j = [], [], [], 0
    for i, (m, step) in enumerate(zip(numels, steps)):
        r = -(-m // step)  # runs in this leaf
        if r > 1 and (cuts[j + r] - cuts[j]) * step >= min_per_chunk * m:
            pieces += runs[j : j + r]
            counts += [cuts[q + 1] - cuts[q] for q in range(j, j + r)]
            piece_starts += starts[j : j + r]
        elif r:
            pieces.append((i, 0, m))
            counts.append(cuts[j + r] - cuts[j])
            piece_starts.append(offsets[i])
        j += r
    return pieces, counts, piece_starts


def zeros_with(
    leaves: list[torch.Tensor],
    idx: torch.Tensor,
    values: torch.Tensor | None = None,
    *,
    masks: bool = False,
    chunk_bytes: int | None = None,
    min_per_chunk: int = ZEROS_MIN_PER_CHUNK,
) -> list[torch.Tensor]:
    """New contiguous leaves shaped like ``leaves``: zeros, except at the ascending flat indices ``idx``.

    What goes there: ``values`` (one per index, cast to each leaf's dtype); with
    ``values=None`` the leaf's own value (bit for bit, whatever the dtypes);
    with ``masks=True`` the leaves are boolean and True there. The indices are
    split by leaf with one ``searchsorted`` and one small host read; each leaf
    is zeroed and written at once, or, given ``chunk_bytes`` (e.g.
    :data:`ZEROS_CHUNK_BYTES`), a leaf hit by many indices
    (:data:`ZEROS_MIN_PER_CHUNK` per piece on average) is zeroed and written
    ``chunk_bytes`` at a time. The tuning arguments change the speed, never
    the result.

    Raises:
        ValueError: An index lies outside the tree (``idx`` is checked only for range).

    Example:
        >>> import torch
        >>> from functopk.sparse.updates import zeros_with
        >>> leaves = [torch.tensor([1.0, 2.0, 3.0]), torch.tensor([[4.0, 5.0]])]
        >>> zeros_with(leaves, torch.tensor([0, 4]))
        [tensor([1., 0., 0.]), tensor([[0., 5.]])]
        >>> zeros_with(leaves, torch.tensor([1, 3]), masks=True)
        [tensor([False,  True, False]), tensor([[ True, False]])]
    """
    dtypes = [torch.bool if masks else x.dtype for x in leaves]
    if chunk_bytes is None:  # whole leaves
        steps = [max(1, x.numel()) for x in leaves]
    else:
        steps = [max(1, chunk_bytes // d.itemsize) for d in dtypes]
    pieces, counts, starts = _pieces(idx, [x.numel() for x in leaves], steps, min_per_chunk)
    sources = values.split(counts) if values is not None else [None] * len(pieces)
    out: list[torch.Tensor | None] = [None] * len(leaves)
    for (i, a, b), flat_pos, src, count, start in zip(pieces, idx.split(counts), sources, counts, starts):
        x = leaves[i]
        if b - a == x.numel():  # the whole leaf: no view needed, put_ takes flat indices
            piece = out[i] = torch.zeros(x.shape, dtype=dtypes[i], device=x.device)
        else:
            whole = out[i]
            if whole is None:
                whole = out[i] = torch.empty(x.shape, dtype=dtypes[i], device=x.device)
            piece = whole.view(-1)[a:b]
            piece.zero_()
        if not count:
            continue
        pos = flat_pos - start  # small and cache-hot, where one k-sized copy would be neither
        if masks:
            piece.view(-1).index_fill_(0, pos, True)
        elif src is None:
            piece.put_(pos, x.detach().take(pos if a == 0 else pos + a))
        else:
            piece.put_(pos, src.to(piece.dtype))
    return [torch.zeros(x.shape, dtype=d, device=x.device) if y is None else y for x, d, y in zip(leaves, dtypes, out)]


def _scaled(sparse: SparseUpdates, scale: Any) -> torch.Tensor:
    """``scale * sparse.values`` in the values' own dtype (a 0-d tensor scale of a wider dtype must not widen them)."""
    scale = check_hyperparam(scale, "scale")
    if isinstance(scale, float) and scale == 1.0:
        return sparse.values
    vals = sparse.values * scale
    return vals if vals.dtype == sparse.values.dtype else vals.to(sparse.values.dtype)


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
    ``apply_updates(params, scaled dense update)``. The contract (leaf sizes,
    strictly ascending in-range indices) is checked first, in eager mode
    reading a few values on the host; compiled, the index checks are skipped.

    Args:
        params: A tree with the leaves of the tree ``sparse`` was selected from (float leaves).
        sparse: The sparse update (strictly ascending indices).
        scale: A number or a 0-d float tensor multiplying the values (``-lr`` for SGD).

    Raises:
        TypeError: ``sparse`` is not a :class:`SparseUpdates`, its indices are not int64,
            a parameter is not a float tensor, or ``scale`` is not a number.
        ValueError: The leaves differ from those the update was selected from, or the
            indices are not strictly ascending or out of range.

    Example:
        >>> import torch, functopk as ft
        >>> params = {"w": torch.ones(3), "b": torch.zeros(1)}
        >>> grads = {"w": torch.tensor([0.1, -2.0, 0.3]), "b": torch.tensor([1.0])}
        >>> ft.apply_sparse_updates(params, ft.topk_indices(grads, 2), -0.5)
        {'w': tensor([1., 2., 1.]), 'b': tensor([-0.5000])}
    """
    vals = _scaled(sparse, scale) if isinstance(sparse, SparseUpdates) else None
    leaves, treedef = check_update_of(sparse, params, "params")
    return optree.tree_unflatten(treedef, _scatter(leaves, sparse.indices, vals, base=True))


def apply_sparse_updates_(
    params: Params, sparse: SparseUpdates, scale: float | torch.Tensor = 1.0, *, config: KernelConfig | None = None
) -> Params:
    """In place: add ``scale * sparse`` into the tensors of ``params`` and return ``params``.

    The eager fast path: ``O(k)`` work and no new parameter tensors, one
    ``index_add_`` into a flat view of each leaf that has selected coordinates.
    **Mutates** ``params`` (under ``torch.no_grad``, so ``nn.Parameter`` leaves
    are fine). It reads how many indices fall in each leaf on the host (one
    small transfer; free on CPU), checks the same contract as
    :func:`apply_sparse_updates` and that every leaf it writes can take an
    in-place add (not an inference tensor, no elements or leaves sharing
    memory, as :func:`functopk.apply_updates_`) before writing anything, and
    is eager-only. Non-contiguous leaves are updated through a temporary copy.
    On CUDA tensors one kernel adds the whole update instead, strided leaves
    where they lie, with no per-leaf host read (:mod:`~functopk.sparse.kernels.triton_scatter`;
    every leaf is checked, as which ones receive an index is not read): the same bits.

    Args:
        params: A tree with the leaves of the tree ``sparse`` was selected from.
        sparse: The sparse update.
        scale: A number or a 0-d float tensor multiplying the values (``-lr`` for SGD).
        config: ``KernelConfig(backend=...)``: ``"auto"`` (the one kernel on CUDA where Triton imports),
            ``"triton"`` (always: CUDA, or CPU under ``TRITON_INTERPRET=1``) or ``"aten"`` (never).

    Example:
        >>> import torch, functopk as ft
        >>> params = {"w": torch.ones(3)}
        >>> _ = ft.apply_sparse_updates_(params, ft.topk_indices({"w": torch.tensor([0.0, 4.0, 1.0])}, 1), -0.5)
        >>> params["w"]
        tensor([ 1., -1.,  1.])
    """
    vals = _scaled(sparse, scale) if isinstance(sparse, SparseUpdates) else None
    config = config_or_default(config)
    leaves, treedef = check_update_of(sparse, params, "params")
    idx = sparse.indices
    if leaves and triton_select.serves(leaves, sparse.numel, config.backend):
        check_writable(leaves, "params", lambda j: path_str(treedef.paths()[j]))
        with torch.no_grad():
            if triton_scatter.add_(leaves, idx, vals, config):
                return params
    bounds = FlatLayout.from_tree(leaves).bounds(idx, name="sparse.indices")
    touched = [i for i, (_, lo, hi) in enumerate(bounds) if hi > lo]
    # every leaf that will be written must take an in-place add: checked before the first write
    check_writable([leaves[i] for i in touched], "params", lambda j: path_str(treedef.paths()[touched[j]]))
    with torch.no_grad():
        for i in touched:
            leaf, (off, lo, hi) = leaves[i], bounds[i]
            src = vals[lo:hi].to(leaf.dtype)
            if leaf.is_contiguous():
                leaf.view(-1).index_add_(0, idx[lo:hi] - off, src)
            else:
                flat = leaf.reshape(-1).index_add(0, idx[lo:hi] - off, src)
                leaf.copy_(flat.view(leaf.shape))
    return params
