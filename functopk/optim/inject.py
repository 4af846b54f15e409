"""Hyperparameters that live in the optimizer state.

``inject_hyperparams(ft.sgd)(learning_rate=0.1, momentum=0.9)`` builds the same
optimizer as ``ft.sgd(0.1, momentum=0.9)``, but keeps its numeric
hyperparameters as 0-d tensors in the state. They can then be read, logged,
scheduled or changed between steps (``state.hyperparams["learning_rate"]``)
without rebuilding the transformation and without recompiling a compiled step,
since a tensor's value is not part of a compiled graph's guards.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import torch

from functopk.base import GradientTransformation, OptState, Params, Updates, init_count

__all__ = ["InjectHyperparamsState", "inject_hyperparams"]


class InjectHyperparamsState(NamedTuple):
    """State of :func:`inject_hyperparams`.

    Attributes:
        count: Number of updates done (0-d int64 tensor); schedules are evaluated on it.
        hyperparams: The current value of each injected hyperparameter (0-d float32 tensors).
            Replace an entry to change it: the next update uses the new value
            (entries given as schedules are recomputed from ``count`` at every update).
        inner_state: The state of the wrapped transformation.
    """

    count: torch.Tensor
    hyperparams: dict[str, torch.Tensor]
    inner_state: OptState


def _as_tensor(value: Any, device: torch.device) -> torch.Tensor:
    return torch.as_tensor(value, dtype=torch.float32, device=device)


def inject_hyperparams(
    factory: Callable[..., GradientTransformation], static_args: Iterable[str] = ()
) -> Callable[..., GradientTransformation]:
    """Wrap a transformation factory so that its numeric hyperparameters live in the state.

    Keyword arguments that are real numbers (not bools), 0-d tensors or
    callables (schedules ``step -> value``) are *injected*: stored as 0-d
    float32 tensors in :class:`InjectHyperparamsState` and passed to ``factory``
    as tensors at every update. Everything else (bools, strings, ``None``,
    transformations), positional arguments, and names listed in
    ``static_args`` are passed through unchanged. The factory must accept 0-d
    tensors for the injected arguments; every functopk factory does, integer ones
    (``multi_steps``'s ``every_k``) included. Every callable is taken for a
    schedule: list function-valued arguments that are not schedules (masks,
    ``partition`` labels) in ``static_args``.

    Args:
        factory: A function returning a :class:`GradientTransformation`, e.g. ``ft.sgd``.
        static_args: Names of numeric keyword arguments *not* to inject (e.g. an
            integer ``k`` that sets a shape).

    Example:
        >>> import torch, functopk as ft
        >>> tx = ft.inject_hyperparams(ft.sgd)(learning_rate=0.1, momentum=0.9)
        >>> params = {"w": torch.ones(2)}
        >>> state = tx.init(params)
        >>> state.hyperparams["learning_rate"]
        tensor(0.1000)
        >>> state = state._replace(hyperparams={**state.hyperparams, "learning_rate": torch.tensor(0.5)})
        >>> updates, state = tx.update({"w": torch.ones(2)}, state, params)
        >>> updates["w"]
        tensor([-0.5000, -0.5000])
    """
    if not callable(factory):
        raise TypeError(f"factory must be callable, got {type(factory).__name__}")
    static = frozenset(static_args)

    def wrapped(*args: Any, **kwargs: Any) -> GradientTransformation:
        injected, schedules, passthrough = {}, {}, {}
        for name, value in kwargs.items():
            if name in static:
                passthrough[name] = value
            elif isinstance(value, torch.Tensor) and value.dim() == 0 and value.is_floating_point():
                injected[name] = value
            elif isinstance(value, numbers.Real) and not isinstance(value, bool):
                injected[name] = value
            elif callable(value) and not isinstance(value, GradientTransformation):
                schedules[name] = value
            else:
                passthrough[name] = value
        # Build once with plain values so that argument errors surface now, not at init.
        factory(*args, **passthrough, **injected, **{n: s(0) for n, s in schedules.items()})

        def hyperparams_at(count: torch.Tensor, stored: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            values = dict(stored)
            for name, schedule in schedules.items():
                values[name] = _as_tensor(schedule(count), count.device)
            return values

        def init(params: Params) -> InjectHyperparamsState:
            device = init_count(params).device
            count = init_count(params)
            hyperparams = {name: _as_tensor(v, device) for name, v in injected.items()}
            hyperparams = hyperparams_at(count, hyperparams)
            inner = factory(*args, **passthrough, **hyperparams)
            return InjectHyperparamsState(count=count, hyperparams=hyperparams, inner_state=inner.init(params))

        def update(
            updates: Updates, state: InjectHyperparamsState, params: Params | None = None
        ) -> tuple[Updates, InjectHyperparamsState]:
            if not isinstance(state, InjectHyperparamsState):
                raise ValueError(f"state must be an InjectHyperparamsState, got {type(state).__name__}")
            expected = set(injected) | set(schedules)
            if set(state.hyperparams) != expected:
                raise ValueError(
                    f"state.hyperparams has keys {sorted(state.hyperparams)}, expected {sorted(expected)}"
                )
            hyperparams = hyperparams_at(state.count, state.hyperparams)
            inner = factory(*args, **passthrough, **hyperparams)
            updates, inner_state = inner.update(updates, state.inner_state, params)
            return updates, InjectHyperparamsState(state.count + 1, hyperparams, inner_state)

        return GradientTransformation(init, update)

    return wrapped
