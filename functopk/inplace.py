"""The in-place engine: :func:`update_`, and the step planner the ``torch.optim`` adapter runs too.

``params, opt_state = ft.update_(tx, grads, opt_state, params)`` does what

.. code-block:: python

    updates, opt_state = tx.update(grads, opt_state, params)
    params = ft.apply_updates(params, updates)

does, bit for bit, but writes the new state into ``opt_state``'s tensors and
the new parameters into ``params``' tensors (as JAX's buffer donation lets XLA
do), and returns those same objects. The pure API is unchanged and stays pure.

How it works. A transformation may have an in-place *stage*, found from its
``update`` (:func:`register_inplace`): every transformation written with a
``formula`` (:func:`functopk.leafwise`: the optimizers' one writing of their
maths, which takes a writer, :mod:`functopk.tree.writer`) has one, made by
``leafwise``; so do :func:`functopk.chain` (its parts), a constant exact
:func:`functopk.topk` (its kept buffer, below) and the stateless transformations.
``stage(grads, state, params, treedef)`` checks that the state's tensors can take
the step (dense, float32 or float64, each like its parameter; Python-number
hyperparameters where a state kernel takes them) and returns a :class:`Planned`
step, or ``None`` where it cannot (the pure update then runs). A planned
formula step runs the formula with the in-place writer: the same kernels in the
same order with the same scalars, the state's old tensors as their outputs.

:func:`plan_step` splits a transformation (a chain's parts, flattened) into a
head that runs purely and the longest tail of parts with stages, runs the head
and checks everything; :func:`run_step` then writes: the tail's steps, and, on
CPU, the last ones whose formulas run on slices (``Formula.sliced``) together
with the add into the parameters, batch by batch (:mod:`functopk.tree.chunked`:
no update tree, temporaries of at most ``chunked.CHUNK`` elements, the same
numbers). On an accelerator every step runs over all leaves at once, a foreach
kernel per operation. :func:`update_` then copies the head's new states (and
the tail's new step counts) into the old tensors; the ``torch.optim`` adapter
keeps them as its new state instead.

A part after a top-k is told its input is mostly zero (``mostly_zero``: Adam
skips ``sqrt``'s slow path for zeros, same bits); a constant exact top-k in the
tail writes its selection into a flat buffer kept between steps, re-zeroed at
the last step's indices, not into a new dense tree.

Aliasing rules:

* ``params`` and ``opt_state`` are donated: their tensors are overwritten and
  the returned objects are the ones passed in. Keep no other reference that
  expects the old values (clone first if you need them).
* ``grads`` is never written.
* No written tensor may share memory with another written tensor or with a
  gradient: a parameter that is also a state tensor (``opt_state`` built with
  ``init`` returning the parameters themselves) or ``grads is params`` raises
  ``ValueError`` naming the leaf, as does a parameter that refuses an in-place
  write (an inference tensor, an expanded view).
* All or nothing: every check (and the pure part of the computation) runs
  before the first write, so a call that raises leaves ``params`` and
  ``opt_state`` as they were.
* Eager only (in place under ``torch.no_grad``): inside ``torch.func`` and
  ``torch.compile`` use the pure update (inductor reuses buffers itself).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import optree
import torch

from functopk._checks import path_str
from functopk._overlap import check_writable
from functopk.base import EmptyState, GradientTransformation, OptState, Params, Updates, check_transformation
from functopk.tree import chunked
from functopk.tree.writer import EXACT_DTYPES, IN_PLACE, IN_PLACE_SPARSE, Writer, in_place, like
from functopk.update import paired_leaves

__all__ = [
    "STATELESS", "Body", "Planned", "Sliced", "Stage", "Step", "check_disjoint", "fitting", "formula_stage",
    "plan_step", "register_inplace", "run_step", "split", "stage_of", "update_",
]  # fmt: skip

Body = Callable[[Writer, list[torch.Tensor], tuple[Any, ...], "list[torch.Tensor] | None"], tuple[Any, ...]]


class Sliced(NamedTuple):
    """A planned step's elementwise maths, which may run on batches of slices (:mod:`functopk.tree.chunked`):
    ``body(writer, updates, fields, params) -> (updates, fields)`` on lists cut alike from the updates, the
    state ``fields`` (``None``: an absent optional field) and, with ``needs_params``, the parameters."""

    fields: tuple[list[torch.Tensor] | None, ...]
    body: Body
    needs_params: bool


class Planned(NamedTuple):
    """A checked in-place step: the tensors it writes, ``run(updates, writer) -> new updates``, the state after it.

    ``new_state`` holds the state's own tensors where the step writes them and new
    values elsewhere (a step count); ``sliced`` is the same step as a :class:`Sliced`
    body; ``sparse``: its output is mostly zero (the parts after it are told).
    """

    written: list[torch.Tensor]
    run: Callable[[list[torch.Tensor], Writer], list[torch.Tensor]]
    new_state: OptState
    sliced: Sliced | None = None
    sparse: bool = False


Stage = Callable[[list[torch.Tensor], Any, list[torch.Tensor], optree.PyTreeSpec], "Planned | None"]
"""``stage(updates, state, params, treedef)``: the updates' and parameters' leaves (checked alike, float32 or
float64) -> a :class:`Planned` step that writes the new state into ``state``'s tensors, or ``None``."""


