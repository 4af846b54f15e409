"""Combinators: transformations built from other transformations.

``chain``/``named_chain`` compose in sequence; ``masked`` and ``partition`` send
different parameters to different transformations. The last two hand each inner
transformation the *sub-tree* of its parameters: the same tree with every other
leaf replaced by ``None`` (an empty node for optree), so the inner state holds
tensors for its own leaves only and the inner transformation never sees the rest.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from typing import Any, NamedTuple, Union

import optree
import torch

from functopk._checks import check_state, check_tree, describe, first_difference, path_str
from functopk.base import GradientTransformation, OptState, Params, Updates, check_transformation, recorded
from functopk.inplace import register_inplace
from functopk.tree.maths import PyTree, flatten_like

__all__ = ["MaskOrFn", "MaskedState", "chain", "masked", "named_chain", "partition", "resolve_mask"]

MaskOrFn = Union[PyTree, Callable[[PyTree], PyTree]]
"""A tree of Python bools shaped like the parameters, or a function ``params -> such a tree``."""


def resolve_mask(mask: MaskOrFn, tree: PyTree, *, name: str = "mask") -> list[bool]:
    """The mask's Python bools in the flat order of ``tree``'s leaves.

    Args:
        mask: A tree of bools with ``tree``'s structure, or a function ``tree -> such a tree``.
        tree: The parameters (or updates) the mask refers to.
        name: The argument name for error messages.

    Raises:
        ValueError: if the mask's structure differs from the tree's.
        TypeError: if a mask leaf is not a Python bool.
    """
    treedef, flags = _per_leaf(mask, tree, name)
    for path, flag in zip(treedef.paths(), flags):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} leaf at {path_str(path)} must be a Python bool, got {describe(flag)}")
    return flags


def _per_leaf(spec: PyTree, tree: PyTree, name: str) -> tuple[optree.PyTreeSpec, list[Any]]:
    """``tree``'s structure and the values of ``spec`` (a tree, or a function of ``tree``) at its leaves.

    ``ValueError`` naming the first differing leaf path when ``spec`` is not shaped like ``tree``.
    """
    if callable(spec):
        spec = spec(tree)
    treedef = optree.tree_structure(tree)
    try:
        return treedef, treedef.flatten_up_to(spec)
    except (ValueError, TypeError) as err:
        raise ValueError(
            f"{name} must have the structure of the parameters: "
            f"{first_difference(treedef, optree.tree_structure(spec))}"
        ) from err


def _wrong_state(owner: str, expected: str, got: str) -> TypeError:
    return TypeError(
        f"state must be {expected} (the state {owner}'s init returns), got {got}; was it made by a different "
        "transformation, or by a combinator with other members?"
    )


@recorded
def chain(*transforms: GradientTransformation) -> GradientTransformation:
    """Apply transformations one after another; the state is the tuple of their states.

    Args:
        *transforms: The transformations, in the order they act on the updates.

    Example:
        >>> import torch, functopk as ft
        >>> tx = ft.chain(ft.topk(2), ft.sgd(learning_rate=0.1))
        >>> state = tx.init({"w": torch.zeros(4)})
        >>> updates, state = tx.update({"w": torch.tensor([1.0, -3.0, 2.0, 0.5])}, state)
        >>> updates["w"]
        tensor([-0.0000,  0.3000, -0.2000, -0.0000])
    """
    for i, tx in enumerate(transforms):
        check_transformation(tx, f"transforms[{i}]")

    def init(params: Params) -> tuple[OptState, ...]:
        check_tree(params, "params")
        return tuple(tx.init(params) for tx in transforms)

    def update(
        updates: Updates, state: tuple[OptState, ...], params: Params | None = None
    ) -> tuple[Updates, tuple[OptState, ...]]:
        check_tree(updates, "updates")
        if type(state) is not tuple or len(state) != len(transforms):
            got = f"a tuple of {len(state)}" if type(state) is tuple else type(state).__name__
            raise _wrong_state("chain", f"a tuple of {len(transforms)} states, one per chained transformation", got)
        new_state = []
        for tx, s in zip(transforms, state):
            updates, s = tx.update(updates, s, params)
            new_state.append(s)
        return updates, tuple(new_state)

    return register_inplace(GradientTransformation(init, update), transforms)


@recorded
def named_chain(*transforms: tuple[str, GradientTransformation]) -> GradientTransformation:
    """Like :func:`chain`, but the state is a dict keyed by the given names.

    Named states are easier to read and to address in checkpoints.

    Args:
        *transforms: ``(name, transformation)`` pairs; names must be distinct strings.

    Example:
        >>> import torch, functopk as ft
        >>> tx = ft.named_chain(("sparsify", ft.topk(1)), ("sgd", ft.sgd(0.1, momentum=0.9)))
        >>> sorted(tx.init({"w": torch.zeros(3)}))
        ['sgd', 'sparsify']
    """
    names = []
    for i, item in enumerate(transforms):
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)):
            raise TypeError(f"transforms[{i}] must be a (name: str, transformation) pair, got {item!r}")
        check_transformation(item[1], f"transforms[{i}][1]")
        names.append(item[0])
    if len(set(names)) != len(names):
        raise ValueError(f"named_chain names must be distinct, got {names}")

    def init(params: Params) -> dict[str, Any]:
        check_tree(params, "params")
        return {name: tx.init(params) for name, tx in transforms}

    def update(
        updates: Updates, state: dict[str, Any], params: Params | None = None
    ) -> tuple[Updates, dict[str, Any]]:
        check_tree(updates, "updates")
        if not isinstance(state, dict) or set(state) != set(names):
            got = f"a dict with keys {sorted(map(str, state))}" if isinstance(state, dict) else type(state).__name__
            raise _wrong_state("named_chain", f"a dict with keys {sorted(names)}", got)
        new_state = {}
        for name, tx in transforms:
            updates, new_state[name] = tx.update(updates, state[name], params)
        return updates, new_state

    return GradientTransformation(init, update)


def _subtree(treedef: optree.PyTreeSpec, leaves: list[Any], keep: list[bool]) -> PyTree:
    """The tree with the leaves where ``keep`` is False replaced by ``None``."""
    return optree.tree_unflatten(treedef, [x if k else None for x, k in zip(leaves, keep)])


def _sub_leaves(treedef: optree.PyTreeSpec, sub: PyTree, keep: list[bool], name: str) -> list[Any]:
    """The leaves of an inner transformation's output, in the full tree's leaf positions."""
    try:
        leaves = treedef.flatten_up_to(sub)
    except (ValueError, TypeError) as err:
        raise ValueError(f"{name} returned updates whose structure does not fit the parameters: {err}") from err
    for leaf, k in zip(leaves, keep):
        if k and not isinstance(leaf, torch.Tensor):
            raise ValueError(f"{name} returned {type(leaf).__name__} for a leaf it was given; expected a tensor")
    return leaves


def _flatten_pair(updates: Updates, params: Params | None) -> tuple[list[Any], optree.PyTreeSpec, list[Any] | None]:
    """The leaves of ``updates``, its structure, and the leaves of ``params`` (``None`` if not given), checked alike."""
    leaves, treedef = optree.tree_flatten(check_tree(updates, "updates"))
    if params is None:
        return leaves, treedef, None
    return leaves, treedef, flatten_like(check_tree(params, "params"), treedef, "params", "updates")


class MaskedState(NamedTuple):
    """State of :func:`masked`: the inner transformation's state, built on the masked sub-tree."""

    inner_state: OptState


