"""Global top-k gradient sparsification: the public functions.

:func:`topk_sparsify` keeps the ``k`` coordinates of largest absolute value
across *all* leaves of a tree (not per leaf) and zeros the rest;
:func:`topk_mask` returns the selection as a boolean tree, :func:`topk_indices`
as a :class:`~functopk.SparseUpdates` (flat indices and values), and
:func:`functopk.topk` is the same operation as a :class:`~functopk.GradientTransformation`.
Each is a few lines: check, :func:`~functopk.sparse.dispatch.select`, ask the
selection for the output.

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
* A 0-d tensor ``k`` is rounded and clamped to ``[1, n]`` on device (``inf``
  and values beyond int64 give ``n``). A NaN ``k`` is a ``ValueError`` where
  ``k`` is read on the host anyway (the eager exact kernel); elsewhere (static
  kernels, compiled code) it means ``k = n``: keep everything, lose nothing.
  :mod:`functopk.sparse.k` holds these rules.

Methods (``method=``; see ``docs/topk.md`` for measurements and the compile table):

* ``"exact"`` (default): the exact top-k, fastest. In eager mode on CPU it
  brackets the k-th magnitude with a sample, scans the leaves once for
  candidates without concatenating them, and selects exactly among the
  candidates (with fallbacks that keep it exact for any input and bound its
  work); it reads sizes on the host and has data-dependent shapes. Under
  ``torch.compile``, on other devices, or when a leaf requires grad, it runs
  the ``"torch"`` kernel instead, which gives the identical result with static shapes.
* ``"torch"``: ``torch.topk`` over the concatenated magnitudes (a radix select
  for a tensor ``k``): static shapes, no host sync, compiles with ``fullgraph=True``.
* ``"approx"``: keeps the coordinates above a threshold estimated from a
  systematic sample (:func:`functopk.sparse.kernels.approx.sample_threshold`):
  about ``k`` of them (see ``docs/topk.md`` for the band), static shapes, cheapest.
* ``"gaussian"``: the same with the Gaussian threshold of Shi et al. (2019)
  (:func:`gaussian_threshold`); accurate only for near-Gaussian gradients.

Approximate methods rank NaN like the exact ones (always kept) and never keep
exact zeros unless the threshold is negative (``k`` equal to the tree size).

Every function takes a keyword-only ``config``: the kernels' tuning constants
(:class:`~functopk.sparse.KernelConfig`), for tests and benchmarks; they change
the speed, never the result.
"""

from __future__ import annotations

from typing import Any

import optree
import torch

from functopk._checks import check_int, check_k, check_k_or_density, check_leaves, one_device
from functopk.sparse import dispatch
from functopk.sparse.config import KernelConfig
from functopk.sparse.k import KLike, k_on_device, resolve_k
from functopk.sparse.kernels.approx import gaussian_threshold_flat
from functopk.sparse.kernels.base import SUPPORTED_DTYPES, common_dtype, magnitudes_
from functopk.sparse.updates import SparseUpdates
from functopk.tree.maths import PyTree

__all__ = [
    "gaussian_threshold",
    "sparse_leaves",
    "topk_indices",
    "topk_mask",
    "topk_sparsify",
]


def sparse_leaves(tree: PyTree, name: str) -> tuple[list[torch.Tensor], optree.PyTreeSpec]:
    """Flatten ``tree``, checking that its leaves are supported float tensors on one device.

    Example:
        >>> import torch, functopk as ft
        >>> from functopk.sparse.api import sparse_leaves
        >>> sparse_leaves({"w": torch.ones(2), "frozen": None}, "grads")[0]
        [tensor([1., 1.])]
    """
    leaves, treedef = check_leaves(tree, name, dtypes=SUPPORTED_DTYPES)
    one_device(leaves, name)
    return leaves, treedef


def _prepare(tree: PyTree, k: Any, method: Any) -> tuple[list[torch.Tensor], optree.PyTreeSpec, KLike, str]:
    leaves, treedef = sparse_leaves(tree, "tree")
    k = resolve_k(check_k(k), None, sum(x.numel() for x in leaves), name="the tree")
    return leaves, treedef, k, dispatch.check_method(method)


def topk_sparsify(tree: PyTree, k: KLike, *, method: str = "exact", config: KernelConfig | None = None) -> PyTree:
    """Keep the ``k`` coordinates of largest absolute value across the whole tree; zero the rest.

    Pure: returns a new tree with the input's structure, shapes, dtypes and
    devices; kept values are bit-exact copies of the input. See the module
    docstring for the tie, dtype and NaN rules and the methods.

    Args:
        tree: A pytree of floating-point tensors on one device (``None`` nodes allowed).
        k: How many coordinates to keep, ``1 <= k <= total number of coordinates``;
            or a 0-d tensor, rounded and clamped to that range on device (NaN: see the module docstring).
        method: ``"exact"`` (default), ``"torch"``, ``"approx"`` or ``"gaussian"``.
        config: The kernels' tuning constants (tests, benchmarks); ``None``: the defaults.

    Returns:
        The sparsified tree.

    Raises:
        TypeError: ``k`` is not an int or 0-d tensor, or a leaf is not a supported float tensor.
        ValueError: ``k`` is out of range (or a NaN tensor read by the eager exact kernel),
            leaves are on several devices, or ``method`` is unknown.

    Example:
        >>> import torch, functopk as ft
        >>> grads = {"conv": torch.tensor([[0.5, -2.0], [0.1, 3.0]]), "bias": torch.tensor([-1.0])}
        >>> ft.topk_sparsify(grads, 2)
        {'conv': tensor([[ 0., -2.],
                [ 0.,  3.]]), 'bias': tensor([0.])}
    """
    leaves, treedef, k, method = _prepare(tree, k, method)
    return optree.tree_unflatten(treedef, dispatch.select(leaves, k, method, config).dense(leaves))


