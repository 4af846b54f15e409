"""Pieces shared by the modules of :mod:`functopk.optim`: masks, the skip-step branch, count arguments.

* :func:`with_mask`: a leafwise transformation whose leaf maths needs a mask's
  flags (``add_decayed_weights``, AdamW's decay), resolved on the parameter tree;
* :func:`selected`: the leaves a mask keeps;
* :func:`step_or_skip`: the branch of the wrappers that may skip a step
  (``apply_if_finite``, ``multi_steps``): the inner update and state, or zeros
  and the old state, chosen on device;
* :func:`check_count`: an int argument that may also be a 0-d tensor;
* :func:`first_moves`: ``torch.optim``'s first moves on a gradient (negate it for
  ``maximize``, add a coupled weight decay), and :func:`decoupled_decay`, AdamW's
  decay of the parameters, the one writing of each;
* the type aliases ``Leaves`` (the leaf lists of the leaf maths) and ``Hyper`` (a
  hyperparameter: a number or a 0-d tensor).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import optree
import torch

from functopk._checks import check_int, check_leaves, check_scalar_tensor, require_params
from functopk.base import GradientTransformation, OptState, Params, Updates
from functopk.combine import MaskOrFn, resolve_mask
from functopk.inplace import Planned, register_inplace, stage_of
from functopk.tree import foreach, torch_rounding
from functopk.tree.maths import flatten_like

T = TypeVar("T")
Leaves = list[torch.Tensor]
Hyper = float | torch.Tensor


def with_mask(
    make: Callable[[list[bool] | None], GradientTransformation], mask: MaskOrFn | None, name: str
) -> GradientTransformation:
    """``make(flags)``, with ``flags`` the mask's Python bools in the parameters' flat order (``None``: no mask).

    A mask given as a function is evaluated on the parameter tree, which the
    leaf maths of :func:`functopk.leafwise` does not see: it is resolved here,
    at init (so a bad mask fails early) and at every update (on the parameters,
    which are then required), and the transformation is made for those flags.
    """
    if mask is None:
        return make(None)
    if not callable(mask):
        optree.tree_structure(mask)  # an unflattenable mask fails here, early

    def init(params: Params) -> OptState:
        return make(resolve_mask(mask, params)).init(params)

    def update(updates: Updates, state: OptState, params: Params | None = None) -> tuple[Updates, OptState]:
        flags = resolve_mask(mask, require_params(params, name))
        return make(flags).update(updates, state, params)

    def stage(grads: Leaves, state: OptState, params: Leaves, treedef: optree.PyTreeSpec) -> Planned | None:
        inner = stage_of(make(resolve_mask(mask, treedef.unflatten(params))))  # (in place: the flags by position)
        return None if inner is None else inner(grads, state, params, treedef)

    return register_inplace(GradientTransformation(init, update), stage)


def first_moves(
    new: Any, grads: Leaves, params: Leaves | None, maximize: bool, weight_decay: Hyper | None
) -> Leaves:
    """``torch.optim``'s first moves on a gradient: negate it (``maximize``), then add ``weight_decay * params``
    (a coupled decay, where ``params`` are given and the decay is not ``None``); in fresh tensors from
    ``new`` (a writer's temporaries, :mod:`functopk.tree.writer`), never the gradient's own. (``sgd``,
    ``rmsprop`` and ``adagrad`` chain the same moves as ``scale(-1)`` and ``add_decayed_weights``.)

    Example:
        >>> import torch
        >>> from functopk.tree import foreach, torch_rounding
        >>> first_moves(foreach, [torch.tensor([1.0])], [torch.tensor([10.0])], True, 0.5)
        [tensor([4.])]
    """
    if maximize:
        grads = new.neg(grads)
    if params is not None and weight_decay is not None:
        grads = new.add_scaled(grads, weight_decay, params)
    return grads


def selected(flags: list[bool] | None, leaves: list[T]) -> list[int]:
    """The indices of the leaves the mask keeps (all for ``None``)."""
    return list(range(len(leaves))) if flags is None else [i for i, keep in enumerate(flags) if keep]


def step_or_skip(
    take: torch.Tensor, updates: Updates, new_inner: OptState, old_inner: OptState
) -> tuple[Updates, OptState]:
    """``(updates, new_inner)`` where the 0-d bool ``take`` holds, else ``(zeros, old_inner)``, without a host sync.

    Raises:
        ValueError: if the inner transformation returned a state of another structure than it was given.
    """
    leaves, treedef = check_leaves(updates, "the inner transformation's updates")
    old, inner_def = optree.tree_flatten(old_inner)
    new = flatten_like(new_inner, inner_def, "the inner transformation's new state", "its old state")
    return (
        optree.tree_unflatten(treedef, foreach.where_zero(take, leaves)),
        optree.tree_unflatten(inner_def, foreach.where(take, new, old)),
    )


def check_count(value: Any, name: str, *, minimum: int) -> int | torch.Tensor:
    """An int ``>= minimum``, or a 0-d real tensor (from ``inject_hyperparams``; its value is not read)."""
    if isinstance(value, torch.Tensor):
        return check_scalar_tensor(value, name, kind="real", expected="an int or a 0-d tensor")
    return check_int(value, name, minimum=minimum)


def is_number(value: Any) -> bool:
    """Whether ``value`` is a Python int or float (not a bool, not a tensor): what a foreach ``scalar`` takes."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def decoupled_decay(lr: Hyper, weight_decay: Hyper, like: Leaves) -> Callable[..., Leaves]:
    """AdamW's decoupled decay: ``decay_(out, params, flags=None)`` adds ``-lr * weight_decay * params`` into
    ``out`` (fresh buffers) on the leaves the mask's ``flags`` keep, as torch applies it (the factor of
    :func:`~functopk.tree.torch_rounding.decoupled_decay`, cast for ``like``'s dtypes once, here).

    Example:
        >>> import torch
        >>> decoupled_decay(0.1, 0.5, [torch.zeros(1)])([torch.zeros(1)], [torch.tensor([2.0])])
        [tensor([-0.1000])]
    """
    coef = foreach.for_leaves(torch_rounding.decoupled_decay(lr, weight_decay), like)

    def decay_(out: Leaves, params: Leaves, flags: list[bool] | None = None) -> Leaves:
        idx = selected(flags, out)
        foreach.add_scaled_([out[i] for i in idx], coef, [params[i] for i in idx])
        return out

    return decay_
