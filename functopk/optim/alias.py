"""Optimizers with the semantics of their ``torch.optim`` namesakes.

Each alias is a :class:`~functopk.GradientTransformation` whose updates, added
to the parameters with :func:`functopk.apply_updates`, reproduce the parameters
``torch.optim`` computes with the same hyperparameters (tested step by step to
1e-6 relative in float32). ``sgd``, ``rmsprop`` and ``adagrad`` are chains of the
elementary transformations; ``adam`` and ``adamw`` are one fused transformation
(Adam's kernel with the learning rate folded into its last multiply).

Every numeric hyperparameter may be a 0-d tensor, so every alias works under
:func:`functopk.inject_hyperparams`; learning rates may also be schedules. A
tensor is read on device at every update, never copied at construction: an
in-place change (``lr.fill_(...)``, as torch's LR schedulers do to a tensor
``lr``) takes effect at the next update, as in ``torch.optim``.

Every argument after ``learning_rate`` is keyword-only: these follow
``torch.optim``'s semantics and defaults, and optax's positional orders differ
(optax's 5th positional argument of ``adam`` is ``eps_root``), so a positional
call could silently mean something else.
"""

from __future__ import annotations

import torch

from functopk._checks import check_bool, check_hyperparam, check_scalar_or_schedule, is_zero
from functopk.base import GradientTransformation, ScalarOrSchedule, recorded
from functopk.combine import MaskOrFn, chain
from functopk.optim._shared import Hyper
from functopk.optim.adaptive import AdamDecay, adam_config, adam_transform
from functopk.optim.elementary import add_decayed_weights, scale, scale_by_learning_rate, scale_by_schedule, trace
from functopk.optim.rms import scale_by_rms, scale_by_rss
from functopk.tree import torch_rounding
from functopk.tree.foreach import scalar_dtype

__all__ = ["adagrad", "adam", "adamw", "rmsprop", "sgd"]


def _prefix(maximize: bool, weight_decay: Hyper) -> list[GradientTransformation]:
    """``torch.optim``'s first two moves: negate the gradient (``maximize``), add ``weight_decay * params``."""
    parts = []
    if check_bool(maximize, "maximize"):
        parts.append(scale(-1.0))
    if not is_zero(weight_decay):
        parts.append(add_decayed_weights(weight_decay))
    return parts


