"""The core types: gradient transformations, their states, and the trivial ones.

A :class:`GradientTransformation` is a pair of pure functions, in the style of
optax:

* ``init(params) -> state`` builds the state (a NamedTuple of tensors) from the
  parameters;
* ``update(updates, state, params=None) -> (updates, state)`` turns a tree of
  updates (gradients, at the start of a chain) into new updates, and returns the
  new state.

Neither function changes its arguments: both return new trees. Step counters are
0-d tensors, so a compiled training step sees the same graph at every step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol, Union

import optree
import torch

from functopk._checks import check_leaves, check_like, check_shapes, check_state, check_tree, require_params
from functopk.tree import foreach
from functopk.tree.maths import PyTree, flatten_like

__all__ = [
    "EmptyState",
    "GradientTransformation",
    "OptState",
    "Params",
    "Schedule",
    "ScalarOrSchedule",
    "TransformInitFn",
    "TransformUpdateFn",
    "Updates",
    "identity",
    "init_count",
    "leafwise",
    "stateless",
]

Params = PyTree
"""A pytree of parameter tensors."""
Updates = PyTree
"""A pytree of update (or gradient) tensors with the structure of the parameters."""
OptState = Any
"""A transformation's state: a NamedTuple (or nested tuples/dicts) of tensors."""

Schedule = Callable[[torch.Tensor], Union[torch.Tensor, float]]
"""A function of the step count (an integer 0-d tensor) returning a value."""
ScalarOrSchedule = Union[float, int, Schedule]
"""A constant, or a schedule of the step."""


class TransformInitFn(Protocol):
    """``init(params) -> state``."""

    def __call__(self, params: Params) -> OptState: ...


class TransformUpdateFn(Protocol):
    """``update(updates, state, params=None) -> (updates, state)``."""

    def __call__(
        self, updates: Updates, state: OptState, params: Params | None = None
    ) -> tuple[Updates, OptState]: ...


class GradientTransformation(NamedTuple):
    """A pure gradient transformation: an ``init`` and an ``update`` function.

    Example:
        >>> import torch, functopk as ft
        >>> tx = ft.chain(ft.topk(1), ft.sgd(learning_rate=0.5))
        >>> params = {"w": torch.tensor([1.0, 2.0, 3.0])}
        >>> state = tx.init(params)
        >>> grads = {"w": torch.tensor([0.1, -4.0, 2.0])}
        >>> updates, state = tx.update(grads, state, params)
        >>> ft.apply_updates(params, updates)["w"]
        tensor([1., 4., 3.])
    """

    init: TransformInitFn
    update: TransformUpdateFn


class EmptyState(NamedTuple):
    """The state of a transformation that keeps none.

    Example:
        >>> import functopk as ft
        >>> ft.scale(2.0).init(None)
        EmptyState()
    """


def identity() -> GradientTransformation:
    """The transformation that returns its updates unchanged.

    Example:
        >>> import torch, functopk as ft
        >>> tx = ft.identity()
        >>> tx.update({"w": torch.tensor([1.0, -2.0])}, tx.init(None))[0]
        {'w': tensor([ 1., -2.])}
    """

    def init(params: Params) -> EmptyState:
        del params
        return EmptyState()

    def update(updates: Updates, state: OptState, params: Params | None = None) -> tuple[Updates, OptState]:
        del params
        return updates, state

    return GradientTransformation(init, update)


def stateless(fn: Callable[[Updates, Params | None], Updates]) -> GradientTransformation:
    """Make a transformation from a pure function ``fn(updates, params) -> updates``.

    Example:
        >>> import torch, functopk as ft
        >>> halve = ft.stateless(lambda u, p: ft.tree.scale(u, 0.5))
        >>> halve.update({"w": torch.tensor([2.0])}, halve.init(None))[0]
        {'w': tensor([1.])}
    """
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")

    def init(params: Params) -> EmptyState:
        del params
        return EmptyState()

    def update(updates: Updates, state: OptState, params: Params | None = None) -> tuple[Updates, OptState]:
        return fn(updates, params), state

    return GradientTransformation(init, update)


def check_transformation(tx: Any, name: str) -> GradientTransformation:
    """Return ``tx`` if it is a GradientTransformation, else raise ``TypeError``."""
    if not isinstance(tx, GradientTransformation):
        raise TypeError(
            f"{name} must be a functopk.GradientTransformation (an (init, update) pair), "
            f"got {type(tx).__name__}"
        )
    return tx


