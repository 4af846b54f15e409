"""Adam's scaling: its moments, its bias-corrected direction, and the one Adam kernel.

RMSprop's running average of squares and Adagrad's sum are in :mod:`functopk.optim.rms`.

Each keeps per-coordinate statistics of the gradient in its state and divides by
them. The update maths follows the foreach implementations in ``torch.optim``
(the same kernels, in the same order, wherever rounding depends on it) and runs
as a fixed, short list of foreach kernels (:mod:`functopk.tree.foreach`); bias
corrections are computed on the 0-d int64 step counter in float64, so nothing is
read back to the host.

The optimizers of :mod:`functopk.optim.alias` build on these: ``adam``/``adamw``
call the same Adam kernel (:func:`adam_transform`) with the learning rate (and
the weight decay) folded into its last multiply, which saves one pass over the
parameters per step.
"""

from __future__ import annotations

import math
import struct
from typing import Any, NamedTuple

import torch

from functopk._checks import check_bool, check_hyperparam, check_scalar_or_schedule, is_zero
from functopk.base import GradientTransformation, ScalarOrSchedule, init_count, recorded
from functopk.build import Formula, leafwise
from functopk.combine import MaskOrFn
from functopk.inplace import Body
from functopk.optim._shared import Hyper, Leaves, decoupled_decay, first_moves, is_number, with_mask
from functopk.tree import foreach, torch_rounding
from functopk.tree.maths import PyTree
from functopk.tree.writer import Writer

__all__ = ["ScaleByAdamState", "scale_by_adam"]


def ema_sq(w: Writer, avg: Leaves, grads: Leaves, decay: Hyper) -> Leaves:
    """``decay * avg + (1 - decay) * grads**2`` as ``torch.optim`` computes it (``mul`` then ``addcmul``), the
    new ``avg`` through the writer ``w`` (:mod:`functopk.tree.writer`)."""
    new = w.mul(avg, decay)
    if isinstance(decay, torch.Tensor):  # the foreach ``value`` must be a Python number
        return foreach.addcmul_(new, foreach.mul(grads, 1.0 - decay), grads)
    return foreach.addcmul_(new, grads, grads, value=1.0 - decay)


def adam_moments(w: Writer, g: Leaves, mu: Leaves, nu: Leaves, b1: Hyper, b2: Hyper) -> tuple[Leaves, Leaves]:
    """Adam's new moments through the writer ``w`` (:mod:`functopk.tree.writer`): ``lerp`` into the first,
    ``mul`` and ``addcmul`` into the second, as ``torch.optim`` (Adam, AdamW, NAdam, RAdam)."""
    return w.lerp(mu, g, 1.0 - b1), ema_sq(w, nu, g, b2)


def check_optional(field: Leaves | None, wanted: bool, owner: str, name: str, option: str) -> None:
    """``ValueError`` when an optional state buffer is there without its option, or missing with it."""
    if (field is not None) != wanted:
        has = "has a" if field is not None else "has no"
        raise ValueError(
            f"{owner}'s state {has} {name}: it was made with {option}={not wanted}, this is {option}={wanted}"
        )


# --------------------------------------------------------------------------- Adam


class ScaleByAdamState(NamedTuple):
    """State of :func:`scale_by_adam` (and of :func:`functopk.adam`, :func:`functopk.adamw`).

    Attributes:
        count: Number of updates done (0-d int64 tensor); bias corrections use ``count + 1``.
        mu: First moment (running mean of the gradients), a tree like the parameters.
        nu: Second moment (running mean of the squared gradients).
        nu_max: With ``amsgrad``, the running maximum of ``nu``; ``None`` otherwise.

    Example:
        >>> import torch, functopk as ft
        >>> state = ft.adam(0.1).init({"w": torch.zeros(2)})
        >>> state.count, state.mu, state.nu_max
        (tensor(0), {'w': tensor([0., 0.])}, None)
    """

    count: torch.Tensor  # type: ignore[assignment]
    mu: PyTree
    nu: PyTree
    nu_max: PyTree | None


