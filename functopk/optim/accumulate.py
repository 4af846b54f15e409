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

from typing import NamedTuple

import optree
import torch

from functopk._checks import check_leaves, check_shapes
from functopk.base import GradientTransformation, OptState, Params, Updates, init_count, recorded
from functopk.build import wrapper
from functopk.optim._shared import check_count, step_or_skip
from functopk.tree import foreach
from functopk.tree.maths import PyTree, flatten_like
from functopk.tree.maths import zeros_like as tree_zeros_like

__all__ = ["MultiStepsState", "multi_steps"]


class MultiStepsState(NamedTuple):
    """State of :func:`multi_steps`.

    Attributes:
        mini_step: Micro-batches accumulated since the last inner step (0-d int64, ``0 <= mini_step < every_k``).
        gradient_step: Inner steps taken so far (0-d int64).
        inner_state: The inner transformation's state.
        acc_grads: The sum of the gradients accumulated since the last inner step.

    Example:
        >>> import torch, functopk as ft
        >>> state = ft.multi_steps(ft.sgd(0.1), every_k=4).init({"w": torch.zeros(2)})
        >>> state.mini_step, state.acc_grads
        (tensor(0), {'w': tensor([0., 0.])})
    """

    mini_step: torch.Tensor
    gradient_step: torch.Tensor
    inner_state: OptState
    acc_grads: PyTree


@recorded
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
    every_k = check_count(every_k, "every_k", minimum=1)

    def init(params: Params, inner_state: OptState) -> MultiStepsState:
        count = init_count(params)
        return MultiStepsState(
            mini_step=count,
            gradient_step=count.clone(),
            inner_state=inner_state,
            acc_grads=tree_zeros_like(params),
        )

    def update(
        updates: Updates, state: MultiStepsState, params: Params | None = None
    ) -> tuple[Updates, MultiStepsState]:
        grads, treedef = check_leaves(updates, "updates", floating=True)
        acc = flatten_like(state.acc_grads, treedef, "updates", "multi_steps's accumulated gradients")
        check_shapes(treedef, grads, acc, name="updates", expected_name="multi_steps's accumulated gradients")
        acc = foreach.add(acc, grads)
        emit = state.mini_step + 1 >= every_k
        mean = acc if isinstance(every_k, int) and every_k == 1 else foreach.div_scalar(acc, _divisor(every_k))
        new_updates, new_inner = inner.update(optree.tree_unflatten(treedef, mean), state.inner_state, params)
        out, inner_state = step_or_skip(emit, new_updates, new_inner, state.inner_state)
        emitted = emit.to(state.mini_step.dtype)
        return out, MultiStepsState(
            mini_step=(state.mini_step + 1) * (1 - emitted),
            gradient_step=state.gradient_step + emitted,
            inner_state=inner_state,
            acc_grads=optree.tree_unflatten(treedef, foreach.where_zero(~emit, acc)),
        )

    return wrapper("multi_steps", inner, update, init=init, state=MultiStepsState)


def _divisor(every_k: int | torch.Tensor) -> float | torch.Tensor:
    """``every_k`` as the divisor of the sum: a Python float, or the 0-d tensor itself."""
    return every_k if isinstance(every_k, torch.Tensor) else float(every_k)
