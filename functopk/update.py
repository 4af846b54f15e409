"""Applying dense updates to parameters: :func:`apply_updates` (pure) and :func:`apply_updates_` (in place).

Both check every leaf before computing anything: the two trees' structures
(naming the first differing path), that each update meets a floating-point
parameter of its shape and device, and, in place, that each parameter can take
the write. A failed call changes nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import optree
import torch

from functopk._checks import check_tree, describe, first_difference, path_str
from functopk._compat import same_structure
from functopk._overlap import check_writable
from functopk.base import Params, Updates

__all__ = ["apply_updates", "apply_updates_"]


def _check_pair(p: Any, u: Any, where: Callable[[], str]) -> None:
    """The checks for one leaf that has an update: types, dtypes, shape, device (``where()``: its path)."""
    if not isinstance(u, torch.Tensor):
        raise TypeError(f"updates leaf at {where()} is {describe(u)}; expected a torch.Tensor or None")
    if p is None:
        raise ValueError(f"updates has a tensor at {where()} where params has None")
    if not isinstance(p, torch.Tensor):
        raise TypeError(f"params leaf at {where()} is {describe(p)}; expected a torch.Tensor")
    if not p.is_floating_point():
        raise TypeError(
            f"params leaf at {where()} has dtype {p.dtype}; updates are added to floating-point parameters only "
            "(adding to an integer or bool tensor would silently truncate the update)"
        )
    if not u.is_floating_point():
        raise TypeError(f"updates leaf at {where()} has dtype {u.dtype}; expected a floating-point tensor")
    if p.shape != u.shape:
        raise ValueError(
            f"updates leaf at {where()} has shape {tuple(u.shape)}, but the parameter has shape {tuple(p.shape)}"
        )
    if p.device != u.device:
        raise ValueError(f"updates leaf at {where()} is on {u.device}, but the parameter is on {p.device}")


def paired_leaves(
    params: Params, updates: Updates, *, in_place: bool
) -> tuple[list[Any], list[tuple[int, torch.Tensor]], optree.PyTreeSpec]:
    """Every check of :func:`apply_updates` (and, ``in_place``, writability), before anything is computed.

    Returns all leaves of ``params`` (``None`` kept as a leaf), the pairs ``(leaf index, update cast to the
    parameter's dtype)`` for the leaves with an update, and the structure. Leaf paths are built only for a
    message, so the checks cost no more than a loop over the leaves.
    """
    check_tree(params, "params")
    check_tree(updates, "updates")
    p_leaves, p_def = optree.tree_flatten(params, none_is_leaf=True)
    u_leaves, u_def = optree.tree_flatten(updates, none_is_leaf=True)
    if not same_structure(p_def, u_def):
        raise ValueError(f"updates does not have the tree structure of params: {first_difference(p_def, u_def)}")
    pairs = []
    for i, (p, u) in enumerate(zip(p_leaves, u_leaves)):
        if u is None:
            continue
        if not (  # the checks of _check_pair, inline (a call per leaf costs as much); it names the failure
            isinstance(u, torch.Tensor) and isinstance(p, torch.Tensor) and p.is_floating_point()
            and u.is_floating_point() and p.shape == u.shape and p.device == u.device
        ):  # fmt: skip
            _check_pair(p, u, lambda: path_str(p_def.paths()[i]))  # noqa: B023 - called at once or not at all
        pairs.append((i, u if u.dtype == p.dtype else u.to(p.dtype)))
    if in_place:
        check_writable([p_leaves[i] for i, _ in pairs], "params", lambda j: path_str(p_def.paths()[pairs[j][0]]))
    return p_leaves, pairs, p_def


def apply_updates(params: Params, updates: Updates) -> Params:
    """Return ``params + updates`` as a new tree (pure; inputs are not changed).

    Each update is cast to its parameter's dtype first, so parameters keep their
    dtype. Where an update is ``None`` (a frozen parameter), the parameter is
    returned as it is. The result stays differentiable (no ``torch.no_grad``), so
    it can be used inside ``torch.func`` transforms and meta-learning; detach
    parameters once (as :func:`functopk.nn.functionalize` does) to avoid growing
    an autograd graph across steps.

    Raises:
        TypeError: a tree is an iterator (pass ``dict(model.named_parameters())``),
            or a leaf with an update is not a floating-point tensor (an integer or
            bool parameter would silently truncate the update); names the leaf.
        ValueError: the structures, a shape or a device differ; names the leaf.

    Example:
        >>> import torch, functopk as ft
        >>> ft.apply_updates({"w": torch.ones(2), "frozen": torch.ones(1)},
        ...                  {"w": torch.tensor([0.5, -1.0]), "frozen": None})
        {'w': tensor([1.5000, 0.0000]), 'frozen': tensor([1.])}
    """
    p_leaves, pairs, treedef = paired_leaves(params, updates, in_place=False)
    out = list(p_leaves)
    if pairs:
        new = torch._foreach_add([p_leaves[i] for i, _ in pairs], [u for _, u in pairs])
        for (i, _), x in zip(pairs, new):
            out[i] = x
    return optree.tree_unflatten(treedef, out)


def apply_updates_(params: Params, updates: Updates) -> Params:
    """In place: add ``updates`` into the tensors of ``params`` and return ``params``.

    The eager-mode fast path: one ``torch._foreach_add_`` into the existing
    parameter storage, no new parameter tensors. **Mutates** ``params`` (under
    ``torch.no_grad``, so ``nn.Parameter`` leaves are fine). Updates are cast to
    the parameters' dtypes; ``None`` updates leave their parameter alone.

    All or nothing: every leaf is checked as for :func:`apply_updates`, and
    each parameter for writability (not an inference tensor, no elements that
    share memory as in ``torch.zeros(3).expand(2, 3)``, no memory shared with
    another leaf), before any leaf is written; a failed call changes nothing.

    Raises:
        TypeError, ValueError: as :func:`apply_updates`; ``ValueError`` for a
            parameter that cannot be written in place.

    Example:
        >>> import torch, functopk as ft
        >>> params = {"w": torch.ones(2)}
        >>> ft.apply_updates_(params, {"w": torch.tensor([0.5, -1.0])})["w"]
        tensor([1.5000, 0.0000])
        >>> params["w"]
        tensor([1.5000, 0.0000])
    """
    p_leaves, pairs, _ = paired_leaves(params, updates, in_place=True)
    if pairs:
        with torch.no_grad():
            torch._foreach_add_([p_leaves[i] for i, _ in pairs], [u for _, u in pairs])
    return params