@recorded
def masked(inner: GradientTransformation, mask: MaskOrFn) -> GradientTransformation:
    """Apply ``inner`` to the leaves where ``mask`` is True; pass the others through unchanged.

    ``inner`` sees (and keeps state for) only the selected leaves: its ``init``
    and ``update`` get the parameter and update trees with the unselected leaves
    replaced by ``None``.

    Args:
        inner: The transformation for the selected leaves.
        mask: A tree of Python bools with the parameters' structure, or a function
            ``tree -> such a tree``; the function is called on ``params`` (on the
            updates when ``params`` is not given) and should depend on structure and
            shapes only (reading tensor values would be a host sync).

    Example:
        >>> import torch, functopk as ft
        >>> tx = ft.masked(ft.scale(10.0), {"w": True, "b": False})
        >>> params = {"w": torch.ones(2), "b": torch.ones(1)}
        >>> tx.update(params, tx.init(params), params)[0]
        {'w': tensor([10., 10.]), 'b': tensor([1.])}
    """
    check_transformation(inner, "inner")
    if not callable(mask):
        optree.tree_structure(mask)

    def init(params: Params) -> MaskedState:
        leaves, treedef = optree.tree_flatten(check_tree(params, "params"))
        keep = resolve_mask(mask, params)
        return MaskedState(inner.init(_subtree(treedef, leaves, keep)))

    def update(updates: Updates, state: MaskedState, params: Params | None = None) -> tuple[Updates, MaskedState]:
        check_state(state, MaskedState, "masked")
        leaves, treedef, p_leaves = _flatten_pair(updates, params)
        keep = resolve_mask(mask, updates if params is None else params)
        sub_params = None if p_leaves is None else _subtree(treedef, p_leaves, keep)
        sub_updates, inner_state = inner.update(_subtree(treedef, leaves, keep), state.inner_state, sub_params)
        new = _sub_leaves(treedef, sub_updates, keep, "masked's inner transformation")
        out = [n if k else x for x, n, k in zip(leaves, new, keep)]
        return optree.tree_unflatten(treedef, out), MaskedState(inner_state)

    return GradientTransformation(init, update)


