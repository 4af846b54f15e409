"""The state of :func:`~functopk.sparse.sparse_optimizer`: :class:`SparseOptState`, its per-coordinate form, its checks.

The inner optimizer's state is kept per coordinate: every leaf a ``k``-vector,
its scalars (step counts, NAdam's ``mu_product``, ASGD's ``eta``) repeated
(:func:`per_coordinate`), step counts stored as int32 (:func:`stored`,
:func:`working`). A state class may declare fields whose values are one for
all coordinates with :func:`shared_fields` (``inject_hyperparams``'s
``hyperparams``): their leaves stay 0-d, shared by every coordinate, and a
refresh keeps them (:func:`remap`).

:func:`check_sparse_state` is what ``update`` checks of a state it is given:
everything static, before any maths (its type, the count, ``indices`` of shape
``(k,)`` for the optimizer's own ``k``, the inner state's structure, shapes and
dtypes, the score). That ``indices`` are strictly ascending and in range needs
their values: checked where the update reads them on the host anyway (eager on
CPU), not on an accelerator or when compiling, where unsorted indices give wrong results.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, TypeVar

import optree
import torch

from functopk._checks import check_like, check_state, describe, first_difference, path_str
from functopk._compat import replace, same_structure
from functopk.sparse.updates import check_ascending_indices
from functopk.tree.maths import PyTree

__all__ = [
    "SparseOptState", "check_inner", "check_sparse_state", "index_dtype", "is_shared", "per_coordinate",
    "reads_on_host", "remap", "shared_fields", "stored", "working",
]  # fmt: skip


class SparseOptState(NamedTuple):
    """State of :func:`sparse_optimizer`: ``O(k)``, plus an ``n``-sized score with ``score="accumulated"``.

    Attributes:
        count: Updates done (0-d int64 tensor).
        indices: The coordinate set ``S``: ``k`` ascending flat indices into the
            parameters (``optree.tree_leaves`` order, each leaf row-major). Before the
            first refresh, the first ``k`` coordinates.
        inner: The inner optimizer's state for the coordinates of ``S``, in
            ``indices`` order: each of its leaves is a ``k``-vector (its scalars,
            such as the step count, one per coordinate), but those of
            :func:`shared_fields` (``inject_hyperparams``'s), 0-d: one for all.
        score: With ``score="accumulated"``, ``sum |g|`` since the last refresh, a tree
            like the parameters; ``None`` otherwise.

    Example:
        >>> import torch, functopk as ft
        >>> state = ft.sparse.sparse_optimizer(ft.sgd(0.1, momentum=0.9), k=2).init({"w": torch.zeros(5)})
        >>> state.indices
        tensor([0, 1], dtype=torch.int32)
        >>> state.inner[0]
        TraceState(trace=[tensor([0., 0.])], count=tensor([0, 0], dtype=torch.int32))
    """

    count: torch.Tensor  # type: ignore[assignment]
    indices: torch.Tensor
    inner: Any
    score: PyTree | None


_SHARED: dict[type, tuple[str, ...]] = {}  # state class -> its fields of one value for all coordinates

StateClass = TypeVar("StateClass", bound=type)


def shared_fields(*fields: str) -> Callable[[StateClass], StateClass]:
    """Declare fields of a state class (a NamedTuple) that hold one value for all coordinates.

    :func:`~functopk.sparse.sparse_optimizer` keeps every other leaf of an
    inner state per coordinate (a ``k``-vector); these stay 0-d tensors shared by
    every coordinate, and a refresh keeps their current values (new coordinates
    do not restart them).

    Example:
        >>> import torch
        >>> from typing import NamedTuple
        >>> @shared_fields("scale")
        ... class ScaledState(NamedTuple):
        ...     count: torch.Tensor
        ...     scale: torch.Tensor
        >>> per_coordinate(ScaledState(torch.tensor(0), torch.tensor(0.5)), 3, "inner")
        ScaledState(count=tensor([0, 0, 0], dtype=torch.int32), scale=tensor(0.5000))
    """

    def declare(cls: StateClass) -> StateClass:
        _SHARED[cls] = tuple(fields)
        return cls

    return declare


def is_shared(node: Any) -> bool:
    """A state node with fields of one value for all coordinates (:func:`shared_fields`)."""
    return type(node) in _SHARED


def per_coordinate(state: Any, k: int, name: str) -> Any:
    """The inner state with each 0-d leaf repeated to a ``k``-vector (shared fields aside); those then ``(k,)``."""

    def widen(path: tuple[Any, ...], x: Any) -> Any:
        if is_shared(x):  # its shared fields stay as they are; the rest, per coordinate
            keep = _SHARED[type(x)]
            return replace(x, **{f: per_coordinate(getattr(x, f), k, name) for f in x._fields if f not in keep})
        if x is None:  # an absent buffer (Adam's nu_max without amsgrad); torch.compile maps over None too
            return None
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"{name}'s state holds {type(x).__name__} at {path_str(path)}; expected tensors")
        if x.dim() == 0:
            return x.expand(k).to(torch.int32 if x.dtype == torch.int64 else x.dtype)  # stored narrow: see stored
        if x.shape != (k,):
            raise ValueError(
                f"{name}'s state at {path_str(path)} has shape {tuple(x.shape)}, not one value per coordinate; "
                "it is not coordinate-wise"
            )
        return x

    return optree.tree_map_with_path(widen, state, is_leaf=is_shared, none_is_leaf=False)


def stored(state: Any) -> Any:
    """The inner state as kept between steps: int64 per-coordinate leaves (step counts) as int32, 4 bytes each."""
    return optree.tree_map(
        lambda x: x.to(torch.int32) if x is not None and x.dim() == 1 and x.dtype == torch.int64 else x,
        state,
        none_is_leaf=False,
    )


def working(state: Any) -> Any:
    """The inner state as the inner optimizer reads it: int32 per-coordinate leaves back to int64."""
    return optree.tree_map(
        lambda x: x.to(torch.int64) if x is not None and x.dim() == 1 and x.dtype == torch.int32 else x,
        state,
        none_is_leaf=False,
    )


def index_dtype(n: int) -> torch.dtype:
    """The dtype ``SparseOptState.indices`` is kept in: int32 while it holds every flat index of ``n``."""
    return torch.int32 if n <= torch.iinfo(torch.int32).max else torch.int64


def remap(old: torch.Tensor, new: torch.Tensor, state: Any, fresh: Any) -> Any:
    """The inner state for the coordinates ``new``: kept where they were in ``old``, ``fresh`` elsewhere.

    Both index sets are ascending, so one ``searchsorted`` finds each new
    coordinate's old position. Shared (0-d) leaves are the state's.
    """
    pos = torch.searchsorted(old, new).clamp_max(old.numel() - 1)
    kept = old.index_select(0, pos) == new

    def moved(s: torch.Tensor | None, f: torch.Tensor) -> torch.Tensor | None:
        if s is None or s.dim() == 0:  # a shared value (an injected learning rate): the state's, for all
            return s
        return torch.where(kept, s.index_select(0, pos), f)

    return optree.tree_map(moved, state, fresh, none_is_leaf=False)


def reads_on_host(indices: torch.Tensor) -> bool:
    """Whether the update reads ``indices`` on the host anyway (eager on CPU): checks of their values are free there."""
    return indices.device.type == "cpu" and not torch.compiler.is_compiling()


def check_inner(inner: Any, template: Any) -> None:
    """``ValueError`` naming the first leaf of ``state.inner`` whose place, shape or dtype is not the template's."""
    paths, leaves, spec = optree.tree_flatten_with_path(inner, none_is_leaf=False)
    want, want_spec = optree.tree_flatten(template, none_is_leaf=False)
    if not same_structure(spec, want_spec):  # (optree's == is not traceable by every supported dynamo)
        raise ValueError(
            f"state.inner does not have the structure of this optimizer's inner state: "
            f"{first_difference(spec, want_spec)}; is it the state of another optimizer?"
        )
    for path, x, t in zip(paths, leaves, want):
        per_coordinate = t.dim() == 1  # a 0-d leaf is shared by all coordinates (shared_fields)
        if not isinstance(x, torch.Tensor) or x.shape != t.shape or (per_coordinate and x.dtype != t.dtype):
            got = f"{x.dtype} of shape {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(
                f"state.inner leaf at {path_str(path)} is {got}; this optimizer keeps "
                f"{t.dtype if per_coordinate else 'a 0-d tensor'} of shape {tuple(t.shape)} there"
            )


