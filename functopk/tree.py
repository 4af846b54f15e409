"""Pytrees of tensors: the flat layout and foreach-backed tree maths.

Every tree in functopk (parameters, gradients, updates, optimizer state) is an
`optree <https://github.com/metaopt/optree>`_ pytree whose leaves are tensors.
``None`` is a node, not a leaf, so a frozen parameter written as ``None``
stays ``None`` through every function here.

*Flat order.* Wherever functopk speaks of a "flat index", it means a position
in the concatenation of ``optree.tree_leaves(tree)``, each leaf flattened in
row-major order. optree visits dict keys in sorted order, so the flat order of a
model's parameter dict is the sorted order of its names.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import optree
import torch

__all__ = [
    "FlatLayout",
    "PyTree",
    "check_same_structure",
    "ravel_pytree",
    "tree_add",
    "tree_add_scaled",
    "tree_leaves",
    "tree_map",
    "tree_scale",
    "tree_zeros_like",
]

PyTree = Any
"""A pytree of tensors: nested dicts, lists, tuples and NamedTuples."""


def tree_leaves(tree: PyTree) -> list[torch.Tensor]:
    """The tensor leaves of ``tree`` in flat order (``None`` nodes skipped)."""
    return optree.tree_leaves(tree)


def tree_map(fn: Callable[..., Any], tree: PyTree, *rest: PyTree) -> PyTree:
    """Apply ``fn`` leaf-wise over trees of one structure (``None`` stays ``None``)."""
    return optree.tree_map(fn, tree, *rest)


def check_same_structure(expected: PyTree, actual: PyTree, *, name: str, expected_name: str) -> None:
    """Raise ``ValueError`` when two trees differ in structure.

    Args:
        expected: The reference tree (its structure is what ``actual`` must have).
        actual: The tree being checked.
        name: The argument name of ``actual``, used in the message.
        expected_name: What ``expected`` is, used in the message.

    Raises:
        ValueError: naming both structures.
    """
    expected_def = optree.tree_structure(expected)
    actual_def = optree.tree_structure(actual)
    if expected_def != actual_def:
        raise ValueError(
            f"{name} has tree structure {actual_def}, but {expected_name} has structure "
            f"{expected_def}; they must match"
        )


def _flatten_checked(tree: PyTree, treedef: optree.PyTreeSpec, name: str) -> list[torch.Tensor]:
    leaves, actual = optree.tree_flatten(tree)
    if actual != treedef:
        raise ValueError(f"{name} has tree structure {actual}, expected {treedef}")
    return leaves


def tree_zeros_like(tree: PyTree, dtype: torch.dtype | None = None) -> PyTree:
    """A tree of zeros with the structure, shapes and devices of ``tree``."""
    leaves, treedef = optree.tree_flatten(tree)
    return optree.tree_unflatten(treedef, [torch.zeros_like(x, dtype=dtype) for x in leaves])


def keep_dtypes(results: Sequence[torch.Tensor], like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Cast each result back to the dtype of its input where a foreach op promoted it.

    A 0-d leaf combined with a 0-d tensor scalar follows tensor-tensor type
    promotion (an fp16 scalar leaf times an fp32 learning rate gives fp32), unlike
    larger leaves; this undoes that so a leaf's dtype never changes.
    """
    return [r if r.dtype == x.dtype else r.to(x.dtype) for r, x in zip(results, like)]


def tree_scale(tree: PyTree, scalar: float | torch.Tensor) -> PyTree:
    """``scalar * tree`` leaf-wise, through one ``torch._foreach_mul`` call.

    ``scalar`` may be a Python number or a 0-d tensor (no host sync either way).
    Leaves keep their dtypes.
    """
    leaves, treedef = optree.tree_flatten(tree)
    if not leaves:
        return tree
    return optree.tree_unflatten(treedef, keep_dtypes(torch._foreach_mul(leaves, scalar), leaves))


def tree_add(a: PyTree, b: PyTree) -> PyTree:
    """``a + b`` leaf-wise for two trees of one structure, through ``torch._foreach_add``."""
    leaves_a, treedef = optree.tree_flatten(a)
    leaves_b = _flatten_checked(b, treedef, "b")
    if not leaves_a:
        return a
    return optree.tree_unflatten(treedef, keep_dtypes(torch._foreach_add(leaves_a, leaves_b), leaves_a))


