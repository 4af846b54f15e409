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

**Pickling.** ``init`` and ``update`` are closures, which pickle cannot
serialize; so every public factory is decorated with :func:`recorded`: the
transformation it returns remembers the call that built it, pickles as that call
(factory, arguments) and unpickles by making it again. Nested transformations
(``chain(topk(k), sgd(lr))``) pickle recursively. What cannot be pickled (a
lambda or local function among the arguments, a transformation built by hand)
raises ``TypeError`` naming it. ``copy.deepcopy`` rebuilds a recorded
transformation from deep copies of its arguments and returns any other one as it
is (two functions; a transformation keeps no state of its own).
"""

from __future__ import annotations

import copy
import functools
import inspect
import types
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol, TypeVar, Union

import optree
import torch

from functopk.tree.maths import PyTree

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
    "recorded",
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

    def __reduce__(self) -> Any:
        # Only a Recorded transformation knows how to rebuild itself; pickle would fail on the closures.
        raise TypeError(
            f"cannot pickle this GradientTransformation (init {_describe_function(self.init)}): it records no "
            "recipe, and pickle cannot serialize its functions. Transformations made by functopk's factories "
            "(ft.sgd, ft.topk, ft.chain, ...) pickle; for your own, build it in a module-level factory decorated "
            "with functopk.base.recorded"
        )

    def __copy__(self) -> GradientTransformation:
        return self  # immutable: two functions

    def __deepcopy__(self, memo: dict[int, Any]) -> GradientTransformation:
        return self  # two functions (atomic for deepcopy) and no state of its own


def _describe_function(fn: Any) -> str:
    """``module.qualname`` (with file and line for a lambda or local function) of ``fn``."""
    name = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', type(fn).__name__)}"
    code = getattr(fn, "__code__", None)
    return name if code is None else f"{name}, defined at {code.co_filename}:{code.co_firstlineno}"


def _unpicklable(value: Any, path: str) -> tuple[str, Any] | None:
    """The first lambda or local function inside ``value`` (containers and partials searched), with its path.

    Transformations are not searched: each reports its own arguments when pickled.
    """
    if isinstance(value, GradientTransformation):
        return None
    if isinstance(value, types.FunctionType):
        local = "<lambda>" in value.__qualname__ or "<locals>" in value.__qualname__
        return (path, value) if local else None
    if isinstance(value, functools.partial):
        parts = [(value.func, ".func"), *((a, f".args[{i}]") for i, a in enumerate(value.args))]
        parts += [(v, f".keywords[{k!r}]") for k, v in value.keywords.items()]
        return next((hit for v, suffix in parts if (hit := _unpicklable(v, path + suffix))), None)
    if isinstance(value, (list, tuple)):
        return next((hit for i, v in enumerate(value) if (hit := _unpicklable(v, f"{path}[{i}]"))), None)
    if isinstance(value, dict):
        return next((hit for k, v in value.items() if (hit := _unpicklable(v, f"{path}[{k!r}]"))), None)
    return None


def _build(factory: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Call ``factory`` again: how a recorded transformation is unpickled."""
    return factory(*args, **kwargs)


Recipe = tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]
"""``(factory, args, kwargs)``: the call that made a recorded object."""


def _reduce_recipe(recipe: Recipe) -> tuple[Callable[..., Any], Recipe]:
    """What pickle stores for a recorded object: the call again; ``TypeError`` naming an argument it cannot save."""
    factory, args, kwargs = recipe
    try:
        bound = inspect.signature(factory).bind(*args, **kwargs).arguments
    except (TypeError, ValueError):
        bound = {**{f"args[{i}]": a for i, a in enumerate(args)}, **kwargs}
    hit = next((h for name, v in bound.items() if (h := _unpicklable(v, name))), None)
    if hit is not None:
        raise TypeError(
            f"cannot pickle what {factory.__qualname__}(...) made: its argument {hit[0]} is the lambda or local "
            f"function {_describe_function(hit[1])}, which pickle cannot serialize (it saves functions by their "
            "module-level name). Define it with def at module level"
        )
    return _build, recipe


