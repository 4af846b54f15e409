"""Adaptive scalings: Adam's moments, RMSprop's running average of squares, Adagrad's sum.

Each keeps per-coordinate statistics of the gradient in its state and divides by
them. The update maths follows the foreach implementations in ``torch.optim``
(the same kernels, in the same order, wherever rounding depends on it) and runs
as a fixed, short list of ``torch._foreach_*`` kernels; bias corrections are
computed on the 0-d int64 step counter in float64, so nothing is read back to
the host.

The optimizers of :mod:`functopk.alias` build on these: ``adam``/``adamw`` call
the same Adam kernel with the learning rate (and the weight decay) folded into
its last multiply, which saves one pass over the parameters per step.
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
from functopk.base import GradientTransformation, Params, ScalarOrSchedule, Updates, init_count
from functopk.combine import MaskOrFn, resolve_mask
from functopk.tree.foreach import add_scaled, for_leaves, keep_dtypes, mul, scalar_dtype
from functopk.tree.foreach import full_like as full_like_leaves
from functopk.tree.maths import PyTree
from functopk.tree.maths import zeros_like as tree_zeros_like

__all__ = [
    "ScaleByAdamState",
    "ScaleByRmsState",
    "ScaleByRssState",
    "scale_by_adam",
    "scale_by_rms",
    "scale_by_rss",
]


def _ema(avg: list[torch.Tensor], grads: list[torch.Tensor], decay: float | torch.Tensor) -> list[torch.Tensor]:
    """``decay * avg + (1 - decay) * grads`` with one ``lerp`` kernel, as ``torch.optim`` computes it.

    A tensor ``decay`` goes in as a list of 0-d weights (the foreach ``lerp`` has
    no overload for a single tensor weight), which the per-tensor kernels broadcast.
    """
    if isinstance(decay, torch.Tensor):
        return keep_dtypes(torch._foreach_lerp(avg, grads, [1.0 - decay] * len(avg)), avg)
    return list(torch._foreach_lerp(avg, grads, 1.0 - decay))


def _ema_sq(avg: list[torch.Tensor], grads: list[torch.Tensor], decay: float | torch.Tensor) -> list[torch.Tensor]:
    """``decay * avg + (1 - decay) * grads**2``, as ``torch.optim`` computes it (``mul`` then ``addcmul``)."""
    new = mul(avg, decay)
    if isinstance(decay, torch.Tensor):
        torch._foreach_addcmul_(new, mul(grads, 1.0 - decay), grads, value=1.0)
    else:
        torch._foreach_addcmul_(new, grads, grads, value=1.0 - decay)
    return new


def div_into(numerators: list[torch.Tensor], denominators: list[torch.Tensor]) -> list[torch.Tensor]:
    """``numerators / denominators``, written into ``denominators`` (fresh buffers owned by the caller).

    Saves allocating a tree per step; on CPU a fresh tree costs page faults as well
    as memory, since glibc hands large freed blocks back to the system.
    """
    torch.ops.aten._foreach_div.List_out(numerators, denominators, out=denominators)
    return denominators


class ScaleByAdamState(NamedTuple):
    """State of :func:`scale_by_adam` (and of :func:`functopk.adam`, :func:`functopk.adamw`).

    Attributes:
        count: Number of updates done (0-d int64 tensor); bias corrections use ``count + 1``.
        mu: First moment (running mean of the gradients), a tree like the parameters.
        nu: Second moment (running mean of the squared gradients).
        nu_max: With ``amsgrad``, the running maximum of ``nu``; ``None`` otherwise.
    """

    count: torch.Tensor
    mu: PyTree
    nu: PyTree
    nu_max: PyTree | None


def adam_transform(
    b1: float | torch.Tensor,
    b2: float | torch.Tensor,
    eps: float | torch.Tensor,
    eps_root: float | torch.Tensor,
    amsgrad: bool,
    *,
    learning_rate: ScalarOrSchedule | None = None,
    weight_decay: float | torch.Tensor = 0.0,
    decoupled: bool = False,
    mask: MaskOrFn | None = None,
    maximize: bool = False,
) -> GradientTransformation:
    """The one Adam kernel behind :func:`scale_by_adam`, :func:`functopk.adam` and :func:`functopk.adamw`.

    Without ``learning_rate`` it emits ``mu_hat / (sqrt(nu_hat + eps_root) + eps)``.
    With it, the emitted update is ``-learning_rate`` times that, plus the weight
    decay: coupled (``weight_decay * params`` added to the gradient first, as
    ``torch.optim.Adam``) or decoupled (``-learning_rate * weight_decay * params``
    added to the update, as ``torch.optim.AdamW``), restricted to ``mask``.
    ``maximize`` negates the gradient first.

    Kernel count per step (Python hyperparameters, no decay): ``lerp``, ``mul``,
    ``addcmul`` for the moments, ``sqrt``, ``add`` for the denominator, ``div``
    and ``mul`` for the update: seven, one of them folding bias corrections and
    the learning rate together. ``sqrt(nu)/sqrt(bc2) + eps`` is computed as
    ``(sqrt(nu) + eps*sqrt(bc2)) / sqrt(bc2)`` with the outer division folded into
    the final multiply: the same number up to rounding.
    """
    b1 = check_hyperparam(b1, "b1", minimum=0.0, below=1.0)
    b2 = check_hyperparam(b2, "b2", minimum=0.0, below=1.0)
    eps = check_hyperparam(eps, "eps", minimum=0.0)
    eps_root = check_hyperparam(eps_root, "eps_root", minimum=0.0)
    check_bool(amsgrad, "amsgrad")
    check_bool(maximize, "maximize")
    if learning_rate is not None:
        learning_rate = check_scalar_or_schedule(learning_rate, "learning_rate")
    weight_decay = check_hyperparam(weight_decay, "weight_decay", minimum=0.0)
    decay = not is_zero(weight_decay)
    if decoupled and learning_rate is None:
        raise ValueError("decoupled weight decay needs a learning_rate")
    if mask is not None and not decoupled:
        raise ValueError("mask applies to decoupled weight decay only")

    def init(params: Params) -> ScaleByAdamState:
        if mask is not None:
            resolve_mask(mask, params)
        return ScaleByAdamState(
            count=init_count(params),
            mu=tree_zeros_like(params),
            nu=tree_zeros_like(params),
            nu_max=tree_zeros_like(params) if amsgrad else None,
        )

    def update(
        updates: Updates, state: ScaleByAdamState, params: Params | None = None
    ) -> tuple[Updates, ScaleByAdamState]:
        check_same_structure(state.mu, updates, name="updates", expected_name="the Adam state")
        if decay:
            params = require_params(params, "adamw" if decoupled else "adam with weight_decay")
            check_same_structure(state.mu, params, name="params", expected_name="the Adam state")
        grads, treedef = optree.tree_flatten(updates)
        count = state.count
        if not grads:
            return updates, state._replace(count=count + 1)
        p_leaves = optree.tree_leaves(params) if decay else []
        mu, nu = optree.tree_leaves(state.mu), optree.tree_leaves(state.nu)

        if maximize:
            grads = list(torch._foreach_neg(grads))
        if decay and not decoupled:
            grads = add_scaled(grads, weight_decay, p_leaves)
        new_mu = _ema(mu, grads, b1)
        new_nu = _ema_sq(nu, grads, b2)
        new_nu_max = None
        denom_src = new_nu
        if amsgrad:
            new_nu_max = list(torch._foreach_maximum(optree.tree_leaves(state.nu_max), new_nu))
            denom_src = new_nu_max

        # Bias corrections on the tensor counter, in float64 (as torch.optim's Python floats).
        dtype = scalar_dtype(count.device)
        t = (count + 1).to(dtype)
        bc1 = 1.0 - torch.pow(b1.to(dtype) if isinstance(b1, torch.Tensor) else b1, t)
        bc2 = 1.0 - torch.pow(b2.to(dtype) if isinstance(b2, torch.Tensor) else b2, t)
        bc2_sqrt = torch.sqrt(bc2)
        if is_zero(eps_root):
            denom = list(torch._foreach_sqrt(denom_src))
        else:
            denom = list(torch._foreach_sqrt(torch._foreach_add(denom_src, for_leaves(eps_root * bc2, grads))))
        torch._foreach_add_(denom, for_leaves(eps * bc2_sqrt, grads))
        step = bc2_sqrt / bc1
        lr = None
        if learning_rate is not None:
            lr = learning_rate(count) if callable(learning_rate) else learning_rate
            step = step * -lr
        # The update is written into the denominator's buffers: one allocation fewer per step.
        out = div_into(new_mu, denom)
        torch._foreach_mul_(out, for_leaves(step, grads))
        if decay and decoupled:
            idx = list(range(len(out))) if mask is None else [i for i, f in enumerate(resolve_mask(mask, params)) if f]
            coef = for_leaves(-lr * weight_decay, grads)
            if idx and isinstance(coef, torch.Tensor):
                torch._foreach_add_([out[i] for i in idx], torch._foreach_mul([p_leaves[i] for i in idx], coef))
            elif idx:
                torch._foreach_add_([out[i] for i in idx], [p_leaves[i] for i in idx], alpha=coef)

        def tree(leaves: list[torch.Tensor]) -> PyTree:
            return optree.tree_unflatten(treedef, leaves)

        return tree(out), ScaleByAdamState(
            count=count + 1,
            mu=tree(new_mu),
            nu=tree(new_nu),
            nu_max=None if new_nu_max is None else tree(new_nu_max),
        )

    return GradientTransformation(init, update)


def scale_by_adam(
    b1: float | torch.Tensor = 0.9,
    b2: float | torch.Tensor = 0.999,
    eps: float | torch.Tensor = 1e-8,
    eps_root: float | torch.Tensor = 0.0,
    amsgrad: bool = False,
) -> GradientTransformation:
    """Rescale updates by Adam's bias-corrected moments (Kingma & Ba, 2015).

    With ``mu = b1 * mu + (1 - b1) * g`` and ``nu = b2 * nu + (1 - b2) * g**2``
    (both from zero) and ``t`` the step number from 1, the update is
    ``mu_hat / (sqrt(nu_hat + eps_root) + eps)`` where ``mu_hat = mu / (1 - b1**t)``
    and ``nu_hat = nu / (1 - b2**t)``: ``torch.optim.Adam``'s step before the
    learning rate. With ``amsgrad`` (Reddi et al., 2018) ``nu`` in the denominator
    is replaced by its running maximum, as ``torch.optim.Adam(amsgrad=True)`` does
    (the maximum of the raw ``nu``, bias-corrected at the current step).

    Args:
        b1: Decay of the first moment, in ``[0, 1)``.
        b2: Decay of the second moment, in ``[0, 1)``.
        eps: Added to the denominator outside the square root (torch's ``eps``).
        eps_root: Added inside the square root (0 in torch; useful when
            differentiating through the update).
        amsgrad: Use the running maximum of the second moment.

    Example:
        >>> import torch, functopk as ft
        >>> tx = ft.scale_by_adam()
        >>> updates, state = tx.update({"w": torch.tensor([0.5, -2.0])}, tx.init({"w": torch.zeros(2)}))
        >>> updates["w"].round(decimals=4)    # the first step is the sign of the gradient, up to eps
        tensor([ 1., -1.])
    """
    return adam_transform(b1, b2, eps, eps_root, amsgrad)


class ScaleByRmsState(NamedTuple):
    """State of :func:`scale_by_rms`.

    Attributes:
        nu: Running mean of the squared gradients.
        mu: With ``centered``, the running mean of the gradients; ``None`` otherwise.
    """

    nu: PyTree
    mu: PyTree | None


def scale_by_rms(
    decay: float | torch.Tensor = 0.99,
    eps: float | torch.Tensor = 1e-8,
    initial_scale: float | torch.Tensor = 0.0,
    centered: bool = False,
    eps_in_sqrt: bool = False,
) -> GradientTransformation:
    """Divide updates by the root of a running mean of their squares (RMSprop, Tieleman & Hinton, 2012).

    ``nu = decay * nu + (1 - decay) * g**2`` and the update is ``g / (sqrt(nu) + eps)``,
    as in ``torch.optim.RMSprop`` (``decay`` is its ``alpha``). With ``centered`` the
    running mean ``mu`` of the gradients is kept too and the denominator is
    ``sqrt(nu - mu**2) + eps`` (Graves, 2013). ``eps_in_sqrt=True`` puts ``eps``
    inside the root instead (``g / sqrt(nu + eps)``, optax's default).

    Args:
        decay: Decay of the running means, in ``[0, 1)``.
        eps: Keeps the denominator away from zero.
        initial_scale: The starting value of ``nu`` (0 in torch).
        centered: Subtract the squared running mean of the gradients.
        eps_in_sqrt: Add ``eps`` under the square root.

    Example:
        >>> import torch, functopk as ft
        >>> tx = ft.scale_by_rms(decay=0.75)
        >>> updates, _ = tx.update({"w": torch.tensor([2.0])}, tx.init({"w": torch.zeros(1)}))
        >>> updates["w"]    # 2 / sqrt(0.25 * 4)
        tensor([2.])
    """
    decay = check_hyperparam(decay, "decay", minimum=0.0, below=1.0)
    eps = check_hyperparam(eps, "eps", minimum=0.0)
    initial_scale = check_hyperparam(initial_scale, "initial_scale", minimum=0.0)
    check_bool(centered, "centered")
    check_bool(eps_in_sqrt, "eps_in_sqrt")

    def init(params: Params) -> ScaleByRmsState:
        leaves, treedef = optree.tree_flatten(params)
        nu = optree.tree_unflatten(treedef, full_like_leaves(leaves, initial_scale))
        return ScaleByRmsState(nu=nu, mu=tree_zeros_like(params) if centered else None)

    def update(
        updates: Updates, state: ScaleByRmsState, params: Params | None = None
    ) -> tuple[Updates, ScaleByRmsState]:
        del params
        check_same_structure(state.nu, updates, name="updates", expected_name="the RMS state")
        grads, treedef = optree.tree_flatten(updates)
        if not grads:
            return updates, state
        new_nu = _ema_sq(optree.tree_leaves(state.nu), grads, decay)
        new_mu = None
        square = new_nu
        if centered:
            new_mu = _ema(optree.tree_leaves(state.mu), grads, decay)
            square = list(torch._foreach_addcmul(new_nu, new_mu, new_mu, value=-1.0))
        if eps_in_sqrt:
            denom = list(torch._foreach_sqrt(torch._foreach_add(square, eps)))
        else:
            denom = list(torch._foreach_sqrt(square))
            torch._foreach_add_(denom, eps)
        out = keep_dtypes(div_into(grads, denom), grads)
        return optree.tree_unflatten(treedef, out), ScaleByRmsState(
            nu=optree.tree_unflatten(treedef, new_nu),
            mu=None if new_mu is None else optree.tree_unflatten(treedef, new_mu),
        )

    return GradientTransformation(init, update)


class ScaleByRssState(NamedTuple):
    """State of :func:`scale_by_rss`: the running sum of squared gradients."""

    sum_of_squares: PyTree


def scale_by_rss(
    initial_accumulator_value: float | torch.Tensor = 0.0, eps: float | torch.Tensor = 1e-10
) -> GradientTransformation:
    """Divide updates by the root of the sum of all squared gradients so far (Adagrad, Duchi et al., 2011).

    ``s = s + g**2`` and the update is ``g / (sqrt(s) + eps)``, as in
    ``torch.optim.Adagrad`` (whose defaults these are). optax's ``scale_by_rss``
    puts ``eps`` under the root and starts at 0.1; this one follows torch.

    Args:
        initial_accumulator_value: The starting value of the sum, ``>= 0``.
        eps: Added to the root of the sum.

    Example:
        >>> import torch, functopk as ft
        >>> tx = ft.scale_by_rss(eps=0.0)
        >>> state = tx.init({"w": torch.zeros(1)})
        >>> for g in (3.0, 4.0):
        ...     updates, state = tx.update({"w": torch.tensor([g])}, state)
        >>> updates["w"]    # 4 / sqrt(9 + 16)
        tensor([0.8000])
    """
    initial_accumulator_value = check_hyperparam(initial_accumulator_value, "initial_accumulator_value", minimum=0.0)
    eps = check_hyperparam(eps, "eps", minimum=0.0)

    def init(params: Params) -> ScaleByRssState:
        leaves, treedef = optree.tree_flatten(params)
        return ScaleByRssState(optree.tree_unflatten(treedef, full_like_leaves(leaves, initial_accumulator_value)))

    def update(
        updates: Updates, state: ScaleByRssState, params: Params | None = None
    ) -> tuple[Updates, ScaleByRssState]:
        del params
        check_same_structure(state.sum_of_squares, updates, name="updates", expected_name="the RSS state")
        grads, treedef = optree.tree_flatten(updates)
        if not grads:
            return updates, state
        new_sum = list(torch._foreach_addcmul(optree.tree_leaves(state.sum_of_squares), grads, grads, value=1.0))
        denom = list(torch._foreach_sqrt(new_sum))
        torch._foreach_add_(denom, eps)
        out = keep_dtypes(div_into(grads, denom), grads)
        return optree.tree_unflatten(treedef, out), ScaleByRssState(optree.tree_unflatten(treedef, new_sum))

    return GradientTransformation(init, update)