class AdamConfig(NamedTuple):
    """Adam's checked hyperparameters (see :func:`adam_config`)."""

    b1: Hyper
    b2: Hyper
    eps: Hyper
    eps_root: Hyper
    amsgrad: bool
    maximize: bool


class AdamDecay(NamedTuple):
    """The weight decay of :func:`adam_transform`: coupled (Adam's L2) or decoupled (AdamW's), with a mask."""

    weight_decay: Hyper
    decoupled: bool
    mask: MaskOrFn | None = None


def adam_config(
    b1: Hyper, b2: Hyper, eps: Hyper, eps_root: Hyper, *, amsgrad: bool = False, maximize: bool = False
) -> AdamConfig:
    """Check Adam's hyperparameters (``TypeError``/``ValueError`` naming the argument) and group them."""
    return AdamConfig(
        b1=check_hyperparam(b1, "b1", minimum=0.0, below=1.0),
        b2=check_hyperparam(b2, "b2", minimum=0.0, below=1.0),
        eps=check_hyperparam(eps, "eps", minimum=0.0),
        eps_root=check_hyperparam(eps_root, "eps_root", minimum=0.0),
        amsgrad=check_bool(amsgrad, "amsgrad"),
        maximize=check_bool(maximize, "maximize"),
    )


def _absorbed_floor(eps: float, b2: float, dtype: torch.dtype) -> float | None:
    """``finfo(dtype).tiny`` if ``sqrt`` of it vanishes when added to ``eps * sqrt(1 - b2**t)`` for every ``t >= 1``.

    The smallest such sum's term is ``c = eps * sqrt(1 - b2)`` (``1 - b2**t`` grows with
    ``t``); a 1e-6 margin covers its rounding in float64, and rounding to ``dtype`` keeps
    the order. ``sqrt(tiny) < ulp(c) / 4`` in ``dtype`` makes ``sqrt(x) + c == c`` (round
    to nearest) for ``0 <= x <= tiny``. Pure Python: no tensor, no host read.
    """
    if not (eps > 0 and 0 <= b2 < 1):
        return None
    finfo = torch.finfo(dtype)
    low = eps * math.sqrt(1.0 - b2) * (1 - 1e-6)
    if not finfo.tiny <= low <= finfo.max:
        return None
    if dtype == torch.float32:
        low = struct.unpack("f", struct.pack("f", low))[0]
    ulp = math.ldexp(1.0, math.frexp(low)[1] - (24 if dtype == torch.float32 else 53))
    return finfo.tiny if math.sqrt(finfo.tiny) < ulp / 4 else None


def sqrt_floor(cfg: AdamConfig, nu: Leaves) -> float | None:
    """A floor for ``nu`` that changes no bit of ``sqrt(nu) + eps * sqrt(bc2)``, or ``None``.

    ``sqrt`` of zeros and subnormals takes a slow path on CPUs (about 5-15x the time
    of normal values), and a top-k'd gradient leaves most of ``nu`` at zero; with
    Python ``eps > 0`` and ``b2``, no ``eps_root``, and one float32 or float64 dtype,
    ``nu`` clamped below at ``finfo.tiny`` gives the same denominators.

    Example:
        >>> import torch
        >>> from functopk.optim.adaptive import adam_config
        >>> sqrt_floor(adam_config(0.9, 0.999, 1e-8, 0.0), [torch.zeros(2)])
        1.1754943508222875e-38
        >>> sqrt_floor(adam_config(0.9, 0.999, 0.0, 0.0), [torch.zeros(2)]) is None
        True
    """
    hyper = (cfg.eps, cfg.b2)
    if not nu or any(isinstance(h, (torch.Tensor, bool)) or not isinstance(h, (int, float)) for h in hyper):
        return None
    dtype = nu[0].dtype
    if not is_zero(cfg.eps_root) or dtype not in (torch.float32, torch.float64) or any(x.dtype != dtype for x in nu):
        return None
    return _absorbed_floor(float(cfg.eps), float(cfg.b2), dtype)