@recorded
def sgd(
    learning_rate: ScalarOrSchedule,
    *,
    momentum: Hyper = 0.0,
    nesterov: bool = False,
    dampening: Hyper = 0.0,
    weight_decay: Hyper = 0.0,
    maximize: bool = False,
) -> GradientTransformation:
    """Stochastic gradient descent with optional momentum: ``torch.optim.SGD``.

    ``chain([scale(-1)], [add_decayed_weights(weight_decay)], [trace(momentum, nesterov, dampening=dampening)],
    scale_by_learning_rate(learning_rate))``, where the bracketed parts appear only
    when needed (``maximize``, a non-zero weight decay, a momentum; a 0-d tensor
    counts as non-zero), so the state is the tuple of the present parts' states.

    Args:
        learning_rate: A number, a 0-d tensor or a schedule ``step -> lr``.
        momentum: Momentum coefficient ``>= 0``; 0 means plain SGD (no buffer kept).
        nesterov: Nesterov momentum (needs ``momentum > 0`` and ``dampening == 0``, as in torch).
        dampening: Dampening of the momentum; the first step is undamped, as in torch.
        weight_decay: Coupled weight decay (L2): ``weight_decay * params`` added to the gradient.
        maximize: Ascend the objective instead (negate the gradient first).

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
    learning_rate = check_scalar_or_schedule(learning_rate, "learning_rate")
    momentum = check_hyperparam(momentum, "momentum", minimum=0.0)
    check_bool(nesterov, "nesterov")
    dampening = check_hyperparam(dampening, "dampening", minimum=0.0)
    weight_decay = check_hyperparam(weight_decay, "weight_decay", minimum=0.0)
    has_momentum = not is_zero(momentum)
    if nesterov and not has_momentum:
        raise ValueError("nesterov=True needs momentum > 0")
    parts = _prefix(maximize, weight_decay)
    if has_momentum:
        parts.append(trace(momentum, nesterov, dampening=dampening))
    parts.append(scale_by_learning_rate(learning_rate))
    return chain(*parts)


@recorded
def adam(
    learning_rate: ScalarOrSchedule = 1e-3,
    *,
    b1: Hyper = 0.9,
    b2: Hyper = 0.999,
    eps: Hyper = 1e-8,
    weight_decay: Hyper = 0.0,
    amsgrad: bool = False,
    maximize: bool = False,
    eps_root: Hyper = 0.0,
) -> GradientTransformation:
    """Adam (Kingma & Ba, 2015): ``torch.optim.Adam``.

    Equal to ``chain([scale(-1)], [add_decayed_weights(weight_decay)], scale_by_adam(b1, b2, eps,
    eps_root, amsgrad=amsgrad), scale_by_learning_rate(learning_rate))`` up to rounding,
    but computed as one transformation (state :class:`ScaleByAdamState`) so that
    the learning rate rides on Adam's last multiply. ``weight_decay`` is coupled
    (added to the gradient, L2), as in ``torch.optim.Adam``; see :func:`adamw`
    for decoupled decay. ``betas=(b1, b2)`` in torch.

    Args:
        learning_rate: A number, a 0-d tensor or a schedule ``step -> lr``.
        b1: Decay of the first moment.
        b2: Decay of the second moment.
        eps: Added to the denominator, outside the square root (as in torch).
        weight_decay: Coupled weight decay.
        amsgrad: The AMSGrad variant (Reddi et al., 2018).
        maximize: Ascend the objective.
        eps_root: Added inside the square root (not in torch; 0 by default).

    Example:
        >>> import torch, functopk as ft
        >>> tx = ft.adam(0.1)
        >>> params = {"w": torch.tensor([1.0, 1.0])}
        >>> updates, state = tx.update({"w": torch.tensor([3.0, -0.5])}, tx.init(params), params)
        >>> updates["w"]   # the first Adam step moves each coordinate by lr against its gradient's sign
        tensor([-0.1000,  0.1000])
    """
    cfg = adam_config(b1, b2, eps, eps_root, amsgrad=amsgrad, maximize=maximize)
    return adam_transform(cfg, learning_rate, AdamDecay(weight_decay, decoupled=False))


@recorded
def adamw(
    learning_rate: ScalarOrSchedule = 1e-3,
    *,
    b1: Hyper = 0.9,
    b2: Hyper = 0.999,
    eps: Hyper = 1e-8,
    weight_decay: Hyper = 1e-2,
    amsgrad: bool = False,
    maximize: bool = False,
    eps_root: Hyper = 0.0,
    mask: MaskOrFn | None = None,
) -> GradientTransformation:
    """Adam with decoupled weight decay (Loshchilov & Hutter, 2019): ``torch.optim.AdamW``.

    The update is ``-learning_rate * (adam_direction + weight_decay * params)``,
    i.e. ``params * (1 - lr * weight_decay)`` minus the Adam step, as torch computes
    it. Equal, up to rounding, to ``chain(scale_by_adam(...), add_decayed_weights(weight_decay,
    mask), scale_by_learning_rate(learning_rate))``, computed as one transformation.

    Args:
        learning_rate: A number, a 0-d tensor or a schedule ``step -> lr``.
        b1: Decay of the first moment.
        b2: Decay of the second moment.
        eps: Added to the denominator, outside the square root.
        weight_decay: Decoupled weight decay (torch's default 1e-2).
        amsgrad: The AMSGrad variant.
        maximize: Ascend the objective.
        eps_root: Added inside the square root (not in torch; 0 by default).
        mask: Which parameters to decay: a tree of bools or a function ``params -> tree of bools``
            (e.g. no decay for biases and norm layers); ``None`` decays all.

    Example:
        >>> import torch, functopk as ft
        >>> tx = ft.adamw(0.1, weight_decay=0.5)
        >>> params = {"w": torch.tensor([2.0])}
        >>> updates, _ = tx.update({"w": torch.tensor([1.0])}, tx.init(params), params)
        >>> updates["w"]   # -0.1 * (1 + 0.5 * 2)
        tensor([-0.2000])
    """
    cfg = adam_config(b1, b2, eps, eps_root, amsgrad=amsgrad, maximize=maximize)
    return adam_transform(cfg, learning_rate, AdamDecay(weight_decay, decoupled=True, mask=mask))


@recorded
def rmsprop(
    learning_rate: ScalarOrSchedule = 1e-2,
    *,
    alpha: Hyper = 0.99,
    eps: Hyper = 1e-8,
    weight_decay: Hyper = 0.0,
    momentum: Hyper = 0.0,
    centered: bool = False,
    maximize: bool = False,
) -> GradientTransformation:
    """RMSprop: ``torch.optim.RMSprop``.

    ``chain([scale(-1)], [add_decayed_weights(weight_decay)], scale_by_rms(alpha, eps,
    eps_in_sqrt=False, centered=centered), [trace(momentum)], scale_by_learning_rate(learning_rate))``:
    ``eps`` outside the square root, no bias correction, the momentum buffer starting at zero, all as
    in torch (optax's ``rmsprop`` differs: ``eps`` inside the root, decay 0.9).

    Args:
        learning_rate: A number, a 0-d tensor or a schedule ``step -> lr``.
        alpha: Decay of the running mean of squared gradients.
        eps: Added to the root.
        weight_decay: Coupled weight decay.
        momentum: Momentum applied to the scaled update.
        centered: Normalise by the estimated variance instead of the second moment.
        maximize: Ascend the objective.

    Example:
        >>> import torch, functopk as ft
        >>> tx = ft.rmsprop(0.1, alpha=0.75)
        >>> params = {"w": torch.tensor([1.0])}
        >>> tx.update({"w": torch.tensor([2.0])}, tx.init(params), params)[0]["w"]   # -0.1 * 2 / sqrt(0.25 * 4)
        tensor([-0.2000])
    """
    momentum = check_hyperparam(momentum, "momentum", minimum=0.0)
    weight_decay = check_hyperparam(weight_decay, "weight_decay", minimum=0.0)
    learning_rate = check_scalar_or_schedule(learning_rate, "learning_rate")
    parts = _prefix(maximize, weight_decay)
    parts.append(scale_by_rms(alpha, eps, eps_in_sqrt=False, centered=centered))
    if not is_zero(momentum):
        parts.append(trace(momentum))
    parts.append(scale_by_learning_rate(learning_rate))
    return chain(*parts)


@recorded
def adagrad(
    learning_rate: ScalarOrSchedule = 1e-2,
    *,
    lr_decay: Hyper = 0.0,
    weight_decay: Hyper = 0.0,
    initial_accumulator_value: Hyper = 0.0,
    eps: Hyper = 1e-10,
    maximize: bool = False,
) -> GradientTransformation:
    """Adagrad (Duchi et al., 2011): ``torch.optim.Adagrad``.

    ``chain([scale(-1)], [add_decayed_weights(weight_decay)], scale_by_rss(initial_accumulator_value,
    eps, eps_in_sqrt=False), scale_by_learning_rate(lr_t))`` with ``lr_t = learning_rate / (1 + t * lr_decay)`` at
    step ``t`` (from 0), torch's learning-rate decay. optax's ``adagrad`` differs:
    ``eps`` inside the root (1e-7), ``initial_accumulator_value=0.1``.

    Args:
        learning_rate: A number, a 0-d tensor or a schedule ``step -> lr``.
        lr_decay: torch's ``lr_decay``, ``>= 0``.
        weight_decay: Coupled weight decay.
        initial_accumulator_value: Starting value of the sum of squares.
        eps: Added to the root of the sum.
        maximize: Ascend the objective.

    Example:
        >>> import torch, functopk as ft
        >>> tx = ft.adagrad(0.1, eps=0.0)
        >>> params = {"w": torch.tensor([1.0])}
        >>> tx.update({"w": torch.tensor([-4.0])}, tx.init(params), params)[0]["w"]   # -0.1 * -4 / sqrt(16)
        tensor([0.1000])
    """
    learning_rate = check_scalar_or_schedule(learning_rate, "learning_rate")
    lr_decay = check_hyperparam(lr_decay, "lr_decay", minimum=0.0)
    weight_decay = check_hyperparam(weight_decay, "weight_decay", minimum=0.0)
    parts = _prefix(maximize, weight_decay)
    parts.append(scale_by_rss(initial_accumulator_value, eps, eps_in_sqrt=False))
    if is_zero(lr_decay):
        parts.append(scale_by_learning_rate(learning_rate))
    else:

        def decayed(count: torch.Tensor) -> torch.Tensor:
            lr = learning_rate(count) if callable(learning_rate) else learning_rate
            # In float64 (scale_by_schedule casts it to float32 unless a leaf is float64), as torch's Python float.
            # (a tensor lr divides in its dtype, as torch's lr / (1 + t * lr_decay) does)
            return -torch_rounding.lr_divided(lr, 1.0 + count.to(scalar_dtype(count.device)) * lr_decay)

        parts.append(scale_by_schedule(decayed))
    return chain(*parts)
