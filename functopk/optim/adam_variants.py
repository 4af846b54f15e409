"""NAdam, RAdam and Adamax with the semantics of their ``torch.optim`` namesakes.

optax has optimizers of these names with other semantics: optax's ``nadam`` is
``adam(nesterov=True)``, a constant ``b1`` look-ahead without NAdam's momentum
schedule; its ``radam`` switches at ``rho_t >= 5`` (torch: ``> 5``) and adds ``eps``
to the bias-corrected root; neither has weight decay or ``maximize``, nor does its
``adamax`` (whose update is otherwise torch's). These follow torch: the same state
entries, hyperparameters and defaults, and torch's foreach kernels in torch's
order where rounding depends on it. Every step-dependent quantity (bias corrections, NAdam's
momentum schedule and its running product, RAdam's rectification and its
``rho_t > 5`` switch) is computed on device from the 0-d int64 step counter, in
float64 (:func:`functopk.tree.foreach.scalar_dtype`): nothing is read back to the host.

Every numeric hyperparameter may be a 0-d tensor (so these work under
:func:`functopk.inject_hyperparams`) and the learning rate may be a schedule;
every argument after ``learning_rate`` is keyword-only.

``TORCH_BUILDERS`` maps each torch class name to a function of torch's param-group
dict returning the equivalent transformation; ``TORCH_STATE_NAMES`` maps each
state field to torch's per-parameter state key. Each is written once as a
:class:`~functopk.build.Formula` (pure and in place from the same maths).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, cast

import torch

from functopk._checks import check_bool, check_hyperparam, check_scalar_or_schedule, group_scalar, is_zero
from functopk.base import GradientTransformation, ScalarOrSchedule, init_count, recorded
from functopk.build import Formula, leafwise
from functopk.inplace import Body
from functopk.optim._shared import Hyper, Leaves, decoupled_decay, first_moves, is_number
from functopk.optim.adaptive import adam_config, adam_moments
from functopk.tree import foreach, torch_rounding
from functopk.tree.maths import PyTree
from functopk.tree.writer import Writer

__all__ = [
    "TORCH_BUILDERS", "TORCH_STATE_NAMES", "AdamaxState", "NadamState", "RadamState", "adamax", "nadam", "radam",
]  # fmt: skip


# --------------------------------------------------------------------------- shared pieces


class _Config(NamedTuple):
    """The checked hyperparameters the three optimizers share."""

    learning_rate: Any  # a number, a 0-d tensor or a schedule
    b1: Hyper
    b2: Hyper
    eps: Hyper
    weight_decay: Hyper
    decoupled: bool
    maximize: bool
    foreach: Any = None  # torch's implementation flag: whose rounding of a tensor lr to follow

    @property
    def has_decay(self) -> bool:
        return not is_zero(self.weight_decay)


def _config(
    learning_rate: Any, b1: Any, b2: Any, eps: Any, weight_decay: Any, decoupled: Any, maximize: Any, foreach: Any
) -> _Config:
    """Check the shared hyperparameters (``TypeError``/``ValueError`` naming the argument)."""
    learning_rate = check_scalar_or_schedule(learning_rate, "learning_rate", minimum=0.0)
    adam = adam_config(b1, b2, eps, 0.0, maximize=maximize)
    weight_decay = check_hyperparam(weight_decay, "weight_decay", minimum=0.0)
    decoupled = check_bool(decoupled, "decoupled_weight_decay")
    # foreach: any value, as torch takes it (functopk.tree.torch_rounding.torch_foreach)
    return _Config(learning_rate, adam.b1, adam.b2, adam.eps, weight_decay, decoupled, adam.maximize, foreach)


def _first_moves(new: Any, grads: Leaves, params: Leaves | None, cfg: _Config) -> Leaves:
    """torch's first moves (:func:`~functopk.optim._shared.first_moves`): negate, then the coupled decay."""
    coupled = cfg.weight_decay if cfg.has_decay and not cfg.decoupled else None
    return first_moves(new, grads, params, cfg.maximize, coupled)