def init_count(params: Params) -> torch.Tensor:
    """A fresh step counter: an int64 0-d tensor on the device of the first leaf (CPU for none)."""
    leaves = optree.tree_leaves(params)
    return torch.zeros((), dtype=torch.int64, device=leaves[0].device if leaves else "cpu")


LeafUpdateFn = Callable[[list[torch.Tensor], Any, "list[torch.Tensor] | None"], tuple[Sequence[torch.Tensor], Any]]


def leafwise(
    name: str,
    update: LeafUpdateFn,
    *,
    init: Callable[[list[torch.Tensor]], Any] | None = None,
    state: type = EmptyState,
    tree_fields: tuple[str, ...] = (),
    needs_params: bool = False,
) -> GradientTransformation:
    """Write a transformation as maths on lists of leaves: the one way functopk writes them.

    ``update(grads, state, params) -> (new_grads, new_state)`` and
    ``init(params) -> state`` see plain lists of tensors (one per leaf, in flat
    order) wherever the state holds a tree, and use the foreach maths of
    :mod:`functopk.tree.foreach`. This helper does the rest, the same way for
    every transformation:

    * flattens the trees and unflattens the results;
    * checks the state's type (``TypeError`` naming the transformation), that
      every leaf of the updates is a floating-point tensor (``TypeError``),
      that the updates (and ``params``) have the structure and, leaf by leaf,
      the shapes of the state (``ValueError`` naming the first bad leaf path;
      nothing is broadcast);
    * requires ``params`` when ``needs_params`` (``ValueError``);
    * casts each output leaf back to the dtype of its input (and each state
      leaf to its old dtype), so no leaf ever changes dtype;
    * handles the empty tree (lists are empty; the foreach maths accept that).

    Args:
        name: The transformation's name, for error messages.
        update: The leaf maths. Its ``state`` argument is the state with the
            ``tree_fields`` as lists of leaves; ``params`` is a list of leaves
            when ``needs_params``, else ``None``. It returns the new state in
            the same form.
        init: Builds the state (a ``state``) from the parameters' leaves, with
            the ``tree_fields`` as lists. ``None``: the transformation keeps
            no state (:class:`EmptyState`) and ``params`` may be ``None`` at init.
        state: The state's NamedTuple class.
        tree_fields: The names of the state's fields that hold a tree shaped
            like the parameters (a field may be ``None``, e.g. an optional buffer).
        needs_params: ``update`` needs the parameters.

    Example:
        >>> import torch, functopk as ft
        >>> from functopk.tree import foreach
        >>> def negate(grads, state, params):
        ...     return foreach.neg(grads), state
        >>> tx = ft.leafwise("negate", negate)
        >>> tx.update({"w": torch.tensor([1.0, -2.0])}, tx.init(None))[0]
        {'w': tensor([-1.,  2.])}
    """
    state_type = state

    def init_fn(params: Params) -> Any:
        if init is None:
            check_tree(params, "params")  # model.parameters() is an iterator: say so even when unused
            return EmptyState()
        if params is None and tree_fields:
            raise ValueError(f"{name} needs the parameters at init: they give its state its shapes")
        leaves, treedef = check_leaves(params, "params", floating=True)
        new = init(leaves)
        return new._replace(**{
            f: optree.tree_unflatten(treedef, getattr(new, f)) for f in tree_fields if getattr(new, f) is not None
        })

    def update_fn(updates: Updates, state: Any, params: Params | None = None) -> tuple[Updates, Any]:
        check_state(state, state_type, name)
        grads, treedef = check_leaves(updates, "updates", floating=True)
        lists = {}
        for f in tree_fields:
            tree = getattr(state, f)
            if tree is not None:
                lists[f] = check_like(tree, grads, treedef, name="updates", expected_name=f"{name}'s state ({f})")
        p = None
        if needs_params:
            p = flatten_like(require_params(params, name), treedef, "params", "updates")
            check_shapes(treedef, p, grads, name="params", expected_name="updates")
        out, new = update(grads, state._replace(**lists) if lists else state, p)
        out = foreach.keep_dtypes(out, grads)
        return optree.tree_unflatten(treedef, out), new._replace(**{
            f: optree.tree_unflatten(treedef, foreach.keep_dtypes(getattr(new, f), old)) for f, old in lists.items()
        })

    return GradientTransformation(init_fn, update_fn)
