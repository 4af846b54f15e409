"""Optimizers as chains of elementary transformations."""

from __future__ import annotations

from functopk.base import GradientTransformation, ScalarOrSchedule, identity
from functopk.combine import chain
import torch

from functopk.transforms import check_hyperparam, scale_by_learning_rate, trace

__all__ = ["sgd"]


def sgd(
    learning_rate: ScalarOrSchedule, momentum: float | torch.Tensor = 0.0, nesterov: bool = False
) -> GradientTransformation:
    """Stochastic gradient descent, with optional (Nesterov) momentum.

    ``chain(trace(momentum, nesterov), scale_by_learning_rate(learning_rate))``,
    which matches ``torch.optim.SGD(lr, momentum, nesterov=nesterov)``.

    Args:
        learning_rate: A number or a schedule ``step -> lr``.
        momentum: Momentum coefficient ``>= 0``; 0 means plain SGD (no state kept). A 0-d
            tensor (from :func:`functopk.inject_hyperparams`) always keeps a momentum buffer.
        nesterov: Nesterov momentum (needs ``momentum > 0``).

    Example:
        >>> import torch, functopk as ft
        >>> tx = ft.sgd(0.1, momentum=0.9)
        >>> params = {"w": torch.tensor([1.0])}
        >>> state = tx.init(params)
        >>> for _ in range(2):
        ...     updates, state = tx.update({"w": torch.tensor([1.0])}, state, params)
        ...     params = ft.apply_updates(params, updates)
        >>> params["w"]   # 1 - 0.1 * 1 - 0.1 * (1 + 0.9)
        tensor([0.7100])
    """
    momentum = check_hyperparam(momentum, "momentum", minimum=0.0)
    if not isinstance(nesterov, bool):
        raise TypeError(f"nesterov must be a bool, got {type(nesterov).__name__}")
    has_momentum = isinstance(momentum, torch.Tensor) or momentum > 0.0
    if nesterov and not has_momentum:
        raise ValueError("nesterov=True needs momentum > 0")
    return chain(
        trace(momentum, nesterov) if has_momentum else identity(),
        scale_by_learning_rate(learning_rate),
    )