class _Chained(NamedTuple):
    """The registry's mark of a :func:`functopk.chain`: its parts."""

    parts: tuple[GradientTransformation, ...]


STATELESS = "stateless"
"""The registry's mark of a transformation with an empty state whose update cannot fail on checked leaves."""

_STAGES: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


def register_inplace(tx: GradientTransformation, stage: Stage | str | tuple[GradientTransformation, ...]) -> Any:
    """Give ``tx`` an in-place form for :func:`update_` and return ``tx`` (for factories).

    ``stage`` is a :data:`Stage`, ``"stateless"`` (an empty state and an update
    that cannot fail once the leaves are checked: it is run as it is), or the
    parts of a chain. The form is found from ``tx.update``, so it survives
    :func:`functopk.base.recorded` and the factories that return ``tx`` as it is.

    Example:
        >>> import torch, functopk as ft
        >>> from functopk.inplace import register_inplace
        >>> tx = register_inplace(ft.stateless(lambda u, p: u), "stateless")
        >>> params = {"w": torch.ones(2)}
        >>> ft.update_(tx, {"w": torch.ones(2)}, tx.init(params), params)[0]["w"]
        tensor([2., 2.])
    """
    if not torch.compiler.is_compiling():  # (a factory called in a compiled step: update_ is eager only)
        _STAGES[tx.update] = _Chained(stage) if isinstance(stage, tuple) else stage
    return tx


def fitting(tree: Any, treedef: optree.PyTreeSpec, params: list[torch.Tensor]) -> list[torch.Tensor] | None:
    """The leaves of a state field if it has ``treedef`` and each leaf is a dense tensor like its parameter
    (shape, dtype float32/float64, device); else ``None``. Reads no values."""
    try:
        leaves = treedef.flatten_up_to(tree)
    except (ValueError, TypeError):
        return None
    return leaves if all(like(x, p) for x, p in zip(leaves, params)) else None  # type: ignore[return-value]


def formula_stage(
    formula: Any, state_type: type, tree_fields: tuple[str, ...], needs_params: bool, counted: bool,
    validate: Callable[..., None] | None,
) -> Stage:  # fmt: skip
    """The in-place stage of a :class:`functopk.build.Formula` (``leafwise`` registers it): the state's tree
    fields checked to fit the parameters, then ``prepare`` (whose checks raise as the pure update's), and its
    body run with the in-place writer, the state's tensors as outputs (``counted``: the step count is
    ``leafwise``'s)."""

    def stage(grads: list[torch.Tensor], old: Any, params: list[torch.Tensor], treedef: Any) -> Planned | None:
        if not formula.in_place or type(old) is not state_type:
            return None
        state: Any = old
        fields: list[list[torch.Tensor] | None] = []
        for name in tree_fields:
            tree = getattr(state, name)
            leaves = None if tree is None else fitting(tree, treedef, params)
            if tree is not None and leaves is None:
                return None
            fields.append(leaves)
        if all(f is None for f in fields) and not all(p.dtype in EXACT_DTYPES for p in params):
            return None  # (float16, bfloat16: mul_ rounds unlike mul; a field that fits has exact dtypes)
        if validate is not None:
            validate(grads, treedef, "updates")
        p = params if needs_params else None
        body, rest = formula.prepare(state._replace(**dict(zip(tree_fields, fields))), params, p)
        if counted:
            rest = {**rest, "count": state.count + 1}
        written = [t for leaves in fields for t in leaves or ()]

        def run(updates: list[torch.Tensor], writer: Writer) -> list[torch.Tensor]:
            return list(body(writer, updates, tuple(fields), p)[0])

        sliced = Sliced(tuple(fields), body, needs_params) if formula.sliced else None
        return Planned(written, run, state._replace(**rest), sliced)

    return stage


