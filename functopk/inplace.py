"""The in-place twin of a transformation's update: :func:`update_`, the optimizer state and parameters donated.

``params, opt_state = ft.update_(tx, grads, opt_state, params)`` does what

.. code-block:: python

    updates, opt_state = tx.update(grads, opt_state, params)
    params = ft.apply_updates(params, updates)

does, bit for bit, but writes the new state into ``opt_state``'s tensors and
the new parameters into ``params``' tensors (as JAX's buffer donation lets XLA
do), and returns those same objects. The pure API is unchanged and stays pure.

How it works. A transformation may carry an in-place *stage*, registered by its
factory with :func:`register_inplace`: ``stage(grads, state, params, treedef)``
checks that the state's tensors can take the step (dense, float32 or float64,
each like its parameter; Python-number hyperparameters where a kernel needs
them) and returns a :class:`Planned` step, or ``None`` where it cannot (the pure
update then runs). A planned step runs the kernels of the pure update, in the
same order and with the same scalars, with the state's old tensors as their
outputs (``lerp_``, ``mul_``, ``addcmul_``, ``add(out=)``). :func:`functopk.adam`,
:func:`functopk.adamw`, :func:`functopk.scale_by_adam`, :func:`functopk.trace`
(without dampening), :func:`functopk.scale_by_rms`, :func:`functopk.scale_by_rss`
and the stateless scalings have stages, and so do their ``torch.optim`` twins
from :func:`functopk.from_torch`; a :func:`functopk.chain` runs in place the
longest tail of its parts that have stages (so ``sgd``, ``rmsprop``, ``adagrad``,
``chain(topk(k), adam(lr))``), the parts before it purely, copying their new
states into the old tensors afterwards. Any other transformation runs purely and
its new state is copied in: the same result, not faster. On CPU, the last planned
steps that have a :class:`Sliced` body (``trace`` without dampening, a scale by a
number: ``sgd``'s momentum and learning rate) run with the add into the
parameters in one pass, slice by slice (:mod:`functopk.tree.chunked`): no update
tree, one scratch row of at most ``chunked.CHUNK`` elements, the same numbers.

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
* Eager only. It writes tensors in place under ``torch.no_grad``; inside
  ``torch.func`` transforms (``grad``, ``vmap``, ``functional_call`` with
  gradients) and ``torch.compile`` use the pure update, which is what they are
  built for (inductor reuses buffers itself).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import optree
import torch

from functopk._checks import check_writable, path_str
from functopk.base import EmptyState, GradientTransformation, OptState, Params, Updates, check_transformation
from functopk.tree import chunked
from functopk.update import paired_leaves

__all__ = ["STATELESS", "Planned", "Sliced", "Stage", "fitting", "register_inplace", "update_"]


class Sliced(NamedTuple):
    """A planned step as a slice body: ``body(scratch, updates, *state) -> updates`` on equal slices of the
    updates and of the ``state`` leaf lists (it may write the state slices and ``scratch[0]``, and returns its
    result in one of them), with ``finish()`` for what is not elementwise (a step count), run once after."""

    state: list[list[torch.Tensor]]
    body: Callable[..., torch.Tensor]
    finish: Callable[[], object]


class Planned(NamedTuple):
    """A checked in-place step: the tensors it will write, and ``run(updates) -> new updates``.

    ``sliced`` is the same step as a :class:`Sliced` body: when the last steps of a tail all have one,
    :func:`update_` runs them, and the add into the parameters, slice by slice on CPU
    (:mod:`functopk.tree.chunked`): one pass, no update tree, the same kernels.
    """

    written: list[torch.Tensor]
    run: Callable[[list[torch.Tensor]], list[torch.Tensor]]
    sliced: Sliced | None = None


Stage = Callable[[list[torch.Tensor], Any, list[torch.Tensor], optree.PyTreeSpec], "Planned | None"]
"""``stage(updates, state, params, treedef)``: the updates' and parameters' leaves (checked alike, float32 or
float64) -> a :class:`Planned` step that writes the new state into ``state``'s tensors, or ``None``."""


class _Chained(NamedTuple):
    """The registry's mark of a :func:`functopk.chain`: its parts."""

    parts: tuple[GradientTransformation, ...]


STATELESS = "stateless"
"""The registry's mark of a transformation with an empty state whose update cannot fail on checked leaves."""

_STAGES: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
_EXACT = (torch.float32, torch.float64)  # where the in-place kernels round as the out-of-place ones


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
    return leaves if all(_like(x, p) for x, p in zip(leaves, params)) else None  # type: ignore[return-value]


