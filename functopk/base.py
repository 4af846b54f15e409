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
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol, TypeVar, Union

import optree
import torch

from functopk._checks import (
    check_leaves,
    check_like,
    check_shapes,
    check_state,
    check_tree,
    describe,
    one_device,
    path_str,
    require_params,
)
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
    "recorded",
    "stateless",
    "wrapper",
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


LeafUpdateFn = Callable[[list[torch.Tensor], Any, "list[torch.Tensor] | None"], tuple[Sequence[torch.Tensor], Any]]
LeafCheckFn = Callable[[list[torch.Tensor], optree.PyTreeSpec, str], None]
"""A validation hook: ``check(leaves, treedef, name)`` raises on bad leaves of the tree ``name``."""


class _LeafRules(NamedTuple):
    """What :func:`leafwise` checks and does around the leaf maths (its arguments, checked)."""

    name: str
    state: type
    tree_fields: tuple[str, ...]
    needs_params: bool
    dtypes: Sequence[torch.dtype] | None
    same_device: bool
    validate: LeafCheckFn | None
    shapes: dict[str, Callable[[torch.Tensor], torch.Size]]
    counted: bool


def _flat(rules: _LeafRules, tree: Any, name: str) -> tuple[list[torch.Tensor], optree.PyTreeSpec]:
    """The leaves of ``tree`` (updates or params) under the rules: real floating (or listed) dtypes, one device."""
    leaves, treedef = check_leaves(tree, name, floating=True, dtypes=rules.dtypes)
    if rules.same_device:
        one_device(leaves, name)
    if rules.validate is not None:
        rules.validate(leaves, treedef, name)
    return leaves, treedef


def _field_leaves(
    rules: _LeafRules, field: str, grads: list[torch.Tensor], treedef: optree.PyTreeSpec, tree: Any
) -> list[torch.Tensor]:
    """State field ``field``'s leaves, checked against the updates: their structure, and each leaf's shape."""
    what = f"{rules.name}'s state ({field})"
    shape_of = rules.shapes.get(field)
    if shape_of is None:  # shaped like the update leaf
        return check_like(tree, grads, treedef, name="updates", expected_name=what)
    leaves = flatten_like(tree, treedef, what, "updates")
    for path, leaf, g in zip(treedef.paths(), leaves, grads):
        expected = shape_of(g)
        if not isinstance(leaf, torch.Tensor) or leaf.shape != expected:
            raise ValueError(
                f"{what} leaf at {path_str(path)} is {describe(leaf)}, but an update of shape {tuple(g.shape)} "
                f"needs shape {tuple(expected)} there"
            )
    return leaves


def _leaf_init(rules: _LeafRules, init: Callable[[list[torch.Tensor]], Any] | None) -> TransformInitFn:
    """``init`` of :func:`leafwise`: the state from the parameters' leaves, tree fields unflattened."""
    no_state = init is None and not rules.counted

    def init_fn(params: Params) -> Any:
        if no_state and rules.validate is None:
            check_tree(params, "params")  # model.parameters() is an iterator: say so even when unused
            return EmptyState()
        if params is None and rules.tree_fields:
            raise ValueError(f"{rules.name} needs the parameters at init: they give its state its shapes")
        leaves, treedef = _flat(rules, params, "params") if params is not None else check_leaves(params, "params")
        if init is None:
            return rules.state(count=init_count(leaves)) if rules.counted else EmptyState()
        new = init(leaves)
        return new._replace(**{
            f: optree.tree_unflatten(treedef, getattr(new, f)) for f in rules.tree_fields if getattr(new, f) is not None
        })

    return init_fn


def _leaf_update(rules: _LeafRules, update: LeafUpdateFn) -> TransformUpdateFn:
    """``update`` of :func:`leafwise`: checks, the leaf maths, dtypes kept, trees rebuilt (every step's path)."""
    name, state_type, tree_fields, counted = rules.name, rules.state, rules.tree_fields, rules.counted
    needs_params = rules.needs_params

    def update_fn(updates: Updates, state: Any, params: Params | None = None) -> tuple[Updates, Any]:
        check_state(state, state_type, name)
        grads, treedef = _flat(rules, updates, "updates")
        lists = {}
        for f in tree_fields:
            tree = getattr(state, f)
            if tree is not None:
                lists[f] = _field_leaves(rules, f, grads, treedef, tree)
        p = None
        if needs_params:
            p = flatten_like(require_params(params, name), treedef, "params", "updates")
            check_shapes(treedef, p, grads, name="params", expected_name="updates")
        out, new = update(grads, state._replace(**lists) if lists else state, p)
        if counted:
            new = new._replace(count=state.count + 1)
        out = foreach.keep_dtypes(out, grads)
        return optree.tree_unflatten(treedef, out), new._replace(**{
            f: optree.tree_unflatten(treedef, foreach.keep_dtypes(getattr(new, f), old)) for f, old in lists.items()
        })

    return update_fn


