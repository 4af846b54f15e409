"""Elementary gradient transformations, the pieces optimizers are chained from.

All tree maths here goes through ``torch._foreach_*`` kernels over the flat list
of leaves, so a step costs a handful of kernel launches rather than one Python
operation per parameter, and none of it reads a tensor back to the host.

The adaptive transformations (``scale_by_adam``, ``scale_by_rms``,
``scale_by_rss``) live in :mod:`functopk.adaptive`; clipping and non-finite
guards in :mod:`functopk.clipping`; gradient accumulation in
:mod:`functopk.accumulate`.
"""

from __future__ import annotations

from typing import NamedTuple

import optree
import torch

from functopk._checks import (
    check_bool,
    check_hyperparam,
    check_same_structure,
    check_scalar_or_schedule,
    is_zero,
    require_params,
)
from functopk.base import (
    EmptyState,
    GradientTransformation,
    Params,
    ScalarOrSchedule,
    Schedule,
    Updates,
    init_count,
    stateless,
)
from functopk.combine import MaskOrFn, resolve_mask
from functopk.tree.foreach import add_scaled, for_leaves, keep_dtypes, mul, scalar_dtype
from functopk.tree.maths import PyTree
from functopk.tree.maths import scale as tree_scale
from functopk.tree.maths import zeros_like as tree_zeros_like

__all__ = [
    "ScaleByScheduleState",
    "TraceState",
    "add_decayed_weights",
    "scale",
    "scale_by_learning_rate",
    "scale_by_schedule",
    "trace",
]

def scale(step_size: float | torch.Tensor) -> GradientTransformation:
    """Multiply updates by a constant ``step_size``.

    Example:
        >>> import torch, functopk as ft
        >>> tx = ft.scale(-2.0)
        >>> tx.update({"w": torch.tensor([1.0, 3.0])}, tx.init(None))[0]
        {'w': tensor([-2., -6.])}
    """
    step_size = check_hyperparam(step_size, "step_size")
    return stateless(lambda updates, params: tree_scale(updates, step_size))


class ScaleByScheduleState(NamedTuple):
    """State of :func:`scale_by_schedule`: the number of updates done so far."""

    count: torch.Tensor


def scale_by_schedule(schedule: Schedule) -> GradientTransformation:
    """Multiply updates by ``schedule(count)``, where ``count`` is the step number (from 0).

    The count is a 0-d int64 tensor kept in the state, so the schedule is
    evaluated without a host sync and a compiled step does not recompile.

    Example:
        >>> import torch, functopk as ft
        >>> tx = ft.scale_by_schedule(lambda count: 1.0 / (count + 1))
        >>> state = tx.init({"w": torch.zeros(1)})
        >>> for _ in range(2):
        ...     updates, state = tx.update({"w": torch.tensor([1.0])}, state)
        >>> updates["w"]
        tensor([0.5000])
    """
    if not callable(schedule):
        raise TypeError(f"schedule must be callable (step -> value), got {type(schedule).__name__}")

    def init(params: Params) -> ScaleByScheduleState:
        return ScaleByScheduleState(count=init_count(params))

    def update(
        updates: Updates, state: ScaleByScheduleState, params: Params | None = None
    ) -> tuple[Updates, ScaleByScheduleState]:
        del params
        factor = schedule(state.count)
        return tree_scale(updates, factor), ScaleByScheduleState(count=state.count + 1)

    return GradientTransformation(init, update)


def scale_by_learning_rate(learning_rate: ScalarOrSchedule, *, flip_sign: bool = True) -> GradientTransformation:
    """Multiply updates by ``-learning_rate`` (or ``+learning_rate`` with ``flip_sign=False``).

    Args:
        learning_rate: A number, a 0-d tensor, or a schedule ``step -> lr`` evaluated on the step counter.
        flip_sign: Negate, so that adding the update descends the loss (default).

    Example:
        >>> import torch, functopk as ft
        >>> tx = ft.scale_by_learning_rate(0.1)
        >>> tx.update({"w": torch.tensor([1.0, -2.0])}, tx.init(None))[0]
        {'w': tensor([-0.1000,  0.2000])}
    """
    learning_rate = check_scalar_or_schedule(learning_rate, "learning_rate")
    check_bool(flip_sign, "flip_sign")
    sign = -1.0 if flip_sign else 1.0
    if callable(learning_rate):
        return scale_by_schedule(lambda count: sign * learning_rate(count))
    return scale(sign * learning_rate)


class TraceState(NamedTuple):
    """State of :func:`trace`.

    Attributes:
        trace: The momentum buffer, a tree like the parameters (zeros at first).
        count: The number of updates done (0-d int64 tensor); dampening skips the first one.
    """

    trace: PyTree
    count: torch.Tensor


