"""Writing a transformation: :func:`leafwise` for maths over the leaves, :func:`wrapper` around an inner one.

Every transformation of :mod:`functopk.compress` and :mod:`functopk.optim` is
written with one of the two (``with_mask`` and ``inject_hyperparams`` build an
inner transformation anew at each call, and are written by hand):

* :func:`leafwise` takes the leaf maths ``update(grads, state, params)`` on flat
  lists of tensors and does the rest: the tree checks (structure, shapes, dtypes,
  one device), a validation hook, the state (fields shaped like the parameters,
  or given shapes; an optional step count) and the tree around the result. An
  optimizer whose state is shaped like the parameters gives its maths as a
  :class:`Formula` instead: the one writing that the pure update, the in-place
  engine (:mod:`functopk.inplace`) and its sliced strategy all run;
* :func:`wrapper` wraps an inner transformation (error feedback, statistics,
  skipping non-finite steps, gradient accumulation): it checks the inner one and
  the state's type, and hands ``init`` the inner state.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

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
from functopk._compat import replace
from functopk.base import (
    EmptyState,
    GradientTransformation,
    OptState,
    Params,
    TransformInitFn,
    TransformUpdateFn,
    Updates,
    check_transformation,
    init_count,
    recorded,
)
from functopk.inplace import Body, formula_stage, register_inplace
from functopk.tree import foreach
from functopk.tree.maths import flatten_like
from functopk.tree.writer import FRESH

__all__ = ["Formula", "LeafCheckFn", "LeafUpdateFn", "Prepare", "WrapperUpdateFn", "leafwise", "wrapper"]


LeafUpdateFn = Callable[[list[torch.Tensor], Any, "list[torch.Tensor] | None"], tuple[Sequence[torch.Tensor], Any]]
LeafCheckFn = Callable[[list[torch.Tensor], optree.PyTreeSpec, str], None]
"""A validation hook: ``check(leaves, treedef, name)`` raises on bad leaves of the tree ``name``."""


Prepare = Callable[[Any, list[torch.Tensor], "list[torch.Tensor] | None"], tuple[Body, dict[str, Any]]]
"""``prepare(state, like, params) -> (body, rest)``: see :class:`Formula`."""


class Formula(NamedTuple):
    """An optimizer's maths written once, for every way it runs: pure, in place, on slices.

    ``prepare(state, like, params)`` does the step's scalar work once, over all
    leaves (a schedule's value, bias corrections, :func:`~functopk.tree.foreach.for_leaves`
    on ``like``, the update leaves or leaves of their dtypes; a check that raises)
    and returns ``(body, rest)``: ``rest`` the new values of the state's fields
    that are not trees (a step count), ``body(writer, updates, fields, params) ->
    (updates, fields)`` the elementwise maths, on the lists of the ``tree_fields``
    (``None`` for an absent one). ``body`` turns each old field into its new value
    through ``writer`` (:mod:`functopk.tree.writer`): :data:`~functopk.tree.writer.FRESH`
    for the pure update, the in-place writer for the engine's, which then writes
    into the state's own tensors.

    Attributes:
        prepare: As above.
        in_place: Whether the in-place writer gives the pure bits: ``False`` where a state kernel takes a
            tensor hyperparameter (a tensor ``b1``), which the in-place foreach kernels round otherwise.
        sliced: Whether ``body`` may run on batches of slices of the leaves (it reads nothing computed over
            the list, no mask by leaf position): on CPU the engine then runs it with the add into the
            parameters, batch by batch (:mod:`functopk.tree.chunked`).
    """

    prepare: Prepare
    in_place: bool = True
    sliced: bool = False


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
        return replace(new, **{
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
        out, new = update(grads, replace(state, **lists) if lists else state, p)
        if counted:
            new = replace(new, count=state.count + 1)
        out = foreach.keep_dtypes(out, grads)
        return optree.tree_unflatten(treedef, out), replace(new, **{
            f: optree.tree_unflatten(treedef, foreach.keep_dtypes(getattr(new, f), old)) for f, old in lists.items()
        })

    return update_fn


@recorded
def leafwise(
    name: str,
    update: LeafUpdateFn | None = None,
    *,
    formula: Formula | None = None,
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
        formula: Instead of ``update``, the maths as a :class:`Formula`: the pure
            update runs it with fresh outputs, and :func:`functopk.update_` (and the
            ``torch.optim`` adapter) with the state's own tensors as outputs.
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
    if (update is None) == (formula is None):
        raise TypeError(f"leafwise {name!r}: give exactly one of update and formula")
    if formula is None:
        assert update is not None
        return GradientTransformation(_leaf_init(rules, init), _leaf_update(rules, update))
    tx = GradientTransformation(_leaf_init(rules, init), _leaf_update(rules, _formula_update(rules, formula)))
    if rules.dtypes or rules.shapes:  # (leaves of chosen dtypes, fields not like their parameter: pure only)
        return tx
    return register_inplace(tx, formula_stage(formula, state, rules.tree_fields, needs_params, counted, validate))


def _formula_update(rules: _LeafRules, formula: Formula) -> LeafUpdateFn:
    """The pure leaf maths of a formula: its body with fresh outputs."""

    def update(grads: list[torch.Tensor], state: Any, params: list[torch.Tensor] | None) -> tuple[Any, Any]:
        body, rest = formula.prepare(state, grads, params)
        out, new = body(FRESH, grads, tuple(getattr(state, f) for f in rules.tree_fields), params)
        return out, state._replace(**dict(zip(rules.tree_fields, new)), **rest)

    return update


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
        >>> from functopk.build import wrapper
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