class AdamScalars(NamedTuple):
    """The scalars of an Adam step (:func:`adam_scalars`), each as :func:`~functopk.tree.foreach.for_leaves` made it."""

    eps_root: Hyper | None  # eps_root * (1 - b2**t), added to nu inside the root; None without eps_root
    eps: Hyper  # eps * sqrt(1 - b2**t), added to the root
    step: Hyper  # sqrt(1 - b2**t) / (1 - b1**t), times -lr when there is one


def adam_scalars(count: torch.Tensor, cfg: AdamConfig, lr: Hyper | None, like: Leaves) -> AdamScalars:
    """The bias corrections of step ``count + 1`` folded into Adam's scalars, on the tensor counter in float64
    (as torch.optim's Python floats): ``sqrt(nu)/sqrt(bc2) + eps`` is computed as ``(sqrt(nu) + eps*sqrt(bc2)) /
    sqrt(bc2)``, with the outer division, ``1 / bc1`` and ``-lr`` folded into one final multiply."""
    dtype = foreach.scalar_dtype(count.device)
    t = (count + 1).to(dtype)
    bc1 = 1.0 - torch.pow(cfg.b1.to(dtype) if isinstance(cfg.b1, torch.Tensor) else cfg.b1, t)
    bc2 = 1.0 - torch.pow(cfg.b2.to(dtype) if isinstance(cfg.b2, torch.Tensor) else cfg.b2, t)
    bc2_sqrt = torch.sqrt(bc2)
    root = None if is_zero(cfg.eps_root) else foreach.for_leaves(cfg.eps_root * bc2, like)
    if isinstance(lr, torch.Tensor):  # torch's lr / (1 - b1**t) is a tensor of lr's dtype (float32: rounded)
        step = bc2_sqrt * -torch_rounding.lr_divided(lr, bc1)
    else:
        step = bc2_sqrt / bc1 if lr is None else bc2_sqrt / bc1 * -lr
    return AdamScalars(root, foreach.for_leaves(cfg.eps * bc2_sqrt, like), foreach.for_leaves(step, like))


def adam_direction(mu: Leaves, nu: Leaves, s: AdamScalars, cfg: AdamConfig, floor_zeros: bool = False) -> Leaves:
    """``mu_hat / (sqrt(nu_hat + eps_root) + eps)``, times ``-lr`` when given, in fresh buffers.

    Four kernels (``sqrt``, ``add``, ``div``, ``mul``; one more with ``eps_root``),
    the scalars from :func:`adam_scalars`. The result is written into the
    denominator's buffers where that is cheaper (:func:`~functopk.tree.foreach.div_into`).
    ``floor_zeros`` (for mostly-zero ``nu``, as after a top-k) floors ``nu`` by
    :func:`sqrt_floor` first where that changes no bit: one more kernel, and
    ``sqrt`` avoids its slow path for zeros.
    """
    if s.eps_root is not None:
        nu = foreach.add_scalar(nu, s.eps_root)
    floor = sqrt_floor(cfg, nu) if floor_zeros else None
    if floor is None:
        roots = foreach.sqrt(nu)
    else:  # the same bits, without sqrt's slow path for zeros
        roots = list(torch._foreach_clamp_min(list(nu), floor))
        torch._foreach_sqrt_(roots)
    return foreach.mul_(foreach.div_into(mu, foreach.add_scalar_(roots, s.eps)), s.step)