def topk_mask(tree: PyTree, k: KLike, *, method: str = "exact", config: KernelConfig | None = None) -> PyTree:
    """Boolean tree marking the ``k`` coordinates of largest ``|value|`` across all leaves.

    Same rules, methods and arguments as :func:`topk_sparsify`; with an exact
    method exactly ``k`` entries are True.

    Example:
        >>> import torch, functopk as ft
        >>> ft.topk_mask({"a": torch.tensor([3.0, -1.0]), "b": torch.tensor([-5.0])}, 2)
        {'a': tensor([ True, False]), 'b': tensor([True])}
    """
    leaves, treedef, k, method = _prepare(tree, k, method)
    return optree.tree_unflatten(treedef, dispatch.select(leaves, k, method, config).masks(leaves))


def topk_indices(
    tree: PyTree, k: KLike, *, method: str = "exact", config: KernelConfig | None = None, max_k: int | None = None
) -> SparseUpdates:
    """The top ``k`` coordinates as a :class:`~functopk.SparseUpdates`: ascending flat indices and values.

    The sparse twin of :func:`topk_sparsify` (same rules, methods and
    arguments): ``O(k)`` output instead of a dense tree. Apply it with
    :func:`~functopk.apply_sparse_updates` or densify it with
    :meth:`~functopk.SparseUpdates.to_dense`. With ``method="torch"`` and an int
    ``k`` the output has static shape ``(k,)`` (``torch.nonzero_static``) and
    compiles with ``fullgraph=True``; the approximate methods return a
    data-dependent number of coordinates.

    A 0-d tensor ``k`` gives ``k`` coordinates, a number the host learns by
    reading ``k`` (a synchronisation on a GPU, refused while a CUDA graph is
    captured). ``max_k`` (an int, exact methods) fixes the output's shape to
    ``(max_k,)`` without that read: the top ``max_k`` coordinates, with the
    values of all but the ``k`` largest (ranked by the same rules) set to 0,
    so that applying it, or :meth:`~functopk.SparseUpdates.to_dense`, gives the
    top ``k`` exactly. A tensor ``k`` above ``max_k`` (or NaN) keeps ``max_k``
    coordinates: choose ``max_k`` as the bound of your ``k`` schedule.

    Raises:
        TypeError, ValueError: as :func:`topk_sparsify`; ``max_k`` not an int, outside
            ``[1, n]``, below an int ``k``, or given with an approximate method.

    Example:
        >>> import torch, functopk as ft
        >>> ft.topk_indices({"w": torch.tensor([[1.0, -4.0], [0.5, 2.0]])}, 2)
        SparseUpdates(indices=tensor([1, 3]), values=tensor([-4.,  2.]), numel=4)
        >>> ft.topk_indices({"w": torch.tensor([[1.0, -4.0], [0.5, 2.0]])}, torch.tensor(1), max_k=3)
        SparseUpdates(indices=tensor([0, 1, 3]), values=tensor([ 0., -4.,  0.]), numel=4)
    """
    leaves, _, k, method = _prepare(tree, k, method)
    if max_k is None:
        return dispatch.select(leaves, k, method, config).sparse(leaves)
    n = sum(x.numel() for x in leaves)
    max_k = check_int(max_k, "max_k", minimum=1)
    if max_k > n or (not isinstance(k, torch.Tensor) and k > max_k) or method not in dispatch.EXACT_METHODS:
        raise ValueError(
            f"max_k={max_k} must lie in [k, n] for an int k (k={k}, n={n}) and in [1, n] for a tensor k, with "
            f"method 'exact' or 'torch' (got {method!r}: the approximate methods keep a data-dependent count)"
        )
    return _first(dispatch.select(leaves, max_k, method, config).sparse(leaves), k_on_device(k, n))


def _first(sparse: SparseUpdates, k: int | torch.Tensor) -> SparseUpdates:
    """``sparse`` with every value but its ``k`` of largest magnitude set to 0 (NaN ranks as ``inf``, ties to
    the lower index: the selection's rules, so these ``k`` are the tree's top ``k``). No host read."""
    v = sparse.values
    key = magnitudes_(v.detach().abs())
    order = torch.sort(key, descending=True, stable=True).indices  # (stable: equal keys keep index order)
    rank = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
    kept = torch.where(rank < k, v, torch.zeros((), dtype=v.dtype, device=v.device))
    return SparseUpdates(sparse.indices, kept, sparse.numel, sparse.sizes)


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
    distribution-free.

    Non-finite input: a NaN or infinite coordinate makes the root mean square
    non-finite, and the estimate is then the largest finite value of the
    tree's dtype, so ``method="gaussian"`` keeps exactly the non-finite
    coordinates (NaN, ``±inf``), which rank first in every method. A NaN
    tensor ``density`` (or ``k``) counts as 1 (``k = n``).

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
        >>> ft.sparse.gaussian_threshold({"w": torch.tensor([1.0, float("nan")])}, 1)
        tensor(3.4028e+38)
    """
    k, density = check_k_or_density(k, density)
    leaves, _ = sparse_leaves(tree, "tree")
    numel = sum(x.numel() for x in leaves)
    if k is not None:
        density = k_on_device(resolve_k(k, None, numel, name="the tree"), numel) / numel
    elif numel < 1:
        resolve_k(None, density, numel, name="the tree")
    flats = [x.detach().reshape(-1) for x in leaves]
    return gaussian_threshold_flat(flats, density, common_dtype(leaves))
