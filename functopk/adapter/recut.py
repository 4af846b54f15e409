"""Re-cutting a transformation's state when the set of parameters with gradients changes (``TorchOptimizer``).

A state built for one parameter tree holds *per-parameter subtrees* (shaped like
the tree) and other leaves (step counts). :func:`remap` re-cuts it for another
tree: parameters it covers keep their entries, new ones take fresh ``init``
values; other leaves are kept (and must be the same kind in both).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import optree
import torch

from functopk._checks import describe
from functopk.adapter.per_param import part_of
from functopk.base import OptState
from functopk.tree.maths import PyTree

__all__ = ["LastStepParams", "make_tree", "param_names", "remap", "same_ptree", "saved_names"]


def param_names(groups: list[dict[str, Any]]) -> list[str] | None:
    """All parameter names in group order, or ``None`` when the parameters have no names.

    Raises:
        ValueError: a name appears twice.
    """
    if not all("param_names" in g for g in groups):
        return None
    names = [n for g in groups for n in g["param_names"]]
    seen: set[str] = set()
    for name in names:
        if name in seen:
            raise ValueError(f"parameter name {name!r} appears twice in the param groups; names must be unique")
        seen.add(name)
    return names


def saved_names(groups: list[dict[str, Any]], saved: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``groups`` with the names a checkpoint's groups carry (a load replaces them, as in ``torch.optim``)."""
    return [{**g, "param_names": s["param_names"]} if "param_names" in s else g for g, s in zip(groups, saved)]


def make_tree(values: list[Any], names: list[str] | None) -> PyTree:
    """The tree of ``values``: a dict by parameter name when there are names, else a list in group order."""
    return dict(zip(names, values)) if names is not None else list(values)


class LastStepParams(NamedTuple):
    """The parameters, gradient mask and names of the last full step: when they recur, no re-cut is needed."""

    slots: tuple[torch.Tensor, ...]
    mask: tuple[bool, ...]
    names: list[str] | None

    def fits(self, slots: list[torch.Tensor], mask: tuple[bool, ...], names: list[str] | None) -> bool:
        """Whether a step on ``slots`` with this gradient ``mask`` and ``names`` sees the same parameters."""
        return (
            mask == self.mask
            and names == self.names
            and len(slots) == len(self.slots)
            and all(a is b for a, b in zip(slots, self.slots))
        )


def same_ptree(a: PyTree, b: PyTree) -> bool:
    """Same structure and the very same parameter objects at the same places."""
    la, da = optree.tree_flatten(a, none_is_leaf=True)
    lb, db = optree.tree_flatten(b, none_is_leaf=True)
    return da == db and all(x is y for x, y in zip(la, lb))


def _param_parts(state: OptState, ptree: PyTree) -> tuple[list[Any], optree.PyTreeSpec, list[bool]]:
    """Flatten ``state`` down to its subtrees shaped like ``ptree`` (per-parameter state) and other leaves."""
    is_part = part_of(ptree)
    parts, skeleton = optree.tree_flatten(state, is_leaf=is_part)
    return parts, skeleton, [is_part(x) for x in parts]


def remap(state: OptState, ptree: PyTree, target: PyTree, other: OptState | None = None) -> OptState:
    """``state`` (built for parameter tree ``ptree``) re-cut for parameter tree ``target``.

    Per-parameter subtrees (those shaped like ``ptree``) take each parameter's
    entry from ``state`` if it has one, else from ``other``, a state built for
    ``target``. Other leaves (step counts, hyperparameters) come from ``state``;
    when ``other`` is given they must have the same shapes and dtypes there,
    else the transformation keeps state sized by the parameter set and cannot be
    re-cut (``ValueError``).
    """
    parts, skeleton, is_part = _param_parts(state, ptree)
    other_parts = None
    if other is not None:
        other_parts, other_skeleton, other_is_part = _param_parts(other, target)
        if other_skeleton != skeleton or other_is_part != is_part:
            raise ValueError(_CANNOT_RECUT + f" (state structure {skeleton} would need to be {other_skeleton})")
    p_leaves = optree.tree_leaves(ptree)
    t_leaves, t_spec = optree.tree_flatten(target, none_is_leaf=True)
    out = []
    for i, (part, per_param) in enumerate(zip(parts, is_part)):
        if not per_param:
            if other_parts is not None and not _same_kind(part, other_parts[i]):
                raise ValueError(
                    _CANNOT_RECUT
                    + f" (a state leaf is {describe(part)} but would need to be {describe(other_parts[i])})"
                )
            out.append(part)
            continue
        have = {id(p): v for p, v in zip(p_leaves, optree.tree_leaves(part))}
        if other_parts is not None:
            have_other = {id(p): v for p, v in zip(optree.tree_leaves(target), optree.tree_leaves(other_parts[i]))}
        else:
            have_other = {}
        values = [None if p is None else have[id(p)] if id(p) in have else have_other[id(p)] for p in t_leaves]
        out.append(optree.tree_unflatten(t_spec, values))
    return optree.tree_unflatten(skeleton, out)


_CANNOT_RECUT = (
    "the set of parameters with gradients changed, but the transformation keeps state sized by the whole "
    "parameter set, so its state cannot be carried over to the new set; give the same parameters a gradient at "
    "every step (e.g. zero_grad(set_to_none=False)) and freeze parameters (no gradient) from the first step"
)


def _same_kind(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and a.dtype == b.dtype
    return type(a) is type(b)