def _moments(w: Writer, g: Leaves, fields: tuple[Any, ...], cfg: _Config) -> tuple[Leaves, Leaves]:
    return adam_moments(w, g, fields[0], fields[1], cfg.b1, cfg.b2)


def _formula(prepare: Any, cfg: _Config, sliced: bool = False) -> Formula:  # (b1, b2 meet state kernels)
    return Formula(prepare, in_place=is_number(cfg.b1) and is_number(cfg.b2), sliced=sliced)


def _decoupled_decay(params: Leaves | None, lr: Hyper, cfg: _Config, like: Leaves) -> Any:
    """``decayed(out, params)``: ``out += -lr * weight_decay * params`` (decoupled decay, as torch), else ``out``."""
    if not (cfg.has_decay and cfg.decoupled and params is not None):
        return lambda out, p: out
    return decoupled_decay(lr, cfg.weight_decay, like)


def _times(count: torch.Tensor) -> tuple[torch.Tensor, torch.dtype]:  # (t = count + 1 in the scalar dtype)
    dtype = foreach.scalar_dtype(count.device)
    return (count + 1).to(dtype), dtype


def _as(value: Hyper, dtype: torch.dtype) -> Hyper:  # (a tensor hyperparameter in the scalar dtype)
    return value.to(dtype) if isinstance(value, torch.Tensor) else value


def _learning_rate(cfg: _Config, count: torch.Tensor) -> Hyper:
    return cfg.learning_rate(count) if callable(cfg.learning_rate) else cfg.learning_rate


# --------------------------------------------------------------------------- NAdam


class NadamState(NamedTuple):
    """State of :func:`nadam`.

    Attributes:
        count: Number of updates done (0-d int64 tensor); torch's ``step``.
        mu_product: The running product of the momentum schedule ``mu_1 * ... * mu_t``
            (0-d, in torch's scalar dtype: float32, or float64 when that is the default dtype).
        mu: First moment, a tree like the parameters (torch's ``exp_avg``).
        nu: Second moment (torch's ``exp_avg_sq``).

    Example:
        >>> import torch
        >>> from functopk.optim.adam_variants import nadam
        >>> nadam().init({"w": torch.zeros(2)}).mu_product
        tensor(1.)
    """

    count: torch.Tensor  # type: ignore[assignment]
    mu_product: torch.Tensor
    mu: PyTree
    nu: PyTree