@recorded
def leafwise(
    name: str,
    update: LeafUpdateFn,
    *,
    init: Callable[[list[torch.Tensor]], Any] | None = None,
    state: type = EmptyState,
    tree_fields: tuple[str, ...] = (),
    needs_params: bool = False,
    dtypes: Sequence[torch.dtype] | None = None,
    same_device: bool = False,
    validate: LeafCheckFn | None = None,
    shapes: dict[str, Callable[[torch.Tensor], torch.Size]] | None = None,
    counted: bool = False,
) -> GradientTransformation:
    """Write a transformation as maths on lists of leaves: the one way functopk writes them.

    ``update(grads, state, params) -> (new_grads, new_state)`` and ``init(params)
    -> state`` see plain lists of tensors (one per leaf, in flat order) wherever
    the state holds a tree, and use the foreach maths of
    :mod:`functopk.tree.foreach`. This helper does the rest, the same way for
    every transformation: it flattens the trees and unflattens the results;
    checks the state's type (``TypeError`` naming the transformation), that every
    leaf of the updates (and ``params``) is a floating-point tensor (of
    ``dtypes``, on one device when ``same_device``; ``TypeError``/``ValueError``),
    runs ``validate``, checks that the updates, ``params`` and the state's tree
    fields have one structure and, leaf by leaf, the shapes the state needs
    (``ValueError`` naming the first bad leaf path; nothing is broadcast);
    requires ``params`` when ``needs_params``; casts each output leaf back to the
    dtype of its input (and each state leaf to its old dtype); handles the empty tree.

    Args:
        name: The transformation's name, for error messages.
        update: The leaf maths. Its ``state`` argument is the state with the
            ``tree_fields`` as lists of leaves; ``params`` is a list of leaves
            when ``needs_params``, else ``None`` (and not checked: a transformation
            that does not read the parameters ignores them).
            It returns the new state in the same form.
        init: Builds the state (a ``state``) from the parameters' leaves, with
            the ``tree_fields`` as lists. ``None``: the state is :class:`EmptyState`
            (or the counter, ``counted``) and ``params`` may be ``None`` at init.
        state: The state's NamedTuple class.
        tree_fields: The names of the state's fields that hold a tree shaped
            like the parameters (a field may be ``None``, e.g. an optional buffer).
        needs_params: ``update`` needs the parameters.
        dtypes: The dtypes allowed for leaves (default: every real floating dtype).
        same_device: All leaves must be on one device (``ValueError``).
        validate: ``validate(leaves, treedef, name)`` raises on bad leaves of
            ``params`` (at init, when given) and of ``updates`` (at every update).
        shapes: For a tree field whose leaves are not shaped like their update
            leaf: ``{field: shape_of}``, ``shape_of(update_leaf)`` the shape it needs.
        counted: The state is ``state(count=...)``, a 0-d int64 step counter:
            made at init and advanced after each update by this helper (``init``
            is then ``None``; the maths reads ``state.count``, the step being done).

    Example:
        >>> import torch, functopk as ft
        >>> from functopk.tree import foreach
        >>> def negate(grads, state, params):
        ...     return foreach.neg(grads), state
        >>> tx = ft.leafwise("negate", negate)
        >>> tx.update({"w": torch.tensor([1.0, -2.0])}, tx.init(None))[0]
        {'w': tensor([-1.,  2.])}
    """
    rules = _LeafRules(
        name, state, tuple(tree_fields), needs_params, dtypes, same_device, validate,
        dict(shapes or {}), counted,
    )
    return GradientTransformation(_leaf_init(rules, init), _leaf_update(rules, update))


WrapperUpdateFn = Callable[[Updates, Any, "Params | None"], tuple[Updates, Any]]


@recorded
def wrapper(
    name: str,
    inner: GradientTransformation,
    update: WrapperUpdateFn,
    *,
    init: Callable[[Params, OptState], Any],
    state: type,
    needs_params: str | None = None,
) -> GradientTransformation:
    """Write a transformation around an inner one (error feedback, a guard, accumulation): the wrappers' helper.

    ``init(params, inner_state) -> state`` gets the parameters and
    ``inner.init(params)``; ``update(updates, state, params)`` gets the whole
    trees and calls ``inner.update`` itself (on the trees it chooses). This
    helper checks, the same way for every wrapper, that ``inner`` is a
    transformation (``TypeError`` naming the argument ``inner``), that the state
    is a ``state`` (``TypeError`` naming the wrapper) and, when the state holds
    trees shaped like the parameters, that ``init`` gets them (``ValueError``
    saying ``needs_params``, why they are needed). Checks of the updates against
    the state's trees stay in ``update``: each wrapper reads other fields.

    Args:
        name: The wrapper's name, for error messages.
        inner: The wrapped transformation.
        update: The update on trees.
        init: Builds the state from the parameters and the inner state.
        state: The state's NamedTuple class.
        needs_params: Why the parameters are needed at init, or ``None`` if they are not.

    Example:
        >>> import torch, functopk as ft
        >>> from typing import NamedTuple
        >>> from functopk.base import wrapper
        >>> class CallsState(NamedTuple):
        ...     calls: torch.Tensor
        ...     inner_state: object
        >>> def update(updates, state, params):
        ...     out, inner_state = inner.update(updates, state.inner_state, params)
        ...     return out, CallsState(state.calls + 1, inner_state)
        >>> inner = ft.scale(2.0)
        >>> tx = wrapper("count_calls", inner, update, init=lambda p, s: CallsState(ft.base.init_count(p), s),
        ...              state=CallsState)
        >>> out, state = tx.update({"w": torch.tensor([1.0])}, tx.init({"w": torch.zeros(1)}))
        >>> out["w"], state.calls
        (tensor([2.]), tensor(1))
    """
    check_transformation(inner, "inner")
    state_type = state

    def init_fn(params: Params) -> Any:
        if needs_params is not None and params is None:
            raise ValueError(f"{name} needs the parameters at init: {needs_params}")
        return init(params, inner.init(params))

    def update_fn(updates: Updates, state: Any, params: Params | None = None) -> tuple[Updates, Any]:
        check_state(state, state_type, name)
        return update(updates, state, params)

    return GradientTransformation(init_fn, update_fn)