def check_sparse_state(
    state: Any, k: int, template: Any, accumulated: bool, p_leaves: list[torch.Tensor], treedef: optree.PyTreeSpec
) -> SparseOptState:
    """``state`` checked against an optimizer of ``k`` coordinates and ``params``: all that shows without values.

    ``template`` is the inner state's form (:func:`per_coordinate` of its
    init, on the meta device); ``accumulated``: the state holds a score.
    ``indices`` strictly ascending and in range needs their values: checked only
    where the update reads them on the host anyway (:func:`reads_on_host`).

    Raises:
        TypeError: ``state`` is not a :class:`SparseOptState`, or its count or indices are not integer tensors.
        ValueError: anything else differs (naming it): ``indices`` not of shape ``(k,)`` (another ``k``) or
            on another device, the inner state's structure, a shape or dtype, the score, or the indices' order.
    """
    state = check_state(state, SparseOptState, "sparse_optimizer")
    n = sum(x.numel() for x in p_leaves)
    count, idx = state.count, state.indices
    if not isinstance(count, torch.Tensor) or count.dim() or count.is_floating_point() or count.is_complex():
        raise TypeError(f"state.count must be a 0-d integer tensor, got {describe(count)}")
    if not isinstance(idx, torch.Tensor) or idx.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"state.indices must be an int32 or int64 tensor, got {describe(idx)}")
    if idx.shape != (k,) or idx.device != p_leaves[0].device:
        raise ValueError(
            f"state.indices is of shape {tuple(idx.shape)} on {idx.device}, but this optimizer trains k={k} of the "
            f"{n} coordinates of params, on {p_leaves[0].device}: is it the state of another optimizer (another k "
            "or density) or of other parameters?"
        )
    check_inner(state.inner, template)
    if accumulated:
        check_like(state.score, p_leaves, treedef, name="state.score", expected_name="params")
    elif state.score is not None:
        raise ValueError('state.score must be None with score="gradient" (a state of score="accumulated"?)')
    if reads_on_host(idx):
        check_ascending_indices(idx.long(), n, "state.indices")
    return state