def _recipe_repr(recipe: Recipe) -> str:
    factory, args, kwargs = recipe
    return f"{factory.__qualname__}({', '.join([*map(repr, args), *(f'{k}={v!r}' for k, v in kwargs.items())])})"


class Recorded(GradientTransformation):
    """A transformation that remembers the call that built it (``recipe``), so that it can be pickled.

    Made by the factories decorated with :func:`recorded`; behaves exactly as a
    :class:`GradientTransformation` (the same tuple of two functions).
    """

    recipe: Recipe

    def __reduce__(self) -> Any:
        recipe = self.__dict__.get("recipe")
        if recipe is None:  # made by _replace/_make: a plain transformation
            return super().__reduce__()
        return _reduce_recipe(recipe)

    def __deepcopy__(self, memo: dict[int, Any]) -> GradientTransformation:
        recipe = self.__dict__.get("recipe")
        if recipe is None:
            return self
        factory, args, kwargs = recipe
        return _build(factory, copy.deepcopy(args, memo), copy.deepcopy(kwargs, memo))

    def __repr__(self) -> str:
        recipe = self.__dict__.get("recipe")
        return super().__repr__() if recipe is None else _recipe_repr(recipe)


class RecordedFunction:
    """A function (a schedule) that remembers the call that built it, so that it can be pickled."""

    __slots__ = ("fn", "recipe")

    def __init__(self, fn: Callable[..., Any], recipe: Recipe) -> None:
        self.fn, self.recipe = fn, recipe

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    def __reduce__(self) -> Any:
        return _reduce_recipe(self.recipe)

    def __copy__(self) -> RecordedFunction:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> RecordedFunction:
        return self  # a pure function of its arguments

    def __repr__(self) -> str:
        return _recipe_repr(self.recipe)


def with_recipe(
    tx: GradientTransformation, factory: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Recorded:
    """``tx`` as a :class:`Recorded` transformation that pickles as ``factory(*args, **kwargs)``."""
    out = Recorded(tx.init, tx.update)
    out.recipe = (factory, args, kwargs)
    return out


Factory = TypeVar("Factory", bound=Callable[..., Any])


def recorded(factory: Factory) -> Factory:
    """Decorate a module-level factory of transformations (or schedules) so that what it makes can be pickled.

    A transformation it returns is a :class:`Recorded` one, a function (a
    schedule) is wrapped in a :class:`RecordedFunction`; either remembers
    ``(factory, args, kwargs)``: pickle stores that call (the factory by its
    module-level name, which the decorated function keeps) and unpickling makes
    the call again. The arguments must pickle too: numbers, tensors, recorded
    transformations and schedules, module-level functions.

    Example:
        >>> import pickle, torch, functopk as ft
        >>> tx = pickle.loads(pickle.dumps(ft.chain(ft.topk(1), ft.sgd(0.5))))
        >>> tx
        chain(topk(1), sgd(0.5))
        >>> tx.update({"w": torch.tensor([1.0, -4.0])}, tx.init({"w": torch.zeros(2)}))[0]["w"][1]
        tensor(2.)
    """

    @functools.wraps(factory)
    def build(*args: Any, **kwargs: Any) -> Any:
        made = factory(*args, **kwargs)
        if isinstance(made, GradientTransformation):
            return with_recipe(made, build, args, kwargs)
        return RecordedFunction(made, (build, args, kwargs)) if callable(made) else made

    return build  # type: ignore[return-value]


class EmptyState(NamedTuple):
    """The state of a transformation that keeps none.

    Example:
        >>> import functopk as ft
        >>> ft.scale(2.0).init(None)
        EmptyState()
    """


@recorded
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


@recorded
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