@recorded
def nadam(
    learning_rate: ScalarOrSchedule = 2e-3,
    *,
    b1: Hyper = 0.9,
    b2: Hyper = 0.999,
    eps: Hyper = 1e-8,
    weight_decay: Hyper = 0.0,
    momentum_decay: Hyper = 4e-3,
    decoupled_weight_decay: bool = False,
    maximize: bool = False,
    foreach: bool | None = None,
) -> GradientTransformation:
    """NAdam, Adam with Nesterov momentum (Dozat, 2016): ``torch.optim.NAdam``.

    With the momentum schedule ``mu_t = b1 * (1 - 0.5 * 0.96**(t * momentum_decay))``
    and its running product ``P_t = mu_1 * ... * mu_t`` (kept in the state), the
    update at step ``t`` (from 1) is
    ``-lr * ((1 - mu_t) / (1 - P_t) * g + mu_{t+1} / (1 - P_t * mu_{t+1}) * m) / (sqrt(v / (1 - b2**t)) + eps)``
    with Adam's moments ``m``, ``v``. ``weight_decay`` is coupled (added to the
    gradient) unless ``decoupled_weight_decay`` (NAdamW: ``-lr * weight_decay * params``
    added to the update), as in torch. optax's ``nadam`` differs: it is Adam with a
    Nesterov look-ahead of constant ``b1`` (no ``momentum_decay`` schedule, no
    running product) and has no weight decay or ``maximize``. ``betas=(b1, b2)`` in torch.

    ``P_t`` is kept as torch keeps it: one 0-d tensor in torch's scalar dtype (float32
    unless float64 is the default dtype; in float32 it moves float64 parameters by
    ~1e-9 relative in 40 steps against an all-float64 run, in torch as here).

    Args:
        learning_rate: A number, a 0-d tensor or a schedule ``step -> lr``.
        b1: Decay of the first moment, in ``[0, 1)``; also scales the momentum schedule.
        b2: Decay of the second moment, in ``[0, 1)``.
        eps: Added to the denominator, outside the square root.
        weight_decay: Weight decay, ``>= 0``: coupled (L2) or decoupled.
        momentum_decay: torch's ``momentum_decay`` (``psi``), ``>= 0``.
        decoupled_weight_decay: Decay the weights directly (AdamW-style) instead of through the gradient.
        maximize: Ascend the objective.
        foreach: torch's flag: the implementation whose rounding of a tensor ``learning_rate`` to follow
            (:func:`~functopk.tree.torch_rounding.torch_foreach`; ``None``: the for-loop's on the CPU).

    Example:
        >>> import torch
        >>> from functopk.optim.adam_variants import nadam
        >>> tx = nadam(0.1)
        >>> params = {"w": torch.tensor([1.0, 1.0])}
        >>> updates, state = tx.update({"w": torch.tensor([3.0, -0.5])}, tx.init(params), params)
        >>> updates["w"]   # first step: -0.1 * (1 + 0.1 * mu_2 / (1 - mu_1 * mu_2)) * sign(g), mu_t ~ 0.45
        tensor([-0.1056,  0.1056])
    """
    cfg = _config(learning_rate, b1, b2, eps, weight_decay, decoupled_weight_decay, maximize, foreach)
    return _nadam(cfg, check_hyperparam(momentum_decay, "momentum_decay", minimum=0.0))


