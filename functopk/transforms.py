"""Elementary gradient transformations, the pieces optimizers are chained from.

All tree maths here goes through ``torch._foreach_*`` kernels over the flat list
of leaves, so a step costs a handful of kernel launches rather than one Python
operation per parameter, and none of it reads a tensor back to the host.
"""

from __future__ import annotations

import numbers
from typing import Any, NamedTuple

import optree
import torch

from functopk.base import GradientTransformation, Params, ScalarOrSchedule, Schedule, Updates, stateless
from functopk.tree import PyTree, check_same_structure, keep_dtypes, tree_scale, tree_zeros_like

__all__ = [
    "ScaleByScheduleState",
    "TraceState",
    "scale",
    "scale_by_learning_rate",
    "scale_by_schedule",
    "trace",
]


def check_number(value: Any, name: str, *, minimum: float | None = None, below: float | None = None) -> float:
    """Return ``value`` as a float after checking its type and range, else raise naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__} {value!r}")
    value = float(value)
    if value != value:
        raise ValueError(f"{name} must not be NaN")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    if below is not None and value >= below:
        raise ValueError(f"{name} must be < {below}, got {value}")
    return value


def check_hyperparam(
    value: Any, name: str, *, minimum: float | None = None, below: float | None = None
) -> float | torch.Tensor:
    """A hyperparameter: a real number (type- and range-checked) or a 0-d float tensor.

    Tensors come from :func:`functopk.inject_hyperparams`; their value is not
    range-checked, since reading it would be a host sync.
    """
    if isinstance(value, torch.Tensor):
        if value.dim() != 0 or not value.is_floating_point():
            raise TypeError(f"{name} must be a real number or a 0-d float tensor, got a tensor of shape "
                            f"{tuple(value.shape)} and dtype {value.dtype}")
        return value
    return check_number(value, name, minimum=minimum, below=below)


def check_scalar_or_schedule(value: Any, name: str) -> ScalarOrSchedule:
    """``value`` if it is a real number, a 0-d float tensor or a schedule, else ``TypeError`` naming ``name``."""
    if callable(value):
        return value
    return check_hyperparam(value, name)


def tree_device(tree: PyTree) -> torch.device:
    """The device of the first leaf of ``tree`` (CPU for an empty tree or ``None``)."""
    leaves = optree.tree_leaves(tree)
    return leaves[0].device if leaves else torch.device("cpu")


def init_count(params: Params) -> torch.Tensor:
    """A fresh step counter: an int64 0-d tensor on the parameters' device."""
    return torch.zeros((), dtype=torch.int64, device=tree_device(params))


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
        learning_rate: A number, or a schedule ``step -> lr`` evaluated on the step counter.
        flip_sign: Negate, so that adding the update descends the loss (default).
    """
    learning_rate = check_scalar_or_schedule(learning_rate, "learning_rate")
    sign = -1.0 if flip_sign else 1.0
    if callable(learning_rate):
        return scale_by_schedule(lambda count: sign * learning_rate(count))
    return scale(sign * learning_rate)


def _add_scaled(a: list[torch.Tensor], scalar: float | torch.Tensor, b: list[torch.Tensor]) -> list[torch.Tensor]:
    """``a + scalar * b`` over lists of tensors (one fused kernel for a Python scalar)."""
    if isinstance(scalar, torch.Tensor):
        return list(torch._foreach_add(a, torch._foreach_mul(b, scalar)))
    return list(torch._foreach_add(a, b, alpha=scalar))


class TraceState(NamedTuple):
    """State of :func:`trace`: the momentum buffer, a tree like the parameters."""

    trace: PyTree


def trace(decay: float | torch.Tensor, nesterov: bool = False) -> GradientTransformation:
    """Momentum: ``trace = updates + decay * trace``; emit ``trace`` (or the Nesterov form).

    With ``nesterov=True`` the emitted update is ``updates + decay * trace``
    (using the new trace), as ``torch.optim.SGD(nesterov=True)`` does.

    Args:
        decay: The momentum coefficient, ``>= 0`` (a number or a 0-d tensor).
        nesterov: Use Nesterov momentum.
    """
    decay = check_hyperparam(decay, "decay", minimum=0.0)
    if not isinstance(nesterov, bool):
        raise TypeError(f"nesterov must be a bool, got {type(nesterov).__name__}")

    def init(params: Params) -> TraceState:
        return TraceState(trace=tree_zeros_like(params))

    def update(updates: Updates, state: TraceState, params: Params | None = None) -> tuple[Updates, TraceState]:
        del params
        check_same_structure(state.trace, updates, name="updates", expected_name="the trace state")
        leaves, treedef = optree.tree_flatten(updates)
        buf = optree.tree_leaves(state.trace)
        if not leaves:
            return updates, state
        new_buf = keep_dtypes(_add_scaled(leaves, decay, buf), buf)
        out = keep_dtypes(_add_scaled(leaves, decay, new_buf), leaves) if nesterov else new_buf
        return optree.tree_unflatten(treedef, list(out)), TraceState(trace=optree.tree_unflatten(treedef, list(new_buf)))

    return GradientTransformation(init, update)