LabelsOrFn = Union[PyTree, Callable[[PyTree], PyTree]]
"""A tree of labels shaped like the parameters, or a function ``params -> such a tree``."""


def _resolve_labels(labels: LabelsOrFn, tree: PyTree, known: Mapping[Hashable, Any]) -> list[Hashable]:
    treedef, flat = _per_leaf(labels, tree, "param_labels")
    for path, label in zip(treedef.paths(), flat):
        if label is None or not isinstance(label, Hashable) or label not in known:
            raise ValueError(
                f"param_labels leaf at {path_str(path)} is {label!r}, which is not a key of transforms "
                f"{sorted(map(repr, known))}"
            )
    return flat


@recorded
def partition(
    transforms: Mapping[Hashable, GradientTransformation], param_labels: LabelsOrFn
) -> GradientTransformation:
    """Send each parameter to the transformation of its label (``torch.optim`` parameter groups).

    Every leaf gets exactly one label; the transformation of that label sees the
    sub-tree of the leaves with that label (the others are ``None``) and keeps
    state for them only. The state is a dict ``label -> inner state``.

    Args:
        transforms: ``label -> transformation``.
        param_labels: A tree of labels with the parameters' structure, or a function
            ``tree -> such a tree`` (called on ``params``, or on the updates when
            ``params`` is not given; it should depend on structure, names and shapes only).

    Example:
        >>> import torch, functopk as ft
        >>> tx = ft.partition({"fast": ft.sgd(1.0), "frozen": ft.scale(0.0)},
        ...                   {"w": "fast", "b": "frozen"})
        >>> params = {"w": torch.ones(2), "b": torch.ones(1)}
        >>> tx.update(params, tx.init(params), params)[0]
        {'w': tensor([-1., -1.]), 'b': tensor([0.])}
    """
    if not isinstance(transforms, Mapping) or not transforms:
        raise TypeError(f"transforms must be a non-empty dict label -> transformation, got {transforms!r}")
    for label, tx in transforms.items():
        check_transformation(tx, f"transforms[{label!r}]")
    transforms = dict(transforms)
    if not callable(param_labels):
        optree.tree_structure(param_labels)

    def init(params: Params) -> dict[Hashable, OptState]:
        leaves, treedef = optree.tree_flatten(check_tree(params, "params"))
        labels = _resolve_labels(param_labels, params, transforms)
        return {
            label: tx.init(_subtree(treedef, leaves, [lab == label for lab in labels]))
            for label, tx in transforms.items()
        }

    def update(
        updates: Updates, state: dict[Hashable, OptState], params: Params | None = None
    ) -> tuple[Updates, dict[Hashable, OptState]]:
        if not isinstance(state, dict) or set(state) != set(transforms):
            got = f"a dict with keys {sorted(map(repr, state))}" if isinstance(state, dict) else type(state).__name__
            raise _wrong_state("partition", f"a dict with keys {sorted(map(repr, transforms))}", got)
        leaves, treedef, p_leaves = _flatten_pair(updates, params)
        labels = _resolve_labels(param_labels, updates if params is None else params, transforms)
        out = list(leaves)
        new_state = {}
        for label, tx in transforms.items():
            keep = [lab == label for lab in labels]
            sub_params = None if p_leaves is None else _subtree(treedef, p_leaves, keep)
            sub_updates, new_state[label] = tx.update(_subtree(treedef, leaves, keep), state[label], sub_params)
            new = _sub_leaves(treedef, sub_updates, keep, f"transforms[{label!r}]")
            for i, k in enumerate(keep):
                if k:
                    out[i] = new[i]
        return optree.tree_unflatten(treedef, out), new_state

    return GradientTransformation(init, update)