def stage_of(tx: GradientTransformation) -> Stage | None:
    """The in-place stage registered for ``tx`` (a chain's: ``None``; :func:`split` takes it apart), if any."""
    mark = _STAGES.get(tx.update)
    return mark if callable(mark) else None


class _Part(NamedTuple):
    tx: GradientTransformation
    state: OptState
    path: str  # where ``state`` sits in ``opt_state``, for messages


def _parts(tx: GradientTransformation, state: OptState, path: str) -> list[_Part]:
    """A chain's parts with their states (nested chains flattened); one part for anything else."""
    mark = _STAGES.get(tx.update)
    if isinstance(mark, _Chained) and type(state) is tuple and len(state) == len(mark.parts):
        return [p for i, (t, s) in enumerate(zip(mark.parts, state)) for p in _parts(t, s, f"{path}[{i}]")]
    return [_Part(tx, state, path)]


def _plan(part: _Part, grads: list[torch.Tensor], params: list[torch.Tensor], treedef: Any) -> Planned | None:
    mark = _STAGES.get(part.tx.update)
    if mark == STATELESS:
        if type(part.state) is not EmptyState:
            return None
        params_tree = optree.tree_unflatten(treedef, params)

        def run(updates: list[torch.Tensor], writer: Writer) -> list[torch.Tensor]:
            out = part.tx.update(optree.tree_unflatten(treedef, updates), part.state, params_tree)[0]
            return treedef.flatten_up_to(out)

        return Planned([], run, part.state)
    return mark(grads, part.state, params, treedef) if callable(mark) else None


def split(
    tx: GradientTransformation, opt_state: OptState, grads: list[torch.Tensor], params: list[torch.Tensor], treedef: Any
) -> tuple[list[_Part], list[_Part], list[Planned]]:
    """``tx``'s parts (a chain's, flattened) split into a head that runs purely and the longest tail whose
    parts all run in place, with the tail's planned steps. Writes nothing."""
    parts = _parts(tx, opt_state, "")
    plans: list[Planned] = []
    while len(plans) < len(parts):
        planned = _plan(parts[len(parts) - 1 - len(plans)], grads, params, treedef)
        if planned is None:
            break
        plans.insert(0, planned)
    cut = len(parts) - len(plans)
    return parts[:cut], parts[cut:], plans


class Step(NamedTuple):
    """A checked step, nothing written yet (:func:`plan_step`); :func:`run_step` writes it.

    Attributes:
        tx: The transformation.
        state: Its state before the step.
        parts: The parts (a chain's, flattened), each with its state.
        new_states: Each part's new state: the head's computed (pure), the tail's as its step leaves it.
        plans: The tail's planned steps.
        updates: The tail's input (the head's output leaves), or, without a tail, the pure updates' leaves.
        params: The parameters' leaves.
        adds: The indices of the parameters with an update.
        grads, treedef: The gradients' leaves, flattened up to the parameters' structure ``treedef``.
    """

    tx: GradientTransformation
    state: OptState
    parts: list[_Part]
    new_states: list[OptState]
    plans: list[Planned]
    updates: list[Any]
    params: list[Any]
    adds: list[int]
    grads: list[Any]
    treedef: optree.PyTreeSpec

    @property
    def new_state(self) -> OptState:
        """The whole state after the step: the parts' new states put back where the parts sit."""
        if len(self.parts) == 1 and not self.parts[0].path:
            return self.new_states[0]
        return _rebuilt(self.tx, self.state, iter(self.new_states))

    @property
    def sparse(self) -> bool:
        """Whether the step's output is mostly zero (its last part is a top-k's kept buffer)."""
        return bool(self.plans) and self.plans[-1].sparse