def trace(
    decay: float | torch.Tensor, nesterov: bool = False, dampening: float | torch.Tensor = 0.0
) -> GradientTransformation:
    """Momentum, exactly as ``torch.optim.SGD`` keeps it.

    ``trace = decay * trace + (1 - dampening) * updates`` and the emitted update
    is ``trace`` (or, with ``nesterov=True``, ``updates + decay * trace`` using the
    new trace). As in ``torch.optim.SGD``, the first update sets
    ``trace = updates`` undamped: the state starts at zero and the dampening
    factor is 1 while ``count == 0`` (a 0-d tensor comparison, no host sync).

    Cost per step: one foreach kernel without dampening (``updates + decay *
    trace``, fused), three with it, plus one for Nesterov.

    Args:
        decay: The momentum coefficient, ``>= 0`` (a number or a 0-d tensor).
        nesterov: Use Nesterov momentum (``torch.optim.SGD`` needs ``dampening == 0`` for it; so does this).
        dampening: Dampening of the gradient's contribution, ``>= 0``.

    Example:
        >>> import torch, functopk as ft
        >>> tx = ft.trace(0.5, dampening=0.5)
        >>> state = tx.init({"w": torch.zeros(1)})
        >>> for _ in range(2):
        ...     updates, state = tx.update({"w": torch.tensor([1.0])}, state)
        >>> updates["w"]    # first step 1.0 (undamped), then 0.5 * 1.0 + 0.5 * 1.0
        tensor([1.])
    """
    decay = check_hyperparam(decay, "decay", minimum=0.0)
    check_bool(nesterov, "nesterov")
    dampening = check_hyperparam(dampening, "dampening", minimum=0.0)
    if nesterov and not is_zero(dampening):
        raise ValueError(f"nesterov=True needs dampening == 0, got dampening={dampening}")
    damped = not is_zero(dampening)

    def init(params: Params) -> TraceState:
        return TraceState(trace=tree_zeros_like(params), count=init_count(params))

    def update(updates: Updates, state: TraceState, params: Params | None = None) -> tuple[Updates, TraceState]:
        del params
        check_same_structure(state.trace, updates, name="updates", expected_name="the trace state")
        leaves, treedef = optree.tree_flatten(updates)
        buf = optree.tree_leaves(state.trace)
        if not leaves:
            return updates, state._replace(count=state.count + 1)
        if damped:
            # torch.optim.SGD clones the gradient into the buffer on the first step; with a
            # zero buffer that is the same as an undamped first step.
            first = state.count == 0
            one = torch.ones((), dtype=scalar_dtype(first.device), device=first.device)
            factor = for_leaves(torch.where(first, one, 1.0 - dampening), leaves)
            new_buf = keep_dtypes(torch._foreach_add(torch._foreach_mul(buf, decay), mul(leaves, factor)), buf)
        else:
            new_buf = keep_dtypes(add_scaled(leaves, decay, buf), buf)
        out = add_scaled(leaves, decay, new_buf) if nesterov else new_buf
        return (
            optree.tree_unflatten(treedef, list(out)),
            TraceState(trace=optree.tree_unflatten(treedef, list(new_buf)), count=state.count + 1),
        )

    return GradientTransformation(init, update)


def add_decayed_weights(
    weight_decay: float | torch.Tensor = 0.0, mask: MaskOrFn | None = None
) -> GradientTransformation:
    """Add ``weight_decay * params`` to the updates (L2 regularisation's gradient).

    Placed before an optimizer's scaling it is *coupled* weight decay, as the
    ``weight_decay`` of ``torch.optim.SGD``/``Adam``/``RMSprop``/``Adagrad``;
    placed after ``scale_by_adam`` and before the learning rate it is AdamW's
    *decoupled* decay.

    Args:
        weight_decay: The coefficient (a number or a 0-d tensor).
        mask: Which leaves to decay: a tree of Python bools with the parameters'
            structure, or a function ``params -> such a tree`` (evaluated at every
            update, on the structure and shapes only, e.g.
            ``lambda p: ft.tree.map(lambda x: x.dim() > 1, p)``). ``None`` decays all.
            Leaves masked out pass through unchanged.

    Raises:
        ValueError: at update time, when ``params`` is not given or the mask does not fit.

    Example:
        >>> import torch, functopk as ft
        >>> tx = ft.add_decayed_weights(0.1, mask={"w": True, "b": False})
        >>> params = {"w": torch.tensor([10.0]), "b": torch.tensor([10.0])}
        >>> tx.update({"w": torch.tensor([1.0]), "b": torch.tensor([1.0])}, tx.init(params), params)[0]
        {'w': tensor([2.]), 'b': tensor([1.])}
    """
    weight_decay = check_hyperparam(weight_decay, "weight_decay")
    if mask is not None and not callable(mask):
        optree.tree_structure(mask)  # an unflattenable mask fails here, early

    def init(params: Params) -> EmptyState:
        if mask is not None:
            resolve_mask(mask, params)
        return EmptyState()

    def update(updates: Updates, state: EmptyState, params: Params | None = None) -> tuple[Updates, EmptyState]:
        params = require_params(params, "add_decayed_weights")
        check_same_structure(params, updates, name="updates", expected_name="params")
        if is_zero(weight_decay):
            return updates, state
        leaves, treedef = optree.tree_flatten(updates)
        p_leaves = optree.tree_leaves(params)
        idx = list(range(len(leaves))) if mask is None else [i for i, f in enumerate(resolve_mask(mask, params)) if f]
        if not idx:
            return updates, state
        out = list(leaves)
        decayed = add_scaled([leaves[i] for i in idx], weight_decay, [p_leaves[i] for i in idx])
        for i, x in zip(idx, decayed):
            out[i] = x
        return optree.tree_unflatten(treedef, out), state

    return GradientTransformation(init, update)
