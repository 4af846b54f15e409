"""Global top-k gradient sparsification.

:func:`topk_sparsify` keeps the ``k`` coordinates of largest absolute value
across *all* leaves of a tree (not per leaf) and zeros the rest;
:func:`topk_mask` returns the selection as a boolean tree, :func:`topk_indices`
as a :class:`~functopk.SparseUpdates` (flat indices and values), and
:func:`topk` is the same operation as a :class:`~functopk.GradientTransformation`.

Selection rules (shared by the exact methods ``"exact"`` and ``"torch"``):

* Magnitudes are compared in the promoted dtype of all leaves. Converting a
  narrower float (fp16, bf16) to a wider one is exact, so leaves of mixed float
  dtypes are ranked correctly; kept values are copied from the input unchanged,
  bit for bit, in the leaf's own dtype.
* Ties: among equal magnitudes, the lower flat index wins (flat order is that of
  ``optree.tree_leaves``; see :mod:`functopk.tree`). Exactly ``k`` coordinates
  are kept, always.
* NaN: a NaN coordinate ranks as an infinite magnitude (equal to ``±inf``, ties
  again by flat index), so it is selected and the NaN reaches the update where
  it can be seen; it is never silently dropped in favour of finite values.
* ``None`` nodes (frozen parameters) stay ``None``; leaves must be float16,
  bfloat16, float32 or float64 tensors (others raise ``TypeError``) on one
  device (else ``ValueError``).

Methods (``method=``; see ``docs/topk.md`` for measurements and the compile table):

* ``"exact"`` (default): the exact top-k, fastest. In eager mode on CPU it
  brackets the k-th magnitude with a sample, scans the leaves once for
  candidates without concatenating them, and selects exactly among the
  candidates (with a fallback that keeps it exact for any input); it reads sizes
  on the host and has data-dependent shapes. Under ``torch.compile``, on other
  devices, or when a leaf requires grad, it runs the ``"torch"`` kernel instead,
  which gives the identical result with static shapes.
* ``"torch"``: ``torch.topk`` over the concatenated magnitudes (a radix select
  for a tensor ``k``): static shapes, no host sync, compiles with ``fullgraph=True``.
* ``"approx"``: keeps the coordinates above a threshold estimated from a
  systematic sample (:func:`functopk.sparse.select.sample_threshold`): about ``k`` of
  them (see ``docs/topk.md`` for the band), static shapes, cheapest.
* ``"gaussian"``: the same with the Gaussian threshold of Shi et al. (2019)
  (:func:`gaussian_threshold`); accurate only for near-Gaussian gradients.

Approximate methods rank NaN like the exact ones (always kept) and never keep
exact zeros unless the threshold is negative (``k`` equal to the tree size).
"""

from __future__ import annotations

import math
import numbers
from typing import Any, NamedTuple, Union

import optree
import torch

from functopk._checks import path_str as _path_str
from functopk.sparse import select
from functopk.sparse.updates import SparseUpdates
from functopk.tree.maths import PyTree

__all__ = [
    "gaussian_threshold",
    "resolve_k",
    "k_from_density",
    "topk_indices",
    "topk_mask",
    "topk_sparsify",
]

METHODS = ("exact", "torch", "approx", "gaussian")

KLike = Union[int, torch.Tensor]
"""A count: a Python int, or a 0-d tensor (integer, or float rounded to the nearest integer)."""


# --------------------------------------------------------------------------- argument checks


def _check_k(k: Any, numel: int) -> KLike:
    """An int ``k`` checked against ``numel``, or a 0-d tensor ``k`` as int64 clamped to ``[1, numel]``."""
    if isinstance(k, torch.Tensor):
        if k.dim() != 0 or k.dtype == torch.bool or k.is_complex():
            raise TypeError(f"k must be an int or a 0-d real tensor, got a tensor of shape {tuple(k.shape)} "
                            f"and dtype {k.dtype}")
        if numel < 1:
            raise ValueError("k exceeds the number of coordinates in the tree (0)")
        if k.is_floating_point():
            k = torch.round(k)
        return k.to(torch.int64).clamp(1, numel)
    if isinstance(k, bool) or not isinstance(k, numbers.Integral):
        raise TypeError(f"k must be an int or a 0-d tensor, got {type(k).__name__} {k!r}")
    k = int(k)
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if k > numel:
        raise ValueError(f"k={k} exceeds the number of coordinates in the tree ({numel})")
    return k


