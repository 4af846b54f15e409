"""The flat layout of a tree: where each leaf lives in one flat vector.

*Flat order.* Wherever functopk speaks of a "flat index", it means a position
in the concatenation of ``optree.tree_leaves(tree)``, each leaf flattened in
row-major order. optree visits dict keys in sorted order, so the flat order of a
model's parameter dict is the sorted order of its names. ``None`` is a node,
not a leaf: a frozen parameter written as ``None`` takes no flat positions.

:class:`FlatLayout` is the one place that knows leaf offsets: every mapping
between flat indices and leaves (``locate``, ``bounds``) goes through it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import optree
import torch

from functopk._checks import check_leaves, first_difference, path_str
from functopk._compat import same_structure

__all__ = ["FlatLayout", "ravel_pytree"]

PyTree = Any


def offsets_of(numels: Sequence[int]) -> tuple[int, ...]:
    """Start of each leaf in the flat vector, plus the total at the end."""
    offsets = [0]
    for n in numels:
        offsets.append(offsets[-1] + n)
    return tuple(offsets)


@dataclasses.dataclass(frozen=True, eq=False)
class FlatLayout:
    """Where each leaf of a tree lives in one flat vector.

    Built once from a tree (``FlatLayout.from_tree``), it records the tree
    definition and each leaf's shape, dtype, device, size and offset, so a flat
    vector can be cut back into the tree with one ``torch.split`` and a ``view``
    per leaf: no Python loop over coordinates.

    Example:
        >>> import torch, functopk as ft
        >>> tree = {"w": torch.arange(6.0).reshape(2, 3), "b": torch.tensor([10.0])}
        >>> layout = ft.tree.FlatLayout.from_tree(tree)
        >>> layout.numel, layout.offsets    # "b" comes first: dict keys are sorted
        (7, (0, 1, 7))
        >>> flat = layout.ravel(tree)
        >>> flat
        tensor([10.,  0.,  1.,  2.,  3.,  4.,  5.])
        >>> layout.unravel(flat)["w"]
        tensor([[0., 1., 2.],
                [3., 4., 5.]])
    """

    treedef: optree.PyTreeSpec
    shapes: tuple[torch.Size, ...]
    dtypes: tuple[torch.dtype, ...]
    devices: tuple[torch.device, ...]
    numels: tuple[int, ...]
    offsets: tuple[int, ...]
    """Start of each leaf in the flat vector, plus the total at the end."""

    @classmethod
    def from_tree(cls, tree: PyTree) -> FlatLayout:
        """Record the layout of ``tree`` (its values are not read)."""
        leaves, treedef = check_leaves(tree, "tree")
        numels = tuple(x.numel() for x in leaves)
        return cls(
            treedef=treedef,
            shapes=tuple(x.shape for x in leaves),
            dtypes=tuple(x.dtype for x in leaves),
            devices=tuple(x.device for x in leaves),
            numels=numels,
            offsets=offsets_of(numels),
        )

    @property
    def numel(self) -> int:
        """Total number of coordinates."""
        return self.offsets[-1]

    @property
    def num_leaves(self) -> int:
        """Number of tensor leaves."""
        return len(self.shapes)

    @property
    def common_dtype(self) -> torch.dtype:
        """The promoted dtype of all leaves (``torch.float32`` for an empty tree)."""
        dtype = None
        for d in self.dtypes:
            dtype = d if dtype is None else torch.promote_types(dtype, d)
        return torch.float32 if dtype is None else dtype

    @property
    def device(self) -> torch.device:
        """The one device of all leaves; ``ValueError`` if they are spread over several."""
        devices = set(self.devices)
        if len(devices) > 1:
            raise ValueError(
                f"tree leaves are on several devices {sorted(map(str, devices))}; expected one device"
            )
        return next(iter(devices)) if devices else torch.device("cpu")

    def matches(self, tree: PyTree) -> bool:
        """True when ``tree`` has this layout's structure, shapes and dtypes."""
        leaves, treedef = optree.tree_flatten(tree)
        return (
            same_structure(treedef, self.treedef)
            and tuple(x.shape for x in leaves) == self.shapes
            and tuple(x.dtype for x in leaves) == self.dtypes
        )

    def leaves(self, tree: PyTree, *, name: str = "tree") -> list[torch.Tensor]:
        """The leaves of ``tree`` after checking its structure and shapes against the layout."""
        leaves, treedef = optree.tree_flatten(tree)
        if not same_structure(treedef, self.treedef):
            raise ValueError(f"{name} does not have the layout's tree structure: "
                             f"{first_difference(self.treedef, treedef)}")
        for path, leaf, shape in zip(treedef.paths(), leaves, self.shapes):
            if leaf.shape != shape:
                raise ValueError(
                    f"{name} leaf at {path_str(path)} has shape {tuple(leaf.shape)}, expected {tuple(shape)}"
                )
        return leaves

    def ravel(self, tree: PyTree, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Concatenate the leaves of ``tree`` into one 1-d tensor.

        Args:
            tree: A tree with this layout.
            dtype: The dtype of the result; defaults to ``common_dtype``.
        """
        leaves = self.leaves(tree)
        dtype = self.common_dtype if dtype is None else dtype
        if not leaves:
            return torch.zeros(0, dtype=dtype, device=self.device)
        return torch.cat([x.reshape(-1).to(dtype) for x in leaves])

    def split(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Cut a flat vector into per-leaf views shaped like the leaves (dtype unchanged)."""
        if flat.dim() != 1 or flat.shape[0] != self.numel:
            raise ValueError(f"flat must be a 1-d tensor of {self.numel} elements, got shape {tuple(flat.shape)}")
        return [chunk.view(shape) for chunk, shape in zip(torch.split(flat, list(self.numels)), self.shapes)]

    def unravel(self, flat: torch.Tensor, *, cast: bool = True) -> PyTree:
        """The tree whose leaves are the pieces of ``flat`` (views where no cast is needed).

        Args:
            flat: A 1-d tensor of ``numel`` elements.
            cast: Cast each leaf back to its recorded dtype and device (default); with
                ``False`` the leaves keep ``flat``'s dtype and device.
        """
        pieces = self.split(flat)
        if cast:
            pieces = [p.to(device=dev, dtype=dt) for p, dt, dev in zip(pieces, self.dtypes, self.devices)]
        return optree.tree_unflatten(self.treedef, pieces)

    def locate(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Which leaf each flat index falls in, and the position inside that leaf (flattened).

        Tensor ops only (``torch.searchsorted`` over the leaf offsets), no Python
        loop over coordinates and no host sync; empty leaves are skipped over.

        Args:
            indices: An integer tensor of flat indices in ``[0, numel)``.

        Returns:
            ``(leaf_ids, positions)``, int64 tensors shaped like ``indices``.

        Example:
            >>> import torch, functopk as ft
            >>> layout = ft.tree.FlatLayout.from_tree({"a": torch.zeros(2, 2), "b": torch.zeros(3)})
            >>> layout.locate(torch.tensor([0, 3, 4, 6]))
            (tensor([0, 0, 1, 1]), tensor([0, 3, 0, 2]))
        """
        starts = torch.tensor(self.offsets[:-1], dtype=torch.int64, device=indices.device)
        indices = indices.to(torch.int64)
        leaf_ids = torch.searchsorted(starts, indices, right=True) - 1
        return leaf_ids, indices - starts[leaf_ids.clamp_min(0)]

    def bounds(self, indices: torch.Tensor, *, name: str = "indices") -> list[tuple[int, int, int]]:
        """``(offset, lo, hi)`` per leaf: ``indices[lo:hi]`` are the sorted flat indices inside that leaf.

        ``indices`` must be 1-d and ascending (as every functopk selection
        returns them). Reads ``num_leaves + 1`` integers back to the host (one
        small transfer); ``ValueError`` when an index lies outside ``[0, numel)``.
        """
        starts = torch.tensor(self.offsets, dtype=torch.int64, device=indices.device)
        cuts = torch.searchsorted(indices, starts).tolist()
        if cuts[0] != 0 or cuts[-1] != indices.numel():
            raise ValueError(f"{name} must lie in [0, {self.numel}) (the coordinates of the tree)")
        return list(zip(self.offsets[:-1], cuts[:-1], cuts[1:]))

    def leaf_paths(self) -> list[str]:
        """Readable paths of the leaves in flat order, e.g. ``"['layer1.0.conv1.weight']"``."""
        return [path_str(p) for p in self.treedef.paths()]


def ravel_pytree(tree: PyTree) -> tuple[torch.Tensor, Callable[[torch.Tensor], PyTree]]:
    """Flatten ``tree`` into one vector; return it and the function that undoes it.

    Example:
        >>> import torch, functopk as ft
        >>> flat, unravel = ft.tree.ravel({"a": torch.ones(2), "b": torch.zeros(())})
        >>> flat
        tensor([1., 1., 0.])
        >>> unravel(flat * 2)["a"]
        tensor([2., 2.])
    """
    layout = FlatLayout.from_tree(tree)
    return layout.ravel(tree), layout.unravel

