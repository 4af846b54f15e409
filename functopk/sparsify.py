"""Global top-k gradient sparsification.

:func:`topk_sparsify` keeps the ``k`` coordinates of largest absolute value
across *all* leaves of a tree (not per leaf) and zeros the rest; :func:`topk` is
the same operation as a :class:`~functopk.GradientTransformation`.

Selection rules (shared by every selection method):

* Magnitudes are compared in the promoted dtype of all leaves. Converting a
  narrower float (fp16, bf16) to a wider one is exact, so leaves of mixed float
  dtypes are ranked correctly; kept values are copied from the input unchanged,
  bit for bit, in the leaf's own dtype.
* Ties: among equal magnitudes, the lower flat index wins (flat order is that of
  ``optree.tree_leaves``; see :mod:`functopk.tree`). Exactly ``k`` coordinates
  are kept, always.
* NaN: a NaN coordinate ranks as an infinite magnitude (equal to ``±inf``, ties
  again by flat index), so it is selected and the NaN reaches the update where
  it can be seen (``functopk.apply_if_finite``-style guards can then act on it);
  it is never silently dropped in favour of finite values.
* ``None`` nodes (frozen parameters) stay ``None``; integer, bool and complex
  leaves are rejected with ``TypeError``; leaves on several devices with
  ``ValueError``.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import optree
import torch

from functopk.base import EmptyState, GradientTransformation, Params, Updates
from functopk.tree import PyTree, _path_str

__all__ = ["k_from_density", "topk", "topk_mask", "topk_sparsify"]

_METHODS = ("torch",)


def _check_k(k: Any, numel: int) -> int:
    if isinstance(k, bool) or not isinstance(k, numbers.Integral):
        raise TypeError(f"k must be an int, got {type(k).__name__} {k!r}")
    k = int(k)
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if k > numel:
        raise ValueError(f"k={k} exceeds the number of coordinates in the tree ({numel})")
    return k


def _check_density(density: Any) -> float:
    if isinstance(density, bool) or not isinstance(density, numbers.Real):
        raise TypeError(f"density must be a float in (0, 1], got {type(density).__name__} {density!r}")
    density = float(density)
    if not 0.0 < density <= 1.0:
        raise ValueError(f"density must be in (0, 1], got {density}")
    return density


def _check_method(method: Any) -> str:
    if method not in _METHODS:
        raise ValueError(f"method must be one of {_METHODS}, got {method!r}")
    return method


def k_from_density(density: float, numel: int) -> int:
    """The number of coordinates kept at ``density``: ``round(density * numel)``, at least 1.

    Example:
        >>> import functopk as ft
        >>> ft.k_from_density(0.01, 25_557_032)
        255570
        >>> ft.k_from_density(1e-9, 1000)
        1
    """
    density = _check_density(density)
    if numel < 1:
        raise ValueError(f"numel must be >= 1, got {numel}")
    return min(numel, max(1, math.floor(density * numel + 0.5)))


def _float_leaves(tree: PyTree, name: str) -> tuple[list[torch.Tensor], optree.PyTreeSpec]:
    """Flatten ``tree``, checking that leaves are floating tensors on one device."""
    leaves, treedef = optree.tree_flatten(tree)
    device = None
    for path, leaf in zip(treedef.paths(), leaves):
        if not isinstance(leaf, torch.Tensor):
            raise TypeError(f"{name} leaf at {_path_str(path)} is a {type(leaf).__name__}; expected a torch.Tensor")
        if not leaf.is_floating_point():
            raise TypeError(
                f"{name} leaf at {_path_str(path)} has dtype {leaf.dtype}; top-k needs floating-point leaves "
                "(integer, bool and complex tensors are not gradients)"
            )
        if device is None:
            device = leaf.device
        elif leaf.device != device:
            raise ValueError(
                f"{name} leaves are on several devices ({device} and {leaf.device} at {_path_str(path)}); "
                "global top-k needs all leaves on one device"
            )
    return leaves, treedef


def _common_dtype(leaves: list[torch.Tensor]) -> torch.dtype:
    dtype = leaves[0].dtype
    for leaf in leaves[1:]:
        dtype = torch.promote_types(dtype, leaf.dtype)
    return dtype


def _flat_magnitudes(leaves: list[torch.Tensor]) -> torch.Tensor:
    """|x| of every coordinate in flat order, in the common dtype, NaN mapped to +inf."""
    dtype = _common_dtype(leaves)
    mags = torch.cat([leaf.detach().reshape(-1).to(dtype) for leaf in leaves]).abs_()
    return torch.nan_to_num_(mags, nan=math.inf, posinf=math.inf)


def _select_torch(mags: torch.Tensor, k: int) -> torch.Tensor:
    """Boolean mask of the top ``k`` of ``mags`` (ties: lower index wins), via ``torch.topk``.

    Only static shapes and no host syncs: this compiles with ``fullgraph=True``.
    """
    threshold = torch.topk(mags, k, sorted=False).values.min()
    above = mags > threshold
    at = mags == threshold
    # Of the coordinates equal to the threshold, keep the first (k - #above) in flat order.
    room = k - above.sum()
    return above | (at & (torch.cumsum(at, 0) <= room))


def _flat_topk_mask(leaves: list[torch.Tensor], k: int, method: str) -> torch.Tensor:
    mags = _flat_magnitudes(leaves)
    del method  # one method today; the dispatch lives here
    return _select_torch(mags, k)


def topk_mask(tree: PyTree, k: int, *, method: str = "torch") -> PyTree:
    """Boolean tree marking the ``k`` coordinates of largest ``|value|`` across all leaves.

    Same rules as :func:`topk_sparsify` (ties, NaN, dtypes); exactly ``k`` entries are True.

    Example:
        >>> import torch, functopk as ft
        >>> ft.topk_mask({"a": torch.tensor([3.0, -1.0]), "b": torch.tensor([-5.0])}, 2)
        {'a': tensor([ True, False]), 'b': tensor([True])}
    """
    leaves, treedef = _float_leaves(tree, "tree")
    numel = sum(leaf.numel() for leaf in leaves)
    k = _check_k(k, numel)
    method = _check_method(method)
    mask = _flat_topk_mask(leaves, k, method)
    pieces = torch.split(mask, [leaf.numel() for leaf in leaves])
    return optree.tree_unflatten(treedef, [p.view(leaf.shape) for p, leaf in zip(pieces, leaves)])


def topk_sparsify(tree: PyTree, k: int, *, method: str = "torch") -> PyTree:
    """Keep the ``k`` coordinates of largest absolute value across the whole tree; zero the rest.

    Pure: returns a new tree with the input's structure, shapes, dtypes and
    devices; kept values are bit-exact copies of the input. See the module
    docstring for the tie, dtype and NaN rules.

    Args:
        tree: A pytree of floating-point tensors on one device (``None`` nodes allowed).
        k: How many coordinates to keep, ``1 <= k <= total number of coordinates``.
        method: The selection algorithm. ``"torch"``: ``torch.topk`` over the
            concatenated magnitudes (static shapes, compiles with ``fullgraph=True``).

    Returns:
        The sparsified tree.

    Raises:
        TypeError: ``k`` is not an int, or a leaf is not a floating-point tensor.
        ValueError: ``k`` is out of range, leaves are on several devices, or
            ``method`` is unknown.

    Example:
        >>> import torch, functopk as ft
        >>> grads = {"conv": torch.tensor([[0.5, -2.0], [0.1, 3.0]]), "bias": torch.tensor([-1.0])}
        >>> ft.topk_sparsify(grads, 2)
        {'conv': tensor([[ 0., -2.],
                [ 0.,  3.]]), 'bias': tensor([0.])}
    """
    leaves, treedef = _float_leaves(tree, "tree")
    numel = sum(leaf.numel() for leaf in leaves)
    k = _check_k(k, numel)
    method = _check_method(method)
    return optree.tree_unflatten(treedef, _sparsify_leaves(leaves, k, method))


def _sparsify_leaves(leaves: list[torch.Tensor], k: int, method: str) -> list[torch.Tensor]:
    mask = _flat_topk_mask(leaves, k, method)
    pieces = torch.split(mask, [leaf.numel() for leaf in leaves])
    return [torch.where(p.view(leaf.shape), leaf, 0.0) for p, leaf in zip(pieces, leaves)]


def topk(k: int | None = None, *, density: float | None = None, method: str = "torch") -> GradientTransformation:
    """Global top-k sparsification as a transformation (see :func:`topk_sparsify`).

    Give exactly one of ``k`` (a count) or ``density`` (a fraction of all
    coordinates, turned into ``k`` by :func:`k_from_density` from the size of
    the updates). Stateless.

    Args:
        k: Coordinates kept per step.
        density: Fraction of coordinates kept per step, in ``(0, 1]``.
        method: Selection algorithm, as for :func:`topk_sparsify`.

    Example:
        >>> import torch, functopk as ft
        >>> tx = ft.topk(density=0.5)
        >>> tx.update({"w": torch.tensor([1.0, -4.0, 2.0, 0.5])}, tx.init(None))[0]
        {'w': tensor([ 0., -4.,  2.,  0.])}
    """
    if (k is None) == (density is None):
        raise ValueError("give exactly one of k or density")
    if k is not None:
        if isinstance(k, bool) or not isinstance(k, numbers.Integral):
            raise TypeError(f"k must be an int, got {type(k).__name__} {k!r}")
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        k = int(k)
    else:
        density = _check_density(density)
    method = _check_method(method)

    def resolve_k(leaves: list[torch.Tensor]) -> int:
        numel = sum(leaf.numel() for leaf in leaves)
        if k is not None:
            return _check_k(k, numel)
        if numel == 0:
            raise ValueError("cannot keep a fraction of an empty tree: it has no coordinates")
        return k_from_density(density, numel)

    def init(params: Params) -> EmptyState:
        if params is not None:
            resolve_k(_float_leaves(params, "params")[0])
        return EmptyState()

    def update(updates: Updates, state: EmptyState, params: Params | None = None) -> tuple[Updates, EmptyState]:
        del params
        leaves, treedef = _float_leaves(updates, "updates")
        kk = resolve_k(leaves)
        return optree.tree_unflatten(treedef, _sparsify_leaves(leaves, kk, method)), state

    return GradientTransformation(init, update)