def _check_density(density: Any) -> float | torch.Tensor:
    if isinstance(density, torch.Tensor):
        if density.dim() != 0 or not density.is_floating_point():
            raise TypeError(f"density must be a float in (0, 1] or a 0-d float tensor, got a tensor of shape "
                            f"{tuple(density.shape)} and dtype {density.dtype}")
        return density
    if isinstance(density, bool) or not isinstance(density, numbers.Real):
        raise TypeError(f"density must be a float in (0, 1], got {type(density).__name__} {density!r}")
    density = float(density)
    if not 0.0 < density <= 1.0:
        raise ValueError(f"density must be in (0, 1], got {density}")
    return density


def _check_method(method: Any) -> str:
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    return method


def k_from_density(density: float | torch.Tensor, numel: int) -> KLike:
    """The number of coordinates kept at ``density``: ``round(density * numel)``, at least 1.

    A 0-d tensor ``density`` gives a 0-d int64 tensor (clamped to ``[1, numel]``,
    no host sync).

    Example:
        >>> import functopk as ft
        >>> ft.sparse.k_from_density(0.01, 25_557_032)
        255570
        >>> ft.sparse.k_from_density(1e-9, 1000)
        1
    """
    density = _check_density(density)
    if numel < 1:
        raise ValueError(f"numel must be >= 1, got {numel}")
    if isinstance(density, torch.Tensor):
        return torch.floor(density.to(torch.float64) * numel + 0.5).to(torch.int64).clamp(1, numel)
    return min(numel, max(1, math.floor(density * numel + 0.5)))


def resolve_k(k: Any, density: Any, numel: int, *, name: str = "updates") -> KLike:
    """The count to keep from exactly one of ``k`` and ``density`` (already type-checked), for a tree of ``numel``.

    An int ``k`` must be at most ``numel``; a tensor ``k`` is clamped to
    ``[1, numel]`` on device; a density becomes :func:`k_from_density`. A tree
    with no coordinates (for example all-``None`` gradients) is a ``ValueError``
    that says so.
    """
    if numel < 1:
        raise ValueError(
            f"{name} has no coordinates: every leaf is empty or None (were all gradients None? "
            "check that the loss depends on the parameters and that they require grad)"
        )
    if k is None:
        return k_from_density(density, numel)
    if isinstance(k, torch.Tensor):
        return _check_k(k, numel)
    if k > numel:
        raise ValueError(f"k={k} exceeds the number of coordinates in {name} ({numel})")
    return k


def _float_leaves(tree: PyTree, name: str) -> tuple[list[torch.Tensor], optree.PyTreeSpec]:
    """Flatten ``tree``, checking that leaves are supported float tensors on one device."""
    leaves, treedef = optree.tree_flatten(tree)
    device = None
    for path, leaf in zip(treedef.paths(), leaves):
        if not isinstance(leaf, torch.Tensor):
            raise TypeError(f"{name} leaf at {_path_str(path)} is a {type(leaf).__name__}; expected a torch.Tensor")
        if leaf.dtype not in select.SUPPORTED_DTYPES:
            raise TypeError(
                f"{name} leaf at {_path_str(path)} has dtype {leaf.dtype}; top-k needs float16, bfloat16, "
                "float32 or float64 leaves (integer, bool and complex tensors are not gradients)"
            )
        if device is None:
            device = leaf.device
        elif leaf.device != device:
            raise ValueError(
                f"{name} leaves are on several devices ({device} and {leaf.device} at {_path_str(path)}); "
                "global top-k needs all leaves on one device"
            )
    return leaves, treedef


# --------------------------------------------------------------------------- selection


class _Selection(NamedTuple):
    """What a kernel produced: exactly one of a flat mask, (indices, values), or a threshold."""

    mask: torch.Tensor | None = None
    indices: torch.Tensor | None = None
    values: torch.Tensor | None = None
    threshold: torch.Tensor | None = None