def _like(x: Any, p: torch.Tensor) -> bool:
    return (
        isinstance(x, torch.Tensor) and x.layout == torch.strided and x.shape == p.shape
        and x.dtype == p.dtype and x.dtype in _EXACT and x.device == p.device
    )  # fmt: skip


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

        def run(updates: list[torch.Tensor]) -> list[torch.Tensor]:
            out = part.tx.update(optree.tree_unflatten(treedef, updates), part.state, params_tree)[0]
            return treedef.flatten_up_to(out)

        return Planned([], run)
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
    p_leaves, pairs, treedef = paired_leaves(params, grads, in_place=False)  # (writability: _check_disjoint)
    g_leaves: list[Any] = treedef.flatten_up_to(grads)
    fits = bool(p_leaves) and len(pairs) == len(p_leaves) and all(map(_like, g_leaves, p_leaves))
    whole = [_Part(tx, opt_state, "")]
    head, tail, plans = split(tx, opt_state, g_leaves, p_leaves, treedef) if fits else (whole, [], [])
    updates: Any = grads
    new_states = []
    for part in head:  # pure: nothing is written yet
        updates, new = part.tx.update(updates, part.state, params)
        new_states.append(new)
    u_leaves: list[Any] | None = g_leaves if not head else _leaves_like(updates, treedef, p_leaves)
    u_leaves = u_leaves if plans else None
    if plans and u_leaves is None:  # the pure parts changed the leaves' kind: no in-place tail after all
        for part in tail:
            updates, new = part.tx.update(updates, part.state, params)
            head.append(part)
            new_states.append(new)
        plans = []
    copies = [c for part, new in zip(head, new_states) for c in _copies(part.state, new, part.path)]
    if u_leaves is not None:
        adds = list(range(len(p_leaves)))
    else:  # the pure updates, checked against the parameters before anything is written
        adds = [i for i, _ in paired_leaves(params, updates, in_place=False)[1]]
        u_leaves = treedef.flatten_up_to(updates)
    _check_disjoint([p_leaves[i] for i in adds], adds, plans, copies, g_leaves, treedef)
    _write(plans, copies, [p_leaves[i] for i in adds], adds, u_leaves)
    return params, opt_state


def _write(
    plans: list[Planned],
    copies: list[tuple[torch.Tensor, torch.Tensor, str]],
    params: list[torch.Tensor],
    adds: list[int],
    updates: list[Any],
) -> None:
    """Every write, once everything is checked: the in-place steps, the pure parts' new states, the parameters.

    On CPU the last steps that have slice bodies run with the add, slice by slice (see :class:`Planned`)."""
    n = 0
    while chunked.applies(params) and n < len(plans) and plans[len(plans) - 1 - n].sliced is not None:
        n += 1
    with torch.no_grad():
        for planned in plans[: len(plans) - n]:
            updates = planned.run(updates)
        for old, new, _ in copies:
            old.copy_(new)
        if n:  # (an in-place tail: every update is like its parameter)
            _sliced_add([p.sliced for p in plans[len(plans) - n :]], params, updates)  # type: ignore[misc]
        elif params:  # as apply_updates: each update cast to its parameter's dtype
            ups = [updates[i] if updates[i].dtype == p.dtype else updates[i].to(p.dtype) for p, i in zip(params, adds)]
            torch._foreach_add_(params, ups)


def _sliced_add(steps: list[Sliced], params: list[torch.Tensor], updates: list[torch.Tensor]) -> None:
    """``params += steps(updates)``, the steps' bodies composed, slice by slice; then each step's ``finish``."""
    cuts = [0]
    for step in steps:
        cuts.append(cuts[-1] + len(step.state))

    def body(s: list[torch.Tensor], p: torch.Tensor, u: torch.Tensor, *state: torch.Tensor) -> torch.Tensor:
        for step, a, b in zip(steps, cuts, cuts[1:]):
            u = step.body(s, u, *state[a:b])
        return u

    chunked.add_(params, [updates, *(leaves for step in steps for leaves in step.state)], body)
    for step in steps:
        step.finish()


def _leaves_like(updates: Any, treedef: optree.PyTreeSpec, params: list[torch.Tensor]) -> list[torch.Tensor] | None:
    """The updates' leaves if they have the parameters' structure and each is like its parameter, else ``None``."""
    if optree.tree_structure(updates, none_is_leaf=True) != treedef:
        return None
    leaves = treedef.flatten_up_to(updates)
    return leaves if all(_like(u, p) for u, p in zip(leaves, params)) else None  # type: ignore[return-value]


def _copies(old: OptState, new: OptState, path: str) -> list[tuple[torch.Tensor, torch.Tensor, str]]:
    """``(old tensor, new value, path)`` for each state leaf that changed; ``ValueError`` where one cannot be
    written in place (another structure, a tensor of another shape, dtype or device, a changed non-tensor)."""
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
        where = "opt_state" + path + path_str(sub)
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


def _check_disjoint(
    params: list[torch.Tensor],
    adds: list[int],
    plans: list[Planned],
    copies: list[tuple[torch.Tensor, torch.Tensor, str]],
    g_leaves: list[Any],
    treedef: optree.PyTreeSpec,
) -> None:
    """``ValueError`` naming a tensor to be written that cannot be (an inference tensor, an expanded view), or
    that overlaps another written tensor or a gradient. Leaf paths are built only for a message."""
    written = [t for planned in plans for t in planned.written]
    grads = [i for i, g in enumerate(g_leaves) if isinstance(g, torch.Tensor) and not g.is_inference()]
    # (an inference tensor can be read, not written: a gradient that is one is not checked)
    tensors = [*params, *written, *(o for o, _, _ in copies), *(g_leaves[i] for i in grads)]

    def where(k: int) -> str:
        if k < len(params):
            return f"params{path_str(treedef.paths()[adds[k]])}"
        k -= len(params)
        if k < len(written):
            return "opt_state (a tensor the in-place step writes)"
        k -= len(written)
        return copies[k][2] if k < len(copies) else f"grads{path_str(treedef.paths()[grads[k - len(copies)]])}"

    check_writable(tensors, "update_'s input", where)


