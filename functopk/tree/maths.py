"""Tree maths: leaf-wise arithmetic on pytrees of tensors, through the foreach kernels.

Each function flattens its trees once, checks that they share one structure
(naming the first differing leaf path), runs the list maths of
:mod:`functopk.tree.foreach` and unflattens. Leaves keep their dtypes; scalars
may be Python numbers or 0-d tensors (never read back to the host); ``None``
nodes stay ``None``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import optree
import torch

from functopk._checks import check_leaves, first_difference
from functopk._compat import same_structure
from functopk.tree import foreach

PyTree = Any
"""A pytree of tensors: nested dicts, lists, tuples and NamedTuples (``None`` is an empty node)."""

__all__ = [
    "PyTree",
    "add",
    "add_scaled",
    "all_finite",
    "cast",
    "flatten_like",
    "leaves",
    "map",
    "norm",
    "scale",
    "sub",
    "where",
    "zeros_like",
]


def leaves(tree: PyTree) -> list[torch.Tensor]:
    """The tensor leaves of ``tree`` in flat order (``None`` nodes skipped; dict keys sorted).

    Example:
        >>> import torch, functopk as ft
        >>> ft.tree.leaves({"w": torch.ones(1), "b": torch.zeros(1), "frozen": None})
        [tensor([0.]), tensor([1.])]
    """
    return optree.tree_leaves(tree)


def map(fn: Callable[..., Any], tree: PyTree, *rest: PyTree) -> PyTree:  # noqa: A001 (optax.tree.map)
    """Apply ``fn`` leaf-wise over trees of one structure (``None`` stays ``None``).

    Example:
        >>> import torch, functopk as ft
        >>> ft.tree.map(lambda x: x.dim() > 1, {"w": torch.zeros(2, 2), "b": torch.zeros(2)})
        {'w': True, 'b': False}
    """
    return optree.tree_map(fn, tree, *rest)


def flatten_like(tree: PyTree, treedef: optree.PyTreeSpec, name: str, expected_name: str) -> list[Any]:
    """The leaves of ``tree``, after checking that its structure is ``treedef`` (``ValueError`` naming the path)."""
    leaves_, actual = optree.tree_flatten(tree)
    if not same_structure(actual, treedef):
        raise ValueError(f"{name} does not have the tree structure of {expected_name}: "
                         f"{first_difference(treedef, actual)}")
    return leaves_


def _binary(fn: Callable[..., list[torch.Tensor]], a: PyTree, b: PyTree, *args: Any) -> PyTree:
    xs, treedef = check_leaves(a, "a")
    ys = flatten_like(b, treedef, "b", "a")
    return optree.tree_unflatten(treedef, fn(xs, *args, ys) if args else fn(xs, ys))


def add(a: PyTree, b: PyTree) -> PyTree:
    """``a + b`` leaf-wise.

    Example:
        >>> import torch, functopk as ft
        >>> ft.tree.add({"w": torch.ones(2)}, {"w": torch.tensor([1.0, 2.0])})
        {'w': tensor([2., 3.])}
    """
    return _binary(foreach.add, a, b)


def sub(a: PyTree, b: PyTree) -> PyTree:
    """``a - b`` leaf-wise.

    Example:
        >>> import torch, functopk as ft
        >>> ft.tree.sub({"w": torch.ones(2)}, {"w": torch.tensor([1.0, 2.0])})
        {'w': tensor([ 0., -1.])}
    """
    return _binary(foreach.sub, a, b)


def add_scaled(a: PyTree, scalar: float | torch.Tensor, b: PyTree) -> PyTree:
    """``a + scalar * b`` leaf-wise (one fused kernel for a Python ``scalar``).

    Example:
        >>> import torch, functopk as ft
        >>> ft.tree.add_scaled({"w": torch.ones(2)}, -0.5, {"w": torch.tensor([2.0, 4.0])})
        {'w': tensor([ 0., -1.])}
    """
    return _binary(foreach.add_scaled, a, b, scalar)


def scale(tree: PyTree, scalar: float | torch.Tensor) -> PyTree:
    """``scalar * tree`` leaf-wise.

    Example:
        >>> import torch, functopk as ft
        >>> ft.tree.scale({"w": torch.tensor([1.0, -2.0])}, 0.5)
        {'w': tensor([ 0.5000, -1.0000])}
    """
    xs, treedef = check_leaves(tree, "tree")
    return optree.tree_unflatten(treedef, foreach.mul(xs, scalar))


def where(cond: torch.Tensor, a: PyTree, b: PyTree) -> PyTree:
    """``a`` where the 0-d bool tensor ``cond`` holds, else ``b``: a branch without a host sync.

    Example:
        >>> import torch, functopk as ft
        >>> ft.tree.where(torch.tensor(False), {"w": torch.ones(1)}, {"w": torch.zeros(1)})
        {'w': tensor([0.])}
    """
    xs, treedef = check_leaves(a, "a")
    ys = flatten_like(b, treedef, "b", "a")
    return optree.tree_unflatten(treedef, foreach.where(cond, xs, ys))


def cast(tree: PyTree, dtype: torch.dtype | None) -> PyTree:
    """The floating-point leaves of ``tree`` in ``dtype`` (others unchanged; ``None``: the tree itself).

    Example:
        >>> import torch, functopk as ft
        >>> ft.tree.cast({"w": torch.ones(1), "i": torch.ones(1, dtype=torch.int64)}, torch.float64)
        {'w': tensor([1.], dtype=torch.float64), 'i': tensor([1])}
    """
    xs, treedef = check_leaves(tree, "tree")
    return optree.tree_unflatten(treedef, foreach.cast(xs, dtype))


def zeros_like(tree: PyTree, dtype: torch.dtype | None = None) -> PyTree:
    """A tree of fresh zeros with the structure, shapes, devices (and dtypes, unless given) of ``tree``.

    Example:
        >>> import torch, functopk as ft
        >>> ft.tree.zeros_like({"w": torch.ones(2)})
        {'w': tensor([0., 0.])}
    """
    xs, treedef = check_leaves(tree, "tree")
    return optree.tree_unflatten(treedef, foreach.zeros_like(xs, dtype))


def norm(tree: PyTree) -> torch.Tensor:
    """The L2 norm of all leaves together, a 0-d tensor (no host sync).

    Computed like ``torch.nn.utils.clip_grad_norm_``: one ``torch._foreach_norm``
    per (device, dtype) group, then the norm of the per-leaf norms, in the
    promoted dtype of the leaves and float32 (half-precision leaves are summed in
    float32, so their norm does not overflow). Any NaN gives NaN, any infinity
    ``inf``.

    Example:
        >>> import torch, functopk as ft
        >>> ft.tree.norm({"a": torch.tensor([3.0]), "b": torch.tensor([[4.0]])})
        tensor(5.)
    """
    xs, _ = check_leaves(tree, "tree")
    return foreach.global_norm(xs)


def all_finite(tree: PyTree) -> torch.Tensor:
    """A 0-d bool tensor: True when no leaf holds a NaN or an infinity (no host sync).

    Example:
        >>> import torch, functopk as ft
        >>> ft.tree.all_finite({"a": torch.ones(2), "b": torch.tensor([1.0, float("nan")])})
        tensor(False)
    """
    xs, _ = check_leaves(tree, "tree")
    return foreach.all_finite(xs)