def _eager_cpu(leaves: list[torch.Tensor]) -> bool:
    """Whether the eager CPU kernels apply: not compiling, on CPU, no leaf requiring grad.

    They read sizes and thresholds on the host; elsewhere the static kernels
    give the same result (exact methods) or the same kind of result (approximate).
    """
    if torch.compiler.is_compiling() or leaves[0].device.type != "cpu":
        return False
    return not (torch.is_grad_enabled() and any(x.requires_grad for x in leaves))


def _select(leaves: list[torch.Tensor], k: KLike, method: str) -> _Selection:
    dtype = select.common_dtype(leaves)
    numel = sum(x.numel() for x in leaves)
    if method == "exact" and _eager_cpu(leaves):
        flats = [x.detach().reshape(-1) for x in leaves]
        kk = int(k) if isinstance(k, torch.Tensor) else k  # host read: this kernel is eager-only anyway
        idx, vals = select.select_exact(flats, kk, dtype)
        return _Selection(indices=idx, values=vals)
    flats = [x.reshape(-1) for x in leaves]
    if method in ("exact", "torch"):
        return _Selection(mask=select.mask_static(select.flat_magnitudes([f.detach() for f in flats], dtype), k))
    if method == "approx":
        return _Selection(threshold=select.sample_threshold([f.detach() for f in flats], k, dtype))
    density = k / numel
    return _Selection(threshold=select.gaussian_threshold_flat([f.detach() for f in flats], density, dtype))


def _leaf_limits(leaves: list[torch.Tensor], t: torch.Tensor) -> list[float]:
    """The threshold ``t`` (common dtype) rounded down into each leaf's dtype (host read).

    Comparing a leaf with its limit in its own dtype is then exactly comparing
    it with ``t`` in the common dtype (see :func:`functopk.sparse.select._round_down`).
    """
    value, limits = t.item(), {}
    for x in leaves:
        if x.dtype not in limits:
            limits[x.dtype] = select._round_down(value, x.dtype, t.dtype)
    return [limits[x.dtype] for x in leaves]