def tree_add_scaled(a: PyTree, scalar: float | torch.Tensor, b: PyTree) -> PyTree:
    """``a + scalar * b`` leaf-wise for two trees of one structure, with foreach kernels."""
    leaves_a, treedef = optree.tree_flatten(a)
    leaves_b = _flatten_checked(b, treedef, "b")
    if not leaves_a:
        return a
    if isinstance(scalar, torch.Tensor):
        # The foreach ``alpha`` argument must be a Python number; a tensor scalar goes
        # through a multiply so that no host sync is needed.
        scaled = torch._foreach_mul(leaves_b, scalar)
        return optree.tree_unflatten(treedef, keep_dtypes(torch._foreach_add(leaves_a, scaled), leaves_a))
    return optree.tree_unflatten(treedef, list(torch._foreach_add(leaves_a, leaves_b, alpha=scalar)))


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
        >>> layout = ft.FlatLayout.from_tree(tree)
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
        leaves, treedef = optree.tree_flatten(tree)
        for path, leaf in zip(treedef.paths(), leaves):
            if not isinstance(leaf, torch.Tensor):
                raise TypeError(
                    f"tree leaf at {_path_str(path)} is a {type(leaf).__name__}; expected a torch.Tensor"
                )
        numels = tuple(x.numel() for x in leaves)
        offsets = [0]
        for n in numels:
            offsets.append(offsets[-1] + n)
        return cls(
            treedef=treedef,
            shapes=tuple(x.shape for x in leaves),
            dtypes=tuple(x.dtype for x in leaves),
            devices=tuple(x.device for x in leaves),
            numels=numels,
            offsets=tuple(offsets),
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
            treedef == self.treedef
            and tuple(x.shape for x in leaves) == self.shapes
            and tuple(x.dtype for x in leaves) == self.dtypes
        )

    def leaves(self, tree: PyTree, *, name: str = "tree") -> list[torch.Tensor]:
        """The leaves of ``tree`` after checking its structure and shapes against the layout."""
        leaves, treedef = optree.tree_flatten(tree)
        if treedef != self.treedef:
            raise ValueError(f"{name} has tree structure {treedef}, expected {self.treedef}")
        for path, leaf, shape in zip(treedef.paths(), leaves, self.shapes):
            if leaf.shape != shape:
                raise ValueError(
                    f"{name} leaf at {_path_str(path)} has shape {tuple(leaf.shape)}, expected {tuple(shape)}"
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
        return [chunk.view(shape) for chunk, shape in zip(torch.split(flat, self.numels), self.shapes)]

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
            >>> layout = ft.FlatLayout.from_tree({"a": torch.zeros(2, 2), "b": torch.zeros(3)})
            >>> layout.locate(torch.tensor([0, 3, 4, 6]))
            (tensor([0, 0, 1, 1]), tensor([0, 3, 0, 2]))
        """
        starts = torch.tensor(self.offsets[:-1], dtype=torch.int64, device=indices.device)
        indices = indices.to(torch.int64)
        leaf_ids = torch.searchsorted(starts, indices, right=True) - 1
        return leaf_ids, indices - starts[leaf_ids.clamp_min(0)]

    def leaf_paths(self) -> list[str]:
        """Readable paths of the leaves in flat order, e.g. ``"['layer1.0.conv1.weight']"``."""
        return [_path_str(p) for p in self.treedef.paths()]


def ravel_pytree(tree: PyTree) -> tuple[torch.Tensor, Callable[[torch.Tensor], PyTree]]:
    """Flatten ``tree`` into one vector; return it and the function that undoes it.

    Example:
        >>> import torch, functopk as ft
        >>> flat, unravel = ft.ravel_pytree({"a": torch.ones(2), "b": torch.zeros(())})
        >>> flat
        tensor([1., 1., 0.])
        >>> unravel(flat * 2)["a"]
        tensor([2., 2.])
    """
    layout = FlatLayout.from_tree(tree)
    return layout.ravel(tree), layout.unravel


def _path_str(path: Sequence[Any]) -> str:
    return "".join(f"[{p!r}]" for p in path) if path else "<root>"
