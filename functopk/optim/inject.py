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

from functopk._checks import check_callable, check_state
from functopk.base import GradientTransformation, OptState, Params, Updates, init_count, with_recipe
from functopk.sparse.opt_state import shared_fields

__all__ = ["InjectHyperparamsState", "inject_hyperparams"]


@shared_fields("hyperparams")  # one value for all coordinates, where sparse_optimizer keeps a state per coordinate
class InjectHyperparamsState(NamedTuple):
    """State of :func:`inject_hyperparams`.

    Attributes:
        count: Number of updates done (0-d int64 tensor); schedules are evaluated on it.
        hyperparams: The current value of each injected hyperparameter: a 0-d int64 tensor for
            one given as an int or an integer tensor (so a count such as ``k`` stays exact),
            a 0-d float64 tensor for one given as a float64 tensor, a 0-d float32 tensor otherwise.
            Replace an entry to change it: the next update uses the new value
            (entries given as schedules are recomputed from ``count`` at every update).
        inner_state: The state of the wrapped transformation.

    Example:
        >>> import torch, functopk as ft
        >>> state = ft.inject_hyperparams(ft.sgd)(learning_rate=0.1).init({"w": torch.zeros(2)})
        >>> state.hyperparams
        {'learning_rate': tensor(0.1000)}
    """

    count: torch.Tensor  # type: ignore[assignment]
    hyperparams: dict[str, torch.Tensor]
    inner_state: OptState


def _dtype_of(value: Any) -> torch.dtype:
    """int64 for an int (not a bool) or an integer tensor, so counts stay exact; float64 for a float64
    tensor (exact learning rates for float64 models); float32 for the rest."""
    if isinstance(value, torch.Tensor):
        if value.dtype == torch.float64:
            return torch.float64
        return torch.float32 if value.is_floating_point() else torch.int64
    return torch.int64 if isinstance(value, numbers.Integral) else torch.float32


def _is_number(value: Any) -> bool:
    """A real number (not a bool) or a 0-d real tensor: what is injected."""
    if isinstance(value, torch.Tensor):
        return value.dim() == 0 and not value.is_complex() and value.dtype != torch.bool
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _split(kwargs: dict[str, Any], static: frozenset[str]) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """The keyword arguments sorted into injected numbers, schedules and the ones passed through."""
    injected, schedules, passthrough = {}, {}, {}
    for name, value in kwargs.items():
        if name in static:
            passthrough[name] = value
        elif _is_number(value):
            injected[name] = value
        elif callable(value) and not isinstance(value, GradientTransformation):
            schedules[name] = value
        else:
            passthrough[name] = value
    return injected, schedules, passthrough


def inject_hyperparams(
    factory: Callable[..., GradientTransformation], static_args: Iterable[str] = ()
) -> Callable[..., GradientTransformation]:
    """Wrap a transformation factory so that its numeric hyperparameters live in the state.

    Keyword arguments that are real numbers (not bools), 0-d real tensors or
    callables (schedules ``step -> value``) are *injected*: stored as 0-d
    tensors in :class:`InjectHyperparamsState` and passed to ``factory`` as
    tensors at every update. An int (or an integer tensor) is stored as int64, so a
    count such as ``topk``'s ``k`` stays exact at any size; a float64 tensor as float64
    (give ``torch.tensor(lr, dtype=torch.float64)`` for float64-exact rates); every
    other number as float32 (a schedule's value likewise, at every step). Everything
    else (bools, strings, ``None``, transformations), positional arguments, and
    names listed in ``static_args`` are passed through unchanged. The factory must
    accept 0-d tensors for the injected arguments;
    every functopk factory does (the optimizers take an integer tensor for a real
    hyperparameter given as an int, e.g. ``weight_decay=0``). Every callable is
    taken for a schedule: list function-valued arguments that are not schedules
    (masks, ``partition`` labels) in ``static_args``.

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
    check_callable(factory, "factory")
    static = frozenset(static_args)

    def wrapped(*args: Any, **kwargs: Any) -> GradientTransformation:
        injected, schedules, passthrough = _split(kwargs, static)
        # Build once with plain values so that argument errors surface now, not at init.
        factory(*args, **passthrough, **injected, **{n: s(0) for n, s in schedules.items()})
        expected = set(injected) | set(schedules)

        def as_tensors(values: dict[str, Any], device: torch.device) -> dict[str, torch.Tensor]:
            return {n: torch.as_tensor(v, dtype=_dtype_of(v), device=device) for n, v in values.items()}

        def hyperparams_at(count: torch.Tensor, stored: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            return {**stored, **as_tensors({n: s(count) for n, s in schedules.items()}, count.device)}

        def init(params: Params) -> InjectHyperparamsState:
            count = init_count(params)
            hyperparams = hyperparams_at(count, as_tensors(injected, count.device))
            inner = factory(*args, **passthrough, **hyperparams)
            return InjectHyperparamsState(count=count, hyperparams=hyperparams, inner_state=inner.init(params))

        def update(
            updates: Updates, state: InjectHyperparamsState, params: Params | None = None
        ) -> tuple[Updates, InjectHyperparamsState]:
            check_state(state, InjectHyperparamsState, "inject_hyperparams")
            if set(state.hyperparams) != expected:
                raise ValueError(f"state.hyperparams has keys {sorted(state.hyperparams)}, expected {sorted(expected)}")
            hyperparams = hyperparams_at(state.count, state.hyperparams)
            inner = factory(*args, **passthrough, **hyperparams)
            updates, inner_state = inner.update(updates, state.inner_state, params)
            return updates, InjectHyperparamsState(state.count + 1, hyperparams, inner_state)

        return with_recipe(GradientTransformation(init, update), _injected, (factory, static, args), kwargs)

    return wrapped


def _injected(
    factory: Callable[..., GradientTransformation], static: frozenset[str], args: tuple[Any, ...], **kwargs: Any
) -> GradientTransformation:
    """``inject_hyperparams(factory, static)(*args, **kwargs)``: how an injected transformation is unpickled."""
    return inject_hyperparams(factory, static)(*args, **kwargs)