def _rebuilt(tx: GradientTransformation, state: OptState, new: Any) -> OptState:
    """``state`` with each of its parts (as :func:`_parts` finds them) replaced by the next of ``new``."""
    mark = _STAGES.get(tx.update)
    if isinstance(mark, _Chained) and type(state) is tuple and len(state) == len(mark.parts):
        return tuple(_rebuilt(t, s, new) for t, s in zip(mark.parts, state))
    return next(new)


def plan_step(
    tx: GradientTransformation, grads: Updates, opt_state: OptState, params: Params, *, in_place: bool = True,
    checked: bool = False,
) -> Step:  # fmt: skip
    """Every check of a step of ``tx`` and its pure part; nothing is written (see the module).

    ``in_place=False`` plans it all pure (its new state is then fresh, to be kept or copied in);
    ``checked``: the caller made ``params`` and ``grads``, trees of one structure (``None`` at the same
    places, a parameter taking no part), a dense tensor at every other leaf of each, each gradient shaped
    like its parameter and on its device (the adapters: ``p.grad``), so the checks of
    :func:`functopk.apply_updates` are not repeated.

    Raises:
        TypeError, ValueError: as ``tx.update`` and :func:`functopk.apply_updates` do.
    """
    if checked:  # (None an empty node: the tensors are the leaves, their states' trees have None there too)
        p_leaves, treedef = optree.tree_flatten(params)
        pairs: list[Any] = p_leaves
    else:
        p_leaves, pairs, treedef = paired_leaves(params, grads, in_place=False)  # (writability: check_disjoint)
    g_leaves: list[Any] = treedef.flatten_up_to(grads)
    fits = in_place and bool(p_leaves) and len(pairs) == len(p_leaves)
    if fits and checked:  # (a gradient's dtype may differ: torch checks ``p.grad = g``, not ``p.grad.data = g``)
        fits = all(g.dtype == p.dtype for g, p in zip(g_leaves, p_leaves))
    elif fits:  # (paired_leaves checked shapes and devices; a gradient kept in ``pairs`` has its parameter's dtype)
        fits = all(u is g and g.layout == torch.strided for (_, u), g in zip(pairs, g_leaves))
    whole = [_Part(tx, opt_state, "")]
    head, tail, plans = split(tx, opt_state, g_leaves, p_leaves, treedef) if fits else (whole, [], [])
    updates: Any = grads
    new_states = []
    for part in head:  # pure: nothing is written yet
        updates, new = part.tx.update(updates, part.state, params)
        new_states.append(new)
    u_leaves: list[Any] | None = g_leaves if not head else _leaves_like(updates, treedef, p_leaves)
    if plans and u_leaves is None:  # the pure parts changed the leaves' kind: no in-place tail after all
        for part in tail:
            updates, new = part.tx.update(updates, part.state, params)
            new_states.append(new)
        head, plans = head + tail, []
    new_states += [planned.new_state for planned in plans]
    if plans:
        assert u_leaves is not None
        return Step(tx, opt_state, head + tail, new_states, plans, u_leaves, p_leaves, [*range(len(p_leaves))],
                    g_leaves, treedef)  # fmt: skip
    leaves, pairs, full = paired_leaves(params, updates, in_place=False)  # checked before anything is written
    ups, adds = full.flatten_up_to(updates), [i for i, _ in pairs]
    return Step(tx, opt_state, head, new_states, [], ups, leaves, adds, g_leaves, treedef)