def _nadam_schedule(
    cfg: _Config, momentum_decay: Hyper, count: torch.Tensor, mu_product: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """``(mu_t, mu_{t+1}, P_t as stored, P_t in float64, sqrt(1 - b2**t))`` on the count, in float64."""
    t, dtype = _times(count)
    b1, decay = _as(cfg.b1, dtype), _as(momentum_decay, dtype)
    mu = b1 * (1.0 - 0.5 * torch.pow(0.96, t * decay))
    mu_next = b1 * (1.0 - 0.5 * torch.pow(0.96, (t + 1.0) * decay))
    # in the stored dtype, as torch multiplies its running product (float32 in torch by default) by mu_t
    stored = mu_product * mu.to(mu_product.dtype)
    bc2_sqrt = torch.sqrt(1.0 - torch.pow(_as(cfg.b2, dtype), t))
    return mu, mu_next, stored, stored.to(dtype), bc2_sqrt


def _nadam_coefficients(
    cfg: _Config, momentum_decay: Hyper, count: torch.Tensor, mu_product: torch.Tensor, like: Leaves
) -> tuple[Any, Any, Hyper, torch.Tensor, Hyper]:
    """``(coef_g, coef_m, eps * sqrt(1 - b2**t), the new P_t, lr)``: the update is ``(coef_g * g + coef_m * m) /
    (sqrt(v) + eps * sqrt(1 - b2**t))``, each coefficient as torch rounds it."""
    mu, mu_next, stored, product, bc2_sqrt = _nadam_schedule(cfg, momentum_decay, count, mu_product)
    lr = _learning_rate(cfg, count)
    # torch: -lr * (1 - mu) / (1 - P) * g / d - lr * mu_next / (1 - P * mu_next) * m / d with
    # d = sqrt(v) / bc2_sqrt + eps; here d * bc2_sqrt = sqrt(v) + eps * bc2_sqrt, and bc2_sqrt
    # rides on the two coefficients.
    if torch_rounding.lr_in_float64(lr, cfg.foreach, like, rounded_by_foreach=False):
        coef_g = (lr * (1.0 - mu) / (1.0 - product)) * -bc2_sqrt
        coef_m = (lr * mu_next / (1.0 - product * mu_next)) * -bc2_sqrt
    else:  # torch's for-loop: -lr * (1 - mu) / (1 - P) and -lr * mu_next / (1 - P * mu_next) in lr's dtype
        coef_g = torch_rounding.lr_divided(torch_rounding.lr_times(lr, 1.0 - mu), 1.0 - product) * -bc2_sqrt
        coef_m = torch_rounding.lr_divided(torch_rounding.lr_times(lr, mu_next), 1.0 - product * mu_next) * -bc2_sqrt
    eps = foreach.for_leaves(cfg.eps * bc2_sqrt, like)
    return foreach.for_leaves(coef_g, like), foreach.for_leaves(coef_m, like), eps, stored, lr


def _nadam(cfg: _Config, momentum_decay: Hyper) -> GradientTransformation:
    def init(params: Leaves) -> NadamState:
        count = init_count(params)
        # torch's own dtype for it, so that the running product rounds as torch's does
        product = torch.ones((), dtype=torch_rounding.torch_scalar_dtype(count.device), device=count.device)
        zeros = foreach.zeros_like
        return NadamState(count=count, mu_product=product, mu=zeros(params), nu=zeros(params))

    def prepare(state: NadamState, like: Leaves, params: Leaves | None) -> tuple[Body, dict[str, Any]]:
        cg, cm, eps, stored, lr = _nadam_coefficients(cfg, momentum_decay, state.count, state.mu_product, like)
        decayed = _decoupled_decay(params, lr, cfg, like)

        def body(w: Writer, g: Leaves, fields: tuple[Any, ...], p: Leaves | None) -> tuple[Leaves, tuple[Any, ...]]:
            g = _first_moves(w.new, g, p, cfg)
            m, v = _moments(w, g, fields, cfg)
            denom = foreach.add_scalar_(foreach.sqrt(v), eps)
            if denom and denom[0].device.type == "cpu":  # leaf by leaf: a second fresh tree costs page faults
                for x, y, d in zip(g, m, denom):
                    torch.div(torch.mul(x, cg).addcmul_(y, cm), d, out=d)
                return decayed(denom, p), (m, v)
            num = foreach.addcmul_(foreach.mul(g, cg), m, [cm] * len(denom))  # (foreach kernels: one launch)
            return decayed(foreach.div_into(num, denom), p), (m, v)

        return body, {"count": state.count + 1, "mu_product": stored}

    return leafwise("nadam", formula=_formula(prepare, cfg), init=init, state=NadamState, tree_fields=("mu", "nu"),
                    needs_params=cfg.has_decay)  # fmt: skip


# --------------------------------------------------------------------------- RAdam


class RadamState(NamedTuple):
    """State of :func:`radam`.

    Attributes:
        count: Number of updates done (0-d int64 tensor); torch's ``step``.
        mu: First moment, a tree like the parameters (torch's ``exp_avg``).
        nu: Second moment (torch's ``exp_avg_sq``).

    Example:
        >>> import torch
        >>> from functopk.optim.adam_variants import radam
        >>> radam().init({"w": torch.zeros(2)})
        RadamState(count=tensor(0), mu={'w': tensor([0., 0.])}, nu={'w': tensor([0., 0.])})
    """

    count: torch.Tensor  # type: ignore[assignment]
    mu: PyTree
    nu: PyTree


@recorded
def radam(
    learning_rate: ScalarOrSchedule = 1e-3,
    *,
    b1: Hyper = 0.9,
    b2: Hyper = 0.999,
    eps: Hyper = 1e-8,
    weight_decay: Hyper = 0.0,
    decoupled_weight_decay: bool = False,
    maximize: bool = False,
    foreach: bool | None = None,
) -> GradientTransformation:
    """RAdam, Adam with a rectified adaptive learning rate (Liu et al., 2020): ``torch.optim.RAdam``.

    With ``rho_inf = 2 / (1 - b2) - 1`` and ``rho_t = rho_inf - 2 t b2**t / (1 - b2**t)``
    at step ``t`` (from 1), the update is
    ``-lr * r_t * sqrt(1 - b2**t) / (1 - b1**t) * m / (sqrt(v) + eps)`` with the
    rectification ``r_t = sqrt((rho_t - 4)(rho_t - 2) rho_inf / ((rho_inf - 4)(rho_inf - 2) rho_t))``
    while ``rho_t > 5``, and the SGD-with-momentum step ``-lr * m / (1 - b1**t)``
    before (the first 5 steps for ``b2 = 0.999``). The switch is a ``torch.where`` on
    the count: no host sync. ``weight_decay`` is coupled unless
    ``decoupled_weight_decay`` (RAdamW), as in torch. optax's ``radam`` differs: it
    rectifies from ``rho_t >= 5``, divides by ``sqrt(v / (1 - b2**t)) + eps`` (``eps``
    after the bias correction, torch adds it before) and has no weight decay or
    ``maximize``. ``betas=(b1, b2)`` in torch.

    Args:
        learning_rate: A number, a 0-d tensor or a schedule ``step -> lr``.
        b1: Decay of the first moment, in ``[0, 1)``.
        b2: Decay of the second moment, in ``[0, 1)``.
        eps: Added to the denominator, outside the square root.
        weight_decay: Weight decay, ``>= 0``: coupled (L2) or decoupled.
        decoupled_weight_decay: Decay the weights directly (AdamW-style) instead of through the gradient.
        maximize: Ascend the objective.
        foreach: torch's flag: the implementation whose rounding of a tensor ``learning_rate`` to follow
            (:func:`~functopk.tree.torch_rounding.torch_foreach`; ``None``: the for-loop's on the CPU).

    Example:
        >>> import torch
        >>> from functopk.optim.adam_variants import radam
        >>> tx = radam(0.1)
        >>> params = {"w": torch.tensor([1.0])}
        >>> updates, state = tx.update({"w": torch.tensor([3.0])}, tx.init(params), params)
        >>> updates["w"]   # unrectified first step: -0.1 * m / (1 - b1) = -0.1 * 3
        tensor([-0.3000])
    """
    return _radam(_config(learning_rate, b1, b2, eps, weight_decay, decoupled_weight_decay, maximize, foreach))


def _radam(cfg: _Config) -> GradientTransformation:
    def init(params: Leaves) -> RadamState:
        zeros = foreach.zeros_like
        return RadamState(count=init_count(params), mu=zeros(params), nu=zeros(params))

    def prepare(state: RadamState, like: Leaves, params: Leaves | None) -> tuple[Body, dict[str, Any]]:
        lr = _learning_rate(cfg, state.count)
        wide = torch_rounding.lr_in_float64(lr, cfg.foreach, like, rounded_by_foreach=True)
        adaptive, plain = (foreach.for_leaves(c, like) for c in _radam_coefficients(cfg, state.count, lr, wide))
        decayed = _decoupled_decay(params, lr, cfg, like)

        def body(w: Writer, g: Leaves, fields: tuple[Any, ...], p: Leaves | None) -> tuple[Leaves, tuple[Any, ...]]:
            m, v = _moments(w, _first_moves(w.new, g, p, cfg), fields, cfg)
            out = foreach.mul_(foreach.div_into(m, foreach.add_scalar_(foreach.sqrt(v), cfg.eps)), adaptive)
            out = foreach.addcmul_(out, m, [cast(torch.Tensor, plain)] * len(out))  # 0 * m if rectified
            return decayed(out, p), (m, v)

        return body, {"count": state.count + 1}

    return leafwise("radam", formula=_formula(prepare, cfg), init=init, state=RadamState, tree_fields=("mu", "nu"),
                    needs_params=cfg.has_decay)  # fmt: skip


def _radam_coefficients(
    cfg: _Config, count: torch.Tensor, lr: Hyper, wide: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(c_adaptive, c_plain)``: the update is ``c_adaptive * m / (sqrt(v) + eps) + c_plain * m``.

    One of the two is zero: ``c_plain = -lr / (1 - b1**t)`` until ``rho_t > 5``,
    then ``c_adaptive = -lr * r_t * sqrt(1 - b2**t) / (1 - b1**t)``; computed with
    torch's expressions, in float64 (in a tensor ``lr``'s dtype unless ``wide``,
    as torch's foreach RAdam does), chosen by ``torch.where`` on device.
    """
    t, dtype = _times(count)
    b1, b2 = _as(cfg.b1, dtype), _as(cfg.b2, dtype)
    rho_inf = 2.0 / (1.0 - b2) - 1.0
    b2_t = torch.pow(b2, t)
    rho_t = rho_inf - 2.0 * t * b2_t / (1.0 - b2_t)
    ratio = (rho_t - 4.0) * (rho_t - 2.0) * rho_inf / ((rho_inf - 4.0) * (rho_inf - 2.0) * rho_t)
    rectified = rho_t > 5.0
    zero = torch.zeros((), dtype=dtype, device=count.device)
    # the clamp only matters on the branch torch.where drops (rho_t <= 5, where the ratio can be < 0):
    # it keeps NaN out of that branch and of any gradient taken through it
    rect = torch.where(rectified, torch.sqrt(torch.clamp_min(ratio, 0.0)), zero)
    bc1 = 1.0 - torch.pow(b1, t)
    if wide:
        adaptive = torch.sqrt(1.0 - b2_t) * (lr * rect / bc1) * -1.0
        plain = torch.where(rectified, zero, (lr / bc1) * -1.0)
    else:  # sqrt(1 - b2**t) * (lr * rect / bc1) * -1 and (lr / bc1) * -1, each step in lr's dtype
        scaled = torch_rounding.lr_divided(torch_rounding.lr_times(lr, rect), bc1)
        adaptive = torch_rounding.lr_times(scaled, torch.sqrt(1.0 - b2_t)) * -1.0
        plain = torch.where(rectified, zero, torch_rounding.lr_divided(lr, bc1) * -1.0)
    return adaptive, plain


# --------------------------------------------------------------------------- Adamax


class AdamaxState(NamedTuple):
    """State of :func:`adamax`.

    Attributes:
        count: Number of updates done (0-d int64 tensor); torch's ``step``.
        mu: First moment, a tree like the parameters (torch's ``exp_avg``).
        nu: Exponentially weighted infinity norm of the gradients (torch's ``exp_inf``).

    Example:
        >>> import torch
        >>> from functopk.optim.adam_variants import adamax
        >>> adamax().init({"w": torch.zeros(2)}).nu
        {'w': tensor([0., 0.])}
    """

    count: torch.Tensor  # type: ignore[assignment]
    mu: PyTree
    nu: PyTree


@recorded
def adamax(
    learning_rate: ScalarOrSchedule = 2e-3,
    *,
    b1: Hyper = 0.9,
    b2: Hyper = 0.999,
    eps: Hyper = 1e-8,
    weight_decay: Hyper = 0.0,
    maximize: bool = False,
    foreach: bool | None = None,
) -> GradientTransformation:
    """Adamax, Adam with the infinity norm (Kingma & Ba, 2015): ``torch.optim.Adamax``.

    ``m = b1 * m + (1 - b1) * g``, ``u = max(b2 * u, |g| + eps)`` (both from zero) and
    the update is ``-lr / (1 - b1**t) * m / u`` at step ``t`` (from 1).
    ``weight_decay`` is coupled (added to the gradient), as in torch. optax's
    ``adamax`` computes the same update but has no ``weight_decay`` or ``maximize``
    (and no default learning rate; torch's is 2e-3). ``betas=(b1, b2)`` in torch.

    Args:
        learning_rate: A number, a 0-d tensor or a schedule ``step -> lr``.
        b1: Decay of the first moment, in ``[0, 1)``.
        b2: Decay of the infinity norm, in ``[0, 1)``.
        eps: Added to ``|g|`` before the maximum (torch's place for it).
        weight_decay: Coupled weight decay, ``>= 0``.
        maximize: Ascend the objective.
        foreach: torch's flag: the implementation whose rounding of a tensor ``learning_rate`` to follow
            (:func:`~functopk.tree.torch_rounding.torch_foreach`; ``None``: the for-loop's on the CPU).

    Example:
        >>> import torch
        >>> from functopk.optim.adam_variants import adamax
        >>> tx = adamax(0.1, eps=0.0)
        >>> params = {"w": torch.tensor([1.0, 1.0])}
        >>> updates, state = tx.update({"w": torch.tensor([2.0, -4.0])}, tx.init(params), params)
        >>> updates["w"]   # -0.1 * (0.1 * g / 0.1) / |g|
        tensor([-0.1000,  0.1000])
    """
    return _adamax(_config(learning_rate, b1, b2, eps, weight_decay, False, maximize, foreach))


def _adamax(cfg: _Config) -> GradientTransformation:
    def init(params: Leaves) -> AdamaxState:
        zeros = foreach.zeros_like
        return AdamaxState(count=init_count(params), mu=zeros(params), nu=zeros(params))

    def prepare(state: AdamaxState, like: Leaves, params: Leaves | None) -> tuple[Body, dict[str, Any]]:
        t, dtype = _times(state.count)
        lr = _learning_rate(cfg, state.count)
        bc1 = 1.0 - torch.pow(_as(cfg.b1, dtype), t)
        # torch's for-loop divides a tensor lr in its dtype, its foreach kernel reads it on the host
        wide = torch_rounding.lr_in_float64(lr, cfg.foreach, like, rounded_by_foreach=False)
        step = foreach.for_leaves((lr / bc1 if wide else torch_rounding.lr_divided(lr, bc1)) * -1.0, like)

        def body(w: Writer, g: Leaves, fields: tuple[Any, ...], p: Leaves | None) -> tuple[Leaves, tuple[Any, ...]]:
            g = _first_moves(w.new, g, p, cfg)
            m = w.lerp(fields[0], g, 1.0 - cfg.b1)
            u = foreach.maximum_(w.mul(fields[1], cfg.b2), foreach.add_scalar_(w.new.abs(g), cfg.eps))
            return foreach.mul_(w.new.div(m, u), step), (m, u)  # m / u

        return body, {"count": state.count + 1}

    return leafwise("adamax", formula=_formula(prepare, cfg, sliced=True), init=init, state=AdamaxState,
                    tree_fields=("mu", "nu"), needs_params=cfg.has_decay)  # fmt: skip


# --------------------------------------------------------------------------- torch.optim correspondence


def torch_config(group: dict[str, Any]) -> _Config:
    """The checked hyperparameters of a torch NAdam, RAdam or Adamax param group (its other keys ignored)."""
    b1, b2 = group["betas"]
    return _config(
        group_scalar(group["lr"]), group_scalar(b1), group_scalar(b2), group_scalar(group["eps"]),
        group_scalar(group["weight_decay"]), group.get("decoupled_weight_decay", False), group.get("maximize", False),
        group.get("foreach"),
    )  # fmt: skip


TORCH_BUILDERS: dict[str, Callable[[dict[str, Any]], GradientTransformation]] = {
    "NAdam": lambda group: _nadam(
        torch_config(group), check_hyperparam(group_scalar(group["momentum_decay"]), "momentum_decay", minimum=0.0)
    ),
    "RAdam": lambda group: _radam(torch_config(group)),
    "Adamax": lambda group: _adamax(torch_config(group)),
}
"""torch class name -> a function of that class's param-group dict (``opt.param_groups[0]``) giving its equivalent."""

TORCH_STATE_NAMES: dict[str, dict[str, str]] = {
    "NAdam": {"count": "step", "mu_product": "mu_product", "mu": "exp_avg", "nu": "exp_avg_sq"},
    "RAdam": {"count": "step", "mu": "exp_avg", "nu": "exp_avg_sq"},
    "Adamax": {"count": "step", "mu": "exp_avg", "nu": "exp_inf"},
}
"""torch class name -> {state field: torch's per-parameter state key}."""
