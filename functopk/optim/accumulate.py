"""Gradient accumulation: apply an optimizer once every ``k`` micro-batches.

``multi_steps(tx, every_k)`` sums the gradients of ``every_k`` calls and, on the
last of them, hands their mean to ``tx``; the other calls emit zero updates and
leave ``tx``'s state as it was. The choice is made on device, with no host sync:
``tx`` runs on every call (on the running mean) and ``torch.where`` keeps either
its result or the old state, so the step is one graph that compiles once. The
price is one inner update per micro-batch; for a cheap optimizer next to a
forward/backward pass that is small.
"""

from __future__ import annotations

import numbers
from typing import NamedTuple

import optree
import torch

from functopk._checks import check_same_structure
from functopk.base import GradientTransformation, OptState, Params, Updates, check_transformation, init_count
from functopk.tree.foreach import keep_dtypes
from functopk.tree.foreach import where as select_leaves
from functopk.tree.maths import PyTree
from functopk.tree.maths import zeros_like as tree_zeros_like

__all__ = ["MultiStepsState", "multi_steps"]


class MultiStepsState(NamedTuple):
    """State of :func:`multi_steps`.

    Attributes:
        mini_step: Micro-batches accumulated since the last inner step (0-d int64, ``0 <= mini_step < every_k``).
        gradient_step: Inner steps taken so far (0-d int64).
        inner_state: The inner transformation's state.
        acc_grads: The sum of the gradients accumulated since the last inner step.
    """

    mini_step: torch.Tensor
    gradient_step: torch.Tensor
    inner_state: OptState
    acc_grads: PyTree


def multi_steps(inner: GradientTransformation, every_k: int | torch.Tensor) -> GradientTransformation:
    """Accumulate gradients over ``every_k`` calls and apply ``inner`` to their mean on the last one.

    Equivalent to training with ``every_k`` times larger batches (for a loss that
    is a mean over the batch and no batch-dependent layers), as torch users get by
    calling ``backward()`` ``k`` times before ``optimizer.step()`` with the loss
    divided by ``k``. Calls ``1 .. every_k - 1`` of each cycle emit zeros (so
    ``apply_updates`` leaves the parameters as they are) and do not change
    ``inner``'s state; call ``every_k`` emits ``inner``'s update of the mean.
    ``inner`` receives the parameters of the call that completes the cycle.

    Args:
        inner: The optimizer to apply every ``every_k`` calls.
        every_k: Number of micro-batches per step, ``>= 1`` (an int, or a 0-d tensor
            from :func:`functopk.inject_hyperparams`).

    Example:
        >>> import torch, functopk as ft
        >>> tx = ft.multi_steps(ft.sgd(1.0), every_k=2)
        >>> params = {"w": torch.zeros(1)}
        >>> state = tx.init(params)
        >>> for g in (1.0, 3.0):
        ...     updates, state = tx.update({"w": torch.tensor([g])}, state, params)
        ...     print(updates["w"])
        tensor([0.])
        tensor([-2.])
    """
    check_transformation(inner, "inner")
    if isinstance(every_k, torch.Tensor):
        if every_k.dim() != 0:
            raise TypeError(f"every_k must be an int or a 0-d tensor, got shape {tuple(every_k.shape)}")
    elif isinstance(every_k, bool) or not isinstance(every_k, numbers.Integral):
        raise TypeError(f"every_k must be an int, got {type(every_k).__name__} {every_k!r}")
    elif every_k < 1:
        raise ValueError(f"every_k must be >= 1, got {every_k}")

    def init(params: Params) -> MultiStepsState:
        count = init_count(params)
        return MultiStepsState(
            mini_step=count,
            gradient_step=count.clone(),
            inner_state=inner.init(params),
            acc_grads=tree_zeros_like(params),
        )

    def update(
        updates: Updates, state: MultiStepsState, params: Params | None = None
    ) -> tuple[Updates, MultiStepsState]:
        if not isinstance(state, MultiStepsState):
            raise ValueError(f"state must be a MultiStepsState, got {type(state).__name__}")
        check_same_structure(state.acc_grads, updates, name="updates", expected_name="the accumulated gradients")
        grads, treedef = optree.tree_flatten(updates)
        acc = keep_dtypes(torch._foreach_add(optree.tree_leaves(state.acc_grads), grads), grads)
        emit = state.mini_step + 1 >= every_k
        if isinstance(every_k, torch.Tensor):
            mean = keep_dtypes(torch._foreach_div(acc, every_k), acc)
        else:
            mean = acc if every_k == 1 else list(torch._foreach_div(acc, float(every_k)))
        new_updates, new_inner = inner.update(optree.tree_unflatten(treedef, mean), state.inner_state, params)
        out_leaves, out_def = optree.tree_flatten(new_updates)
        out = [torch.where(emit, x, torch.zeros((), dtype=x.dtype, device=x.device)) for x in out_leaves]
        old_inner, inner_def = optree.tree_flatten(state.inner_state)
        new_inner_leaves, new_def = optree.tree_flatten(new_inner)
        if new_def != inner_def:
            raise ValueError(f"inner transformation changed its state structure from {inner_def} to {new_def}")
        acc = [torch.where(emit, torch.zeros((), dtype=x.dtype, device=x.device), x) for x in acc]
        emitted = emit.to(state.mini_step.dtype)
        return optree.tree_unflatten(out_def, out), MultiStepsState(
            mini_step=(state.mini_step + 1) * (1 - emitted),
            gradient_step=state.gradient_step + emitted,
            inner_state=optree.tree_unflatten(inner_def, select_leaves(emit, new_inner_leaves, old_inner)),
            acc_grads=optree.tree_unflatten(treedef, acc),
        )

    return GradientTransformation(init, update)