def run_step(step: Step, *, add: bool, writer: Writer = IN_PLACE) -> list[Any] | None:
    """Write ``step``: its in-place parts, and with ``add`` the updates into the parameters.

    Returns the updates' leaves, or ``None`` where they were added slice by
    slice (on CPU, the tail's last steps that have a :class:`Sliced` body, when
    ``add``). ``writer`` is the in-place writer of the tail's first part
    (``IN_PLACE_SPARSE`` for a mostly-zero input). The new states are ``step.new_states``.
    """
    plans, params = step.plans, [step.params[i] for i in step.adds]
    n = 0  # the last steps with sliced bodies, run batch by batch with the add (CPU only)
    if add and plans and plans[-1].sliced is not None and chunked.applies(params):
        while n < len(plans) and plans[len(plans) - 1 - n].sliced is not None:
            n += 1
    updates = step.updates
    with torch.no_grad():
        for planned in plans[: len(plans) - n]:
            updates = planned.run(updates, writer)
            writer = IN_PLACE_SPARSE if planned.sparse else IN_PLACE
        if n:  # (an in-place tail: every update is like its parameter)
            _sliced_add([p.sliced for p in plans[len(plans) - n :]], params, updates, writer)  # type: ignore[misc]
            return None
        if add and params:  # as apply_updates: each update cast to its parameter's dtype
            ups = [updates[i] for i in step.adds]
            torch._foreach_add_(params, [u if u.dtype == p.dtype else u.to(p.dtype) for p, u in zip(params, ups)])
    return updates


def _sliced_add(steps: list[Sliced], params: list[torch.Tensor], updates: list[torch.Tensor], writer: Writer) -> None:
    """``params += steps(updates)``, the steps' bodies composed, batch by batch (:mod:`functopk.tree.chunked`)."""
    columns = [updates, *(f for step in steps for f in step.fields if f is not None)]

    def body(scratch: Any, ps: list[torch.Tensor], u: list[torch.Tensor], *state: list[torch.Tensor]) -> list[Any]:
        w, i = in_place(writer.mostly_zero, scratch), 0  # (its temporaries in the batch's scratch rows)
        for step in steps:
            fields = []
            for f in step.fields:
                fields.append(None if f is None else state[i])
                i += f is not None
            u = step.body(w, u, tuple(fields), ps if step.needs_params else None)[0]
            w = in_place(False, scratch)
        return u

    chunked.add_(params, columns, body)


def update_(
    tx: GradientTransformation, grads: Updates, opt_state: OptState, params: Params
) -> tuple[Params, OptState]:
    """In place: one step of ``tx``, the new state written into ``opt_state`` and the new parameters into ``params``.

    The results equal, bit for bit, ``updates, s = tx.update(grads, opt_state, params)``
    then ``ft.apply_updates(params, updates)``; ``(params, opt_state)`` are returned,
    the same objects, changed. Stateful parts without an in-place form run purely
    and their new state is copied in (see :mod:`functopk.inplace` for which have
    one). **Mutates** ``params`` and ``opt_state``; never ``grads``. All checks
    run before the first write: a call that raises changes nothing.

    Raises:
        TypeError, ValueError: as ``tx.update`` and :func:`functopk.apply_updates_`;
            ``ValueError`` naming the leaf when a tensor to be written shares memory
            with another one or with a gradient, or when the new state does not fit
            into the old (another structure, shape or dtype, a changed non-tensor leaf).

    Example:
        >>> import torch, functopk as ft
        >>> tx = ft.chain(ft.topk(1), ft.sgd(0.5, momentum=0.9))
        >>> params = {"w": torch.tensor([1.0, 2.0, 3.0])}
        >>> state = tx.init(params)
        >>> buffer = state[1][0].trace["w"]
        >>> params2, state2 = ft.update_(tx, {"w": torch.tensor([0.1, -4.0, 2.0])}, state, params)
        >>> params2 is params and state2 is state
        True
        >>> params["w"], buffer
        (tensor([1., 4., 3.]), tensor([ 0., -4.,  0.]))
    """
    check_transformation(tx, "tx")
    step = plan_step(tx, grads, opt_state, params)
    copies = [c for part, new in zip(step.parts, step.new_states) for c in _copies(part.state, new, part.path)]
    check_disjoint(step, [o for o, _, _ in copies], step.grads, step.treedef, [c[2] for c in copies])
    run_step(step, add=True)
    with torch.no_grad():
        for old, new, _ in copies:
            old.copy_(new)
    return params, opt_state