def adam_transform(
    cfg: AdamConfig, learning_rate: ScalarOrSchedule | None = None, decay: AdamDecay | None = None
) -> GradientTransformation:
    """The one Adam kernel behind :func:`scale_by_adam`, :func:`functopk.adam` and :func:`functopk.adamw`.

    Without ``learning_rate`` it emits ``mu_hat / (sqrt(nu_hat + eps_root) + eps)``.
    With it, the emitted update is ``-learning_rate`` times that, plus the weight
    decay: coupled (``weight_decay * params`` added to the gradient first, as
    ``torch.optim.Adam``) or decoupled (``-learning_rate * weight_decay * params``
    added to the update, as ``torch.optim.AdamW``), the latter restricted to the
    decay's mask. ``cfg.maximize`` negates the gradient first.

    Kernel count per step (Python hyperparameters, no decay): ``lerp``, ``mul``,
    ``addcmul`` for the moments, ``sqrt``, ``add``, ``div``, ``mul`` for the
    update: seven, the last folding bias corrections and the learning rate together.
    """
    if learning_rate is not None:
        learning_rate = check_scalar_or_schedule(learning_rate, "learning_rate")
    if decay is not None:
        decay = decay._replace(weight_decay=check_hyperparam(decay.weight_decay, "weight_decay", minimum=0.0))
        if decay.decoupled and learning_rate is None:
            raise ValueError("decoupled weight decay needs a learning_rate")
        if decay.mask is not None and not decay.decoupled:
            raise ValueError("mask applies to decoupled weight decay only")
        if is_zero(decay.weight_decay):
            decay = None
    name = "scale_by_adam" if learning_rate is None else "adamw" if decay and decay.decoupled else "adam"

    def init(params: Leaves) -> ScaleByAdamState:
        zeros = foreach.zeros_like
        nu_max = zeros(params) if cfg.amsgrad else None
        return ScaleByAdamState(count=init_count(params), mu=zeros(params), nu=zeros(params), nu_max=nu_max)

    def make(flags: list[bool] | None) -> GradientTransformation:
        def prepare(state: ScaleByAdamState, like: Leaves, params: Leaves | None) -> tuple[Body, dict[str, Any]]:
            check_optional(state.nu_max, cfg.amsgrad, name, "nu_max", "amsgrad")
            lr = learning_rate(state.count) if callable(learning_rate) else learning_rate
            scalars = adam_scalars(state.count, cfg, lr, like)
            decay_ = None
            if decay is not None and decay.decoupled and lr is not None:
                decay_ = decoupled_decay(lr, decay.weight_decay, like)

            def body(w: Writer, g: Leaves, fields: tuple[Any, ...], p: Leaves | None) -> tuple[Leaves, tuple[Any, ...]]:
                coupled = None if decay is None or decay.decoupled else decay.weight_decay
                g = first_moves(w.new, g, p, cfg.maximize, coupled)
                mu, nu = adam_moments(w, g, fields[0], fields[1], cfg.b1, cfg.b2)
                nu_max = None if fields[2] is None else w.maximum(fields[2], nu)  # present iff cfg.amsgrad
                out = adam_direction(mu, nu if nu_max is None else nu_max, scalars, cfg, w.mostly_zero)
                if decay_ is not None and p is not None:  # AdamW's decay into the fresh updates, where the mask keeps
                    decay_(out, p, flags)
                return out, (mu, nu, nu_max)

            return body, {"count": state.count + 1}

        formula = Formula(prepare, in_place=is_number(cfg.b1) and is_number(cfg.b2))
        return leafwise(
            name, formula=formula, init=init, state=ScaleByAdamState, tree_fields=("mu", "nu", "nu_max"),
            needs_params=decay is not None,
        )

    return with_mask(make, decay.mask if decay is not None else None, name)


@recorded
def scale_by_adam(
    b1: Hyper = 0.9, b2: Hyper = 0.999, eps: Hyper = 1e-8, eps_root: Hyper = 0.0, *, amsgrad: bool = False
) -> GradientTransformation:
    """Rescale updates by Adam's bias-corrected moments (Kingma & Ba, 2015), with optax's arguments.

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
        amsgrad: Use the running maximum of the second moment (keyword only: optax
            has a separate ``scale_by_amsgrad``).

    Example:
        >>> import torch, functopk as ft
        >>> tx = ft.scale_by_adam()
        >>> updates, state = tx.update({"w": torch.tensor([0.5, -2.0])}, tx.init({"w": torch.zeros(2)}))
        >>> updates["w"].round(decimals=4)    # the first step is the sign of the gradient, up to eps
        tensor([ 1., -1.])
    """
    return adam_transform(adam_config(b1, b2, eps, eps_root, amsgrad=amsgrad))
