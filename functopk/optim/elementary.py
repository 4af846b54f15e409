"""Elementary gradient transformations, the pieces optimizers are chained from.

Each is written with :func:`functopk.leafwise` and the list maths of
:mod:`functopk.tree.foreach`: a step costs a handful of foreach kernel launches
rather than one Python operation per parameter, none of it reads a tensor back
to the host, and the checks (state type, floating-point leaves, structure and
shapes, params) are the same everywhere.

The adaptive transformations (``scale_by_adam``, ``scale_by_rms``,
``scale_by_rss``) live in :mod:`functopk.optim.adaptive` and :mod:`functopk.optim.rms`; clipping and
non-finite guards in :mod:`functopk.optim.clipping`; gradient accumulation in
:mod:`functopk.optim.accumulate`.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from functopk._checks import check_bool, check_callable, check_hyperparam, check_scalar_or_schedule, is_zero
from functopk.base import EmptyState, GradientTransformation, ScalarOrSchedule, Schedule, init_count, recorded
from functopk.build import Formula, leafwise
from functopk.combine import MaskOrFn
from functopk.inplace import Body
from functopk.optim._shared import Leaves, is_number, selected, with_mask
from functopk.tree import foreach
from functopk.tree.maths import PyTree
from functopk.tree.writer import Writer

__all__ = [
    "ScaleByScheduleState",
    "TraceState",
    "WeightDecayScheduleState",
    "add_decayed_weights",
    "scale",
    "scale_by_learning_rate",
    "scale_by_schedule",
    "trace",
]


def _scale(step_size: float | torch.Tensor, name: str, *, negate: bool = False) -> GradientTransformation:
    """Multiply by ``step_size`` (by ``-step_size`` with ``negate``), a tensor read at every update.

    A 0-d tensor is negated at each update, never once here: a copy made now would
    not see an in-place change (an LR scheduler's ``fill_``) at the next update.
    """

    def prepare(state: EmptyState, like: Leaves, params: Leaves | None) -> tuple[Body, dict[str, Any]]:
        factor = -step_size if negate else step_size
        return lambda w, g, fields, p: (w.last_mul(g, factor), ()), {}

    return leafwise(name, formula=Formula(prepare, sliced=True))


@recorded
def scale(step_size: float | torch.Tensor) -> GradientTransformation:
    """Multiply updates by a constant ``step_size``.

    Example:
        >>> import torch, functopk as ft
        >>> tx = ft.scale(-2.0)
        >>> tx.update({"w": torch.tensor([1.0, 3.0])}, tx.init(None))[0]
        {'w': tensor([-2., -6.])}
    """
    return _scale(check_hyperparam(step_size, "step_size"), "scale")


class ScaleByScheduleState(NamedTuple):
    """State of :func:`scale_by_schedule`: the number of updates done so far.

    Example:
        >>> import torch, functopk as ft
        >>> ft.scale_by_schedule(lambda count: 0.5 ** count).init({"w": torch.zeros(2)})
        ScaleByScheduleState(count=tensor(0))
    """

    count: torch.Tensor  # type: ignore[assignment]


def _scale_by_schedule(schedule: Schedule, name: str) -> GradientTransformation:
    def init(params: Leaves) -> ScaleByScheduleState:
        return ScaleByScheduleState(count=init_count(params))

    def prepare(state: ScaleByScheduleState, like: Leaves, params: Leaves | None) -> tuple[Body, dict[str, Any]]:
        value = foreach.for_leaves(schedule(state.count), like)  # float64 values stay float64 for float64 leaves
        return lambda w, g, fields, p: (w.last_mul(g, value), ()), {"count": state.count + 1}

    return leafwise(name, formula=Formula(prepare, sliced=True), init=init, state=ScaleByScheduleState)


@recorded
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
    check_callable(schedule, "schedule", "callable (step -> value)")
    return _scale_by_schedule(schedule, "scale_by_schedule")


@recorded
def scale_by_learning_rate(learning_rate: ScalarOrSchedule, *, flip_sign: bool = True) -> GradientTransformation:
    """Multiply updates by ``-learning_rate`` (or ``+learning_rate`` with ``flip_sign=False``).

    Args:
        learning_rate: A number, a 0-d tensor, or a schedule ``step -> lr`` evaluated on the step counter.
            A tensor is read on device at every update, so an in-place change (``lr.fill_(...)``,
            as ``torch.optim.lr_scheduler`` does to a tensor ``lr``) takes effect at the next one.
        flip_sign: Negate, so that adding the update descends the loss (default).

    Example:
        >>> import torch, functopk as ft
        >>> tx = ft.scale_by_learning_rate(0.1)
        >>> tx.update({"w": torch.tensor([1.0, -2.0])}, tx.init(None))[0]
        {'w': tensor([-0.1000,  0.2000])}
    """
    learning_rate = check_scalar_or_schedule(learning_rate, "learning_rate")
    flip = check_bool(flip_sign, "flip_sign")
    name = "scale_by_learning_rate"
    if callable(learning_rate):
        return _scale_by_schedule(lambda count: -learning_rate(count) if flip else learning_rate(count), name)
    if isinstance(learning_rate, torch.Tensor):
        return _scale(learning_rate, name, negate=flip)
    return _scale(-learning_rate if flip else learning_rate, name)


class TraceState(NamedTuple):
    """State of :func:`trace`.

    Attributes:
        trace: The momentum buffer, a tree like the parameters (zeros at first).
        count: The number of updates done (0-d int64 tensor); dampening skips the first one.

    Example:
        >>> import torch, functopk as ft
        >>> ft.trace(0.9).init({"w": torch.zeros(2)})
        TraceState(trace={'w': tensor([0., 0.])}, count=tensor(0))
    """

    trace: PyTree
    count: torch.Tensor  # type: ignore[assignment]


@recorded
def trace(
    decay: float | torch.Tensor, nesterov: bool = False, *, dampening: float | torch.Tensor = 0.0
) -> GradientTransformation:
    """Momentum, exactly as ``torch.optim.SGD`` keeps it (optax's ``trace`` when ``dampening == 0``).

    ``trace = decay * trace + (1 - dampening) * updates`` and the emitted update
    is ``trace`` (or, with ``nesterov=True``, ``updates + decay * trace`` using the
    new trace). As in ``torch.optim.SGD``, the first update sets
    ``trace = updates`` undamped: the state starts at zero and the dampening
    factor is 1 while ``count == 0`` (a 0-d tensor comparison, no host sync).

    Cost per step: on the CPU and compiled, one kernel without dampening
    (``updates + decay * trace``, a fused multiply-add); eagerly on an
    accelerator two foreach kernels, ``decay * trace`` then ``+ updates``
    (``torch.optim.SGD``'s kernels and bits), so that :func:`functopk.update_`
    and the ``torch.optim`` adapters write the trace in place with no new
    memory (the fused kernel has no in-place form: it would cost a fresh tree
    and a copy). Three kernels with dampening, one more for Nesterov.

    Args:
        decay: The momentum coefficient, ``>= 0`` (a number or a 0-d tensor).
        nesterov: Use Nesterov momentum (``torch.optim.SGD`` needs ``dampening == 0`` for it; so does this).
        dampening: Dampening of the gradient's contribution, ``>= 0`` (keyword only: not in optax).

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

    def init(params: Leaves) -> TraceState:
        return TraceState(trace=foreach.zeros_like(params), count=init_count(params))

    def prepare(state: TraceState, like: Leaves, params: Leaves | None) -> tuple[Body, dict[str, Any]]:
        factor = None
        if not is_zero(dampening):
            # torch.optim.SGD clones the gradient into the buffer on the first step; with a
            # zero buffer that is the same as an undamped first step.
            first = state.count == 0
            one = torch.ones((), dtype=foreach.scalar_dtype(first.device), device=first.device)
            factor = foreach.for_leaves(torch.where(first, one, 1.0 - dampening), like)

        def body(w: Writer, g: Leaves, fields: tuple[Any, ...], p: Leaves | None) -> tuple[Leaves, tuple[Any, ...]]:
            if factor is None and not (g and foreach.eager_accelerator(g[0])):
                buf = w.scaled_plus(fields[0], decay, g)  # g + decay * buf: one kernel
            else:  # eagerly on an accelerator: two kernels, each of which can write into the trace
                buf = foreach.add_(w.mul(fields[0], decay), g if factor is None else w.new.mul(g, factor))
            return (w.new.add_scaled(g, decay, buf) if nesterov else buf), (buf,)

        return body, {"count": state.count + 1}

    formula = Formula(prepare, in_place=is_number(decay), sliced=True)
    return leafwise("trace", formula=formula, init=init, state=TraceState, tree_fields=("trace",))


class WeightDecayScheduleState(NamedTuple):
    """State of :func:`add_decayed_weights` with a scheduled ``weight_decay`` (optax's ``WeightDecaySchedule``).

    Attributes:
        count: Number of updates done (0-d int64 tensor); the schedule is evaluated on it.

    Example:
        >>> import torch, functopk as ft
        >>> ft.add_decayed_weights(lambda count: 0.1).init({"w": torch.zeros(2)})
        WeightDecayScheduleState(count=tensor(0))
    """

    count: torch.Tensor  # type: ignore[assignment]


def _decay(new: Any, grads: Leaves, params: Leaves | None, flags: list[bool] | None, weight_decay: Any) -> Leaves:
    """``grads + weight_decay * params`` (fresh, from ``new``) on the leaves the mask keeps, the others unchanged."""
    if params is None:  # never None here (needs_params)
        return list(grads)
    if flags is None:
        return new.add_scaled(grads, weight_decay, params)
    idx = selected(flags, grads)
    out = list(grads)
    for i, x in zip(idx, new.add_scaled([grads[i] for i in idx], weight_decay, [params[i] for i in idx])):
        out[i] = x
    return out


@recorded
def add_decayed_weights(
    weight_decay: float | torch.Tensor | Schedule = 0.0, mask: MaskOrFn | None = None
) -> GradientTransformation:
    """Add ``weight_decay * params`` to the updates (L2 regularisation's gradient).

    Placed before an optimizer's scaling it is *coupled* weight decay, as the
    ``weight_decay`` of ``torch.optim.SGD``/``Adam``/``RMSprop``/``Adagrad``;
    placed after ``scale_by_adam`` and before the learning rate it is AdamW's
    *decoupled* decay. optax's ``add_decayed_weights``, a schedule included: a
    constant keeps no state; a schedule ``count -> weight_decay`` is evaluated on
    the step count of a :class:`WeightDecayScheduleState`.

    Args:
        weight_decay: The coefficient: a number, a 0-d tensor or a schedule ``step -> value``.
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
    weight_decay = check_scalar_or_schedule(weight_decay, "weight_decay")
    name = "add_decayed_weights"
    if callable(weight_decay):
        schedule = weight_decay

        def init(params: Leaves) -> WeightDecayScheduleState:
            return WeightDecayScheduleState(count=init_count(params))

        def make(flags: list[bool] | None) -> GradientTransformation:
            def update(
                grads: Leaves, state: WeightDecayScheduleState, params: Leaves | None
            ) -> tuple[Leaves, WeightDecayScheduleState]:
                decay = foreach.for_leaves(schedule(state.count), grads)
                return _decay(foreach, grads, params, flags, decay), WeightDecayScheduleState(count=state.count + 1)

            return leafwise(name, update, init=init, state=WeightDecayScheduleState, needs_params=True)

        return with_mask(make, mask, name)

    def make_constant(flags: list[bool] | None) -> GradientTransformation:
        def prepare(state: EmptyState, like: Leaves, params: Leaves | None) -> tuple[Body, dict[str, Any]]:
            if is_zero(weight_decay):
                return lambda w, g, fields, p: (g, ()), {}
            return lambda w, g, fields, p: (_decay(w.new, g, p, flags, weight_decay), ()), {}

        # (with a mask its flags go by leaf position: not on slices)
        return leafwise(name, formula=Formula(prepare, sliced=flags is None), needs_params=True)

    return with_mask(make_constant, mask, name)