def _leaves_like(updates: Any, treedef: optree.PyTreeSpec, params: list[torch.Tensor]) -> list[torch.Tensor] | None:
    """The updates' leaves if they have the parameters' structure and each is like its parameter, else ``None``."""
    if optree.tree_structure(updates, none_is_leaf=treedef.none_is_leaf) != treedef:
        return None
    leaves = treedef.flatten_up_to(updates)
    return leaves if all(like(u, p, exact=False) for u, p in zip(leaves, params)) else None  # type: ignore[return-value]


def _copies(old: OptState, new: OptState, path: str) -> list[tuple[torch.Tensor, torch.Tensor, str]]:
    """``(old tensor, new value, path)`` for each state leaf that changed; ``ValueError`` where one cannot be
    written in place (another structure, a tensor of another shape, dtype or device, a changed non-tensor).
    Tuples (named or not) are compared field by field, so the fields an in-place step kept (its tree
    fields, the state's own tensors) are never flattened: a step costs the changed fields only."""
    if new is old:
        return []
    if type(new) is type(old) and (type(old) is tuple or optree.is_namedtuple_instance(old)) and len(new) == len(old):
        return [c for i, (o, n) in enumerate(zip(old, new)) for c in _copies(o, n, f"{path}[{i!r}]")]
    paths, old_leaves, old_def = optree.tree_flatten_with_path(old, none_is_leaf=True)
    new_leaves, new_def = optree.tree_flatten(new, none_is_leaf=True)
    if old_def != new_def:
        raise ValueError(
            f"update_: the new state at {path} has another structure than the old ({old_def} -> {new_def}), "
            "so it cannot be written into it; use tx.update"
        )
    out = []
    for sub, o, n in zip(paths, old_leaves, new_leaves):
        if n is o:
            continue
        where = "opt_state" + path + (path_str(sub) if sub else "")
        if not isinstance(o, torch.Tensor):
            if isinstance(n, torch.Tensor) or n != o:
                raise ValueError(f"update_: the state leaf at {where} ({o!r}) is no tensor and changed; use tx.update")
            continue
        if not isinstance(n, torch.Tensor) or (n.shape, n.dtype, n.device) != (o.shape, o.dtype, o.device):
            got = f"{tuple(n.shape)} {n.dtype} on {n.device}" if isinstance(n, torch.Tensor) else type(n).__name__
            raise ValueError(
                f"update_: the new state leaf at {where} ({got}) does not fit into the old one "
                f"({tuple(o.shape)} {o.dtype} on {o.device}); use tx.update"
            )
        out.append((o, n, where))
    return out


def check_disjoint(
    step: Step,
    others: list[torch.Tensor],
    g_leaves: list[Any],
    treedef: optree.PyTreeSpec,
    names: list[str] | None = None,
) -> None:
    """``ValueError`` naming a tensor to be written that cannot be (an inference tensor, an expanded view), or
    that overlaps another written tensor or a gradient: the parameters with updates, the tail's state tensors,
    ``others`` (tensors the caller writes, named by ``names``). Leaf paths are built only for a message."""
    params = [step.params[i] for i in step.adds]
    written = [t for planned in step.plans for t in planned.written]
    grads = [i for i, g in enumerate(g_leaves) if isinstance(g, torch.Tensor) and not g.is_inference()]
    # (an inference tensor can be read, not written: a gradient that is one is not checked)
    tensors = [*params, *written, *others, *(g_leaves[i] for i in grads)]

    def where(k: int) -> str:
        if k < len(params):
            return f"params{path_str(treedef.paths()[step.adds[k]])}"
        k -= len(params)
        if k < len(written):
            return "opt_state (a tensor the in-place step writes)"
        k -= len(written)
        if k < len(others):
            return names[k] if names else "opt_state"
        return f"grads{path_str(treedef.paths()[grads[k - len(others)]])}"

    check_writable(tensors, "update_'s input", where)
