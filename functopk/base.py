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

from collections.abc import Callable
from typing import Any, NamedTuple, Protocol, Union

import torch

from functopk.tree import PyTree

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
    """The state of a transformation that keeps none."""


def identity() -> GradientTransformation:
    """The transformation that returns its updates unchanged."""

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
        >>> halve = ft.stateless(lambda u, p: ft.tree_scale(u, 0.5))
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
