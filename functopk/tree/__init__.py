"""Pytrees of tensors: tree maths and the flat layout (``ft.tree``, in the spirit of ``optax.tree``).

Every tree in functopk (parameters, gradients, updates, optimizer state) is an
`optree <https://github.com/metaopt/optree>`_ pytree whose leaves are tensors;
``None`` is an empty node, so a frozen parameter written as ``None`` stays
``None`` through every function here.

* :mod:`functopk.tree.maths`: ``add``, ``sub``, ``scale``, ``add_scaled``,
  ``where``, ``cast``, ``zeros_like``, ``norm``, ``all_finite``, ``map``, ``leaves``;
* :mod:`functopk.tree.layout`: :class:`FlatLayout` and ``ravel``;
* :mod:`functopk.tree.foreach`: the same maths on lists of leaves, which
  transformations are written with.

Example:
    >>> import torch, functopk as ft
    >>> ft.tree.add_scaled({"w": torch.ones(2)}, 2.0, {"w": torch.ones(2)})
    {'w': tensor([3., 3.])}
"""

from functopk.tree.layout import FlatLayout
from functopk.tree.layout import ravel_pytree as ravel
from functopk.tree.maths import (
    PyTree,
    add,
    add_scaled,
    all_finite,
    cast,
    leaves,
    map,
    norm,
    scale,
    sub,
    where,
    zeros_like,
)

__all__ = [
    "FlatLayout",
    "PyTree",
    "add",
    "add_scaled",
    "all_finite",
    "cast",
    "leaves",
    "map",
    "norm",
    "ravel",
    "scale",
    "sub",
    "where",
    "zeros_like",
]