def _above_static(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """``|x| > t`` or NaN, compared in ``t``'s (common) dtype: static shapes, no host read."""
    return ~((x if x.dtype == t.dtype else x.to(t.dtype)).abs() <= t)


def _split_mask(mask: torch.Tensor, leaves: list[torch.Tensor]) -> list[torch.Tensor]:
    pieces = torch.split(mask, [x.numel() for x in leaves])
    return [p.view(x.shape) for p, x in zip(pieces, leaves)]


def _leaf_bounds(idx: torch.Tensor, leaves: list[torch.Tensor]) -> list[tuple[int, int, int]]:
    """(offset, lo, hi) per leaf: the slice of the sorted ``idx`` falling in each leaf (host read)."""
    offsets = [0]
    for x in leaves:
        offsets.append(offsets[-1] + x.numel())
    bounds = torch.searchsorted(idx, torch.tensor(offsets, dtype=torch.int64, device=idx.device)).tolist()
    return list(zip(offsets[:-1], bounds[:-1], bounds[1:]))


def _dense_leaves(leaves: list[torch.Tensor], sel: _Selection) -> list[torch.Tensor]:
    """The sparsified leaves (kept values bit-exact, zeros elsewhere)."""
    if sel.mask is not None:
        return [torch.where(m, x, 0.0) for m, x in zip(_split_mask(sel.mask, leaves), leaves)]
    if sel.threshold is not None:
        if _eager_cpu(leaves):  # one vectorised op per leaf: keeps |x| > t and NaN, zeros the rest
            return [torch.nn.functional.hardshrink(x, t) for x, t in zip(leaves, _leaf_limits(leaves, sel.threshold))]
        return [torch.where(_above_static(x.detach(), sel.threshold), x, 0.0) for x in leaves]
    one_dtype = all(x.dtype == sel.values.dtype for x in leaves)
    out = []
    for x, (off, lo, hi) in zip(leaves, _leaf_bounds(sel.indices, leaves)):
        z = torch.zeros(x.shape, dtype=x.dtype, device=x.device)
        if hi > lo:
            pos = sel.indices[lo:hi] - off
            src = sel.values[lo:hi] if one_dtype else x.detach().reshape(-1)[pos]  # mixed: the leaf's own bits
            z.view(-1).index_copy_(0, pos, src)
        out.append(z)
    return out


def _mask_leaves(leaves: list[torch.Tensor], sel: _Selection) -> list[torch.Tensor]:
    if sel.mask is not None:
        return _split_mask(sel.mask, leaves)
    if sel.threshold is not None:
        if _eager_cpu(leaves):
            return [~(x.detach().abs() <= t) for x, t in zip(leaves, _leaf_limits(leaves, sel.threshold))]
        return [_above_static(x.detach(), sel.threshold) for x in leaves]
    out = []
    for x, (off, lo, hi) in zip(leaves, _leaf_bounds(sel.indices, leaves)):
        z = torch.zeros(x.shape, dtype=torch.bool, device=x.device)
        if hi > lo:
            z.view(-1).index_fill_(0, sel.indices[lo:hi] - off, True)
        out.append(z)
    return out


def _sparse(leaves: list[torch.Tensor], sel: _Selection, k: KLike) -> SparseUpdates:
    numel = sum(x.numel() for x in leaves)
    if sel.indices is not None:
        return SparseUpdates(sel.indices, sel.values, numel)
    dtype = select.common_dtype(leaves)
    if sel.threshold is not None and _eager_cpu(leaves) and float(sel.threshold) >= 0:
        # the exact kernel's scan gathers the coordinates above a threshold without a dense copy
        flats = [x.detach().reshape(-1) for x in leaves]
        fraction = k / numel if isinstance(k, int) else 0.01
        idx, vals = select.scan_above(flats, float(sel.threshold), dtype, fraction)
        return SparseUpdates(idx, vals, numel)
    flat = torch.cat([x.reshape(-1).to(dtype) for x in leaves])
    if sel.mask is not None:
        mask = sel.mask
        # Exactly k entries are set: with an int k the output size is static.
        idx = torch.nonzero_static(mask, size=k).view(-1) if isinstance(k, int) else mask.nonzero().view(-1)
    else:
        idx = _above_static(flat, sel.threshold).nonzero().view(-1)
    return SparseUpdates(idx, flat[idx], numel)


def _prepare(tree: PyTree, k: Any, method: Any) -> tuple[list[torch.Tensor], optree.PyTreeSpec, KLike, str]:
    leaves, treedef = _float_leaves(tree, "tree")
    numel = sum(x.numel() for x in leaves)
    k = _check_k(k, numel)
    return leaves, treedef, k, _check_method(method)


def topk_sparsify(tree: PyTree, k: KLike, *, method: str = "exact") -> PyTree:
    """Keep the ``k`` coordinates of largest absolute value across the whole tree; zero the rest.

    Pure: returns a new tree with the input's structure, shapes, dtypes and
    devices; kept values are bit-exact copies of the input. See the module
    docstring for the tie, dtype and NaN rules and the methods.

    Args:
        tree: A pytree of floating-point tensors on one device (``None`` nodes allowed).
        k: How many coordinates to keep, ``1 <= k <= total number of coordinates``;
            or a 0-d tensor (clamped to that range, not checked on the host).
        method: ``"exact"`` (default), ``"torch"``, ``"approx"`` or ``"gaussian"``.

    Returns:
        The sparsified tree.

    Raises:
        TypeError: ``k`` is not an int or 0-d tensor, or a leaf is not a supported float tensor.
        ValueError: ``k`` is out of range, leaves are on several devices, or
            ``method`` is unknown.

    Example:
        >>> import torch, functopk as ft
        >>> grads = {"conv": torch.tensor([[0.5, -2.0], [0.1, 3.0]]), "bias": torch.tensor([-1.0])}
        >>> ft.topk_sparsify(grads, 2)
        {'conv': tensor([[ 0., -2.],
                [ 0.,  3.]]), 'bias': tensor([0.])}
    """
    leaves, treedef, k, method = _prepare(tree, k, method)
    return optree.tree_unflatten(treedef, _dense_leaves(leaves, _select(leaves, k, method)))


def topk_mask(tree: PyTree, k: KLike, *, method: str = "exact") -> PyTree:
    """Boolean tree marking the ``k`` coordinates of largest ``|value|`` across all leaves.

    Same rules and methods as :func:`topk_sparsify`; with an exact method exactly
    ``k`` entries are True.

    Example:
        >>> import torch, functopk as ft
        >>> ft.topk_mask({"a": torch.tensor([3.0, -1.0]), "b": torch.tensor([-5.0])}, 2)
        {'a': tensor([ True, False]), 'b': tensor([True])}
    """
    leaves, treedef, k, method = _prepare(tree, k, method)
    return optree.tree_unflatten(treedef, _mask_leaves(leaves, _select(leaves, k, method)))


def topk_indices(tree: PyTree, k: KLike, *, method: str = "exact") -> SparseUpdates:
    """The top ``k`` coordinates as a :class:`~functopk.SparseUpdates`: ascending flat indices and values.

    The sparse twin of :func:`topk_sparsify` (same rules and methods): ``O(k)``
    output instead of a dense tree. Apply it with
    :func:`~functopk.apply_sparse_updates` or densify it with
    :meth:`~functopk.SparseUpdates.to_dense`. With ``method="torch"`` and an int
    ``k`` the output has static shape ``(k,)`` (``torch.nonzero_static``) and
    compiles with ``fullgraph=True``; the approximate methods return a
    data-dependent number of coordinates.

    Example:
        >>> import torch, functopk as ft
        >>> ft.topk_indices({"w": torch.tensor([[1.0, -4.0], [0.5, 2.0]])}, 2)
        SparseUpdates(indices=tensor([1, 3]), values=tensor([-4.,  2.]), numel=4)
    """
    leaves, _, k, method = _prepare(tree, k, method)
    return _sparse(leaves, _select(leaves, k, method), k)


def gaussian_threshold(
    tree: PyTree, k: KLike | None = None, *, density: float | torch.Tensor | None = None
) -> torch.Tensor:
    """The Gaussian estimate of the k-th largest magnitude of a tree (Gaussian_k, Shi et al. 2019).

    Models every coordinate as drawn from one zero-mean Gaussian whose standard
    deviation is the root mean square of all coordinates, and returns the
    magnitude ``t`` with ``P(|x| > t) = density``:
    ``t = rms * Phi^-1(1 - density / 2)``. One read pass (``torch._foreach_norm``),
    no host sync, static shapes. ``|x| > t`` then keeps about ``k`` coordinates
    *if* the gradient is close to Gaussian; real gradients mix layers of very
    different scales and have heavier tails, so the count can be off by a large
    factor (``docs/topk.md`` measures it). Shi et al. refine the estimate with a
    few counting passes; ``method="approx"`` uses a sample instead, which is
    distribution-free. A NaN or infinite coordinate makes the estimate NaN or
    infinite.

    Args:
        tree: A pytree of floating-point tensors on one device.
        k: The target count (give exactly one of ``k`` and ``density``).
        density: The target fraction of coordinates, in ``(0, 1]``.

    Returns:
        A 0-d tensor in the tree's common dtype.

    Example:
        >>> import torch, functopk as ft
        >>> g = {"w": torch.randn(100_000, generator=torch.Generator().manual_seed(0))}
        >>> t = ft.sparse.gaussian_threshold(g, density=0.01)
        >>> round(float(t), 2), int((g["w"].abs() > t).sum())
        (2.58, 1022)
    """
    leaves, _ = _float_leaves(tree, "tree")
    numel = sum(x.numel() for x in leaves)
    if numel == 0:
        raise ValueError("tree has no coordinates")
    if (k is None) == (density is None):
        raise ValueError("give exactly one of k or density")
    if k is not None:
        k = _check_k(k, numel)
        density = k / numel
    else:
        density = _check_density(density)
    flats = [x.detach().reshape(-1) for x in leaves]
    return select.gaussian_threshold_flat(flats, density, select.common_dtype(leaves))
