"""Classic optimizers at ``torch.optim`` parity: Adadelta, Rprop and ASGD.

Each is one leafwise transformation whose state mirrors the per-parameter
state ``torch.optim`` keeps (see :data:`TORCH_STATE_NAMES`), and whose update
runs the kernels of torch's foreach implementation in the same order, so that
``apply_updates(params, updates)`` reproduces torch's new parameters up to the
last bit or two. Every argument after ``learning_rate`` is keyword-only.

:data:`TORCH_BUILDERS` maps a torch class name to a function that builds the
matching transformation from a ``torch.optim`` param group (its
hyperparameter dict).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, cast

import torch

from functopk._checks import check_bool, check_hyperparam, check_scalar_or_schedule, describe, group_scalar, is_zero
from functopk.base import GradientTransformation, ScalarOrSchedule, init_count, recorded
from functopk.build import Formula, leafwise
from functopk.inplace import Body
from functopk.optim._shared import Hyper, Leaves, first_moves, is_number
from functopk.optim.adaptive import ema_sq
from functopk.tree import foreach, torch_rounding
from functopk.tree.maths import PyTree
from functopk.tree.writer import Writer

__all__ = [
    "TORCH_BUILDERS", "TORCH_STATE_NAMES", "AdadeltaState", "AsgdState", "RpropState", "adadelta", "asgd", "rprop",
]  # fmt: skip


def _at_most(value: Hyper, name: str, maximum: float) -> Hyper:
    """``value`` unless it is a number above ``maximum`` (``ValueError``); tensors are not read."""
    if not isinstance(value, torch.Tensor) and value > maximum:
        raise ValueError(f"{name} must be <= {maximum}, got {value}")
    return value


def _pair(value: Any, name: str) -> tuple[Any, Any]:
    """A two-element tuple or list (of numbers or 0-d tensors, checked by the caller), else ``TypeError``."""
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        raise TypeError(f"{name} must be a pair (a tuple of two numbers or 0-d tensors), got {describe(value)}")
    return value[0], value[1]


def _value_at(learning_rate: Any, count: torch.Tensor) -> Hyper:  # (a schedule's value, or the constant)
    return learning_rate(count) if callable(learning_rate) else learning_rate


# --------------------------------------------------------------------------- Adadelta


class AdadeltaState(NamedTuple):
    """State of :func:`adadelta`, as ``torch.optim.Adadelta`` keeps it.

    Attributes:
        count: Number of updates done (0-d int64 tensor); torch's ``step``.
        square_avg: Running mean of the squared gradients (torch's ``square_avg``).
        acc_delta: Running mean of the squared updates (torch's ``acc_delta``).

    Example:
        >>> import torch
        >>> from functopk.optim.classic import adadelta
        >>> adadelta().init({"w": torch.zeros(2)})
        AdadeltaState(count=tensor(0), square_avg={'w': tensor([0., 0.])}, acc_delta={'w': tensor([0., 0.])})
    """

    count: torch.Tensor  # type: ignore[assignment]
    square_avg: PyTree
    acc_delta: PyTree


@recorded
def adadelta(
    learning_rate: ScalarOrSchedule = 1.0,
    *,
    rho: Hyper = 0.9,
    eps: Hyper = 1e-6,
    weight_decay: Hyper = 0.0,
    maximize: bool = False,
) -> GradientTransformation:
    """Adadelta (Zeiler, 2012): ``torch.optim.Adadelta``.

    With ``g`` the gradient (negated with ``maximize``, plus ``weight_decay * params``):
    ``v = rho * v + (1 - rho) * g**2``, ``delta = sqrt(u + eps) / sqrt(v + eps) * g``,
    ``u = rho * u + (1 - rho) * delta**2``, and the update is ``-learning_rate * delta``;
    computed with the kernels of torch's foreach implementation, in its order.

    ``optax.adadelta`` has the same maths but other defaults and arguments: its
    ``learning_rate`` defaults to ``None`` (torch and this alias: 1.0), it takes a
    ``weight_decay_mask`` and no ``maximize``, and its arguments are positional.

    Args:
        learning_rate: A number, a 0-d tensor or a schedule ``step -> lr`` (``>= 0``).
        rho: Decay of both running means, in ``[0, 1]``.
        eps: Added under both square roots, ``>= 0``.
        weight_decay: Coupled weight decay (L2): ``weight_decay * params`` added to the gradient.
        maximize: Ascend the objective instead (negate the gradient first).

    Example:
        >>> import torch
        >>> from functopk.optim.classic import adadelta
        >>> tx = adadelta(1.0, eps=0.25)
        >>> params = {"w": torch.tensor([1.0])}
        >>> updates, state = tx.update({"w": torch.tensor([2.0])}, tx.init(params), params)
        >>> updates["w"]    # -sqrt(0 + 0.25) / sqrt(0.1 * 4 + 0.25) * 2
        tensor([-1.2403])
    """
    learning_rate = check_scalar_or_schedule(learning_rate, "learning_rate", minimum=0.0)
    rho = _at_most(check_hyperparam(rho, "rho", minimum=0.0), "rho", 1.0)
    eps = check_hyperparam(eps, "eps", minimum=0.0)
    weight_decay = check_hyperparam(weight_decay, "weight_decay", minimum=0.0)
    check_bool(maximize, "maximize")
    decay = not is_zero(weight_decay)

    def init(params: Leaves) -> AdadeltaState:
        zeros = foreach.zeros_like
        return AdadeltaState(count=init_count(params), square_avg=zeros(params), acc_delta=zeros(params))

    def prepare(state: AdadeltaState, like: Leaves, params: Leaves | None) -> tuple[Body, dict[str, Any]]:
        lr = _value_at(learning_rate, state.count)

        def body(w: Writer, g: Leaves, fields: tuple[Any, ...], p: Leaves | None) -> tuple[Leaves, tuple[Any, ...]]:
            g = first_moves(w.new, g, p, maximize, weight_decay if decay else None)
            square_avg = ema_sq(w, fields[0], g, rho)
            delta = adadelta_delta(square_avg, fields[1], g, eps)
            acc_delta = ema_sq(w, fields[1], delta, rho)
            return foreach.mul_(delta, -lr), (square_avg, acc_delta)

        return body, {"count": state.count + 1}

    return leafwise("adadelta", formula=Formula(prepare, in_place=is_number(rho)), init=init, state=AdadeltaState,
                    tree_fields=("square_avg", "acc_delta"), needs_params=decay)  # fmt: skip


def adadelta_delta(square_avg: Leaves, acc_delta: Leaves, grads: Leaves, eps: Hyper) -> list[torch.Tensor]:
    """``sqrt(acc_delta + eps) / sqrt(square_avg + eps) * grads`` in fresh buffers (the new ``square_avg``, the old
    ``acc_delta``), with torch's kernels."""
    std = foreach.add_scalar(square_avg, eps)
    delta = foreach.add_scalar(acc_delta, eps)
    if std:  # torch's in-place kernels on the fresh buffers: no tree allocated but these two
        torch._foreach_sqrt_(std)
        torch._foreach_sqrt_(delta)
        torch._foreach_div_(delta, std)
        torch._foreach_mul_(delta, list(grads))
    return delta


# --------------------------------------------------------------------------- Rprop


class RpropState(NamedTuple):
    """State of :func:`rprop`, as ``torch.optim.Rprop`` keeps it.

    Attributes:
        count: Number of updates done (0-d int64 tensor); torch's ``step`` (the maths does not use it).
        prev: The previous gradient, zeroed where its sign flipped (torch's ``prev``).
        step_size: Each coordinate's step size, starting at ``learning_rate`` (torch's ``step_size``).

    Example:
        >>> import torch
        >>> from functopk.optim.classic import rprop
        >>> rprop(0.5).init({"w": torch.zeros(2)})
        RpropState(count=tensor(0), prev={'w': tensor([0., 0.])}, step_size={'w': tensor([0.5000, 0.5000])})
    """

    count: torch.Tensor  # type: ignore[assignment]
    prev: PyTree
    step_size: PyTree


def rprop_factors(grads: Leaves, prev: Leaves, eta_minus: Hyper, eta_plus: Hyper) -> tuple[Leaves, Leaves]:
    """``(where grads * prev < 0, the step-size factors)``: shared by :func:`rprop` and the adapter's in-place step.

    The factors are ``eta_plus`` where ``g * prev > 0``, ``eta_minus`` where ``< 0``, 1 where 0 (NaN stays
    NaN), as torch sets them: in the buffer of the products, with ``masked_fill_``.
    """
    products = foreach.mul_list(grads, prev)
    flipped = [p < 0 for p in products]
    for s in foreach.sign_(products):
        minus, plus = (
            e.to(device=s.device, dtype=s.dtype) if isinstance(e, torch.Tensor) else e for e in (eta_minus, eta_plus)
        )
        s.masked_fill_(s > 0, plus)
        s.masked_fill_(s < 0, minus)
        s.masked_fill_(s == 0, 1.0)
    return flipped, products


def rprop_direction(kept: Leaves, step_size: Leaves) -> list[torch.Tensor]:
    """``-sign(kept) * step_size``, as ``sign(-kept)`` (+0, not -0, where ``kept`` is 0), in one fresh tree."""
    out = foreach.sign_(foreach.neg(kept))
    if out:
        torch._foreach_mul_(out, list(step_size))
    return out


@recorded
def rprop(
    learning_rate: Hyper = 1e-2,
    *,
    etas: tuple[Hyper, Hyper] = (0.5, 1.2),
    step_sizes: tuple[Hyper, Hyper] = (1e-6, 50.0),
    maximize: bool = False,
) -> GradientTransformation:
    """Resilient backpropagation (Riedmiller & Braun, 1993): ``torch.optim.Rprop``.

    Each coordinate keeps its own step size. Where the gradient keeps its sign
    (``g * prev > 0``) the step size grows by ``etas[1]``, where it flips it
    shrinks by ``etas[0]`` and the gradient is taken as 0 for this step (torch's
    variant: no move, and no shrink at the next step), elsewhere it stays; it is
    then clamped to ``step_sizes``. The update is ``-sign(g) * step_size``. optax
    has no Rprop.

    ``learning_rate`` is only the initial step size of every coordinate, used at
    ``init`` (torch fills ``step_size`` with ``lr`` at its first step and never
    reads ``lr`` again). It may be a number or a 0-d tensor, not a schedule
    (``TypeError``): a schedule could only give its value at step 0. Under
    :func:`functopk.inject_hyperparams` the injected value is read at init only,
    as torch ignores a later change of ``lr``.

    Args:
        learning_rate: The initial step size, ``>= 0``.
        etas: ``(eta_minus, eta_plus)`` with ``0 < eta_minus < 1 < eta_plus``.
        step_sizes: ``(min, max)`` bounds of the step sizes, ``0 <= min <= max``.
        maximize: Ascend the objective instead (negate the gradient first).

    Example:
        >>> import torch
        >>> from functopk.optim.classic import rprop
        >>> tx = rprop(0.1)
        >>> state = tx.init({"w": torch.zeros(2)})
        >>> for g in ([1.0, 1.0], [1.0, -1.0]):
        ...     updates, state = tx.update({"w": torch.tensor(g)}, state)
        >>> updates["w"]    # the sign held: 0.1 * 1.2 against it; it flipped: no move
        tensor([-0.1200,  0.0000])
    """
    if callable(learning_rate) and not isinstance(learning_rate, torch.Tensor):
        raise TypeError(
            "learning_rate must be a real number or a 0-d float tensor, not a schedule: rprop uses it once, as the "
            "initial step size of every coordinate (torch.optim.Rprop reads lr only at its first step)"
        )
    learning_rate = check_hyperparam(learning_rate, "learning_rate", minimum=0.0)
    eta_minus, eta_plus = _pair(etas, "etas")
    eta_minus = check_hyperparam(eta_minus, "etas[0]", minimum=0.0, below=1.0)
    if is_zero(eta_minus):
        raise ValueError("etas[0] must be > 0, got 0.0")
    eta_plus = check_hyperparam(eta_plus, "etas[1]")
    if not isinstance(eta_plus, torch.Tensor) and eta_plus <= 1.0:
        raise ValueError(f"etas[1] must be > 1, got {eta_plus}")
    low, high = _pair(step_sizes, "step_sizes")
    low = check_hyperparam(low, "step_sizes[0]", minimum=0.0)
    high = check_hyperparam(high, "step_sizes[1]", minimum=0.0)
    if not isinstance(low, torch.Tensor) and not isinstance(high, torch.Tensor) and low > high:
        raise ValueError(f"step_sizes must be (min, max) with min <= max, got ({low}, {high})")
    check_bool(maximize, "maximize")

    def init(params: Leaves) -> RpropState:
        step_size = foreach.full_like(params, learning_rate)
        return RpropState(count=init_count(params), prev=foreach.zeros_like(params), step_size=step_size)

    def prepare(state: RpropState, like: Leaves, params: Leaves | None) -> tuple[Body, dict[str, Any]]:
        return body, {"count": state.count + 1}

    def body(w: Writer, g: Leaves, fields: tuple[Any, ...], p: Leaves | None) -> tuple[Leaves, tuple[Any, ...]]:
        if maximize:
            g = foreach.neg(g)
        flipped, factors = rprop_factors(g, fields[0], eta_minus, eta_plus)
        step_size = foreach.clamp_(w.mul(fields[1], factors), low, high)  # (clamped in place: exact in any dtype)
        kept = w.zero_where(fields[0], flipped, g)  # the gradient, 0 where its sign flipped
        return rprop_direction(kept, step_size), (kept, step_size)

    return leafwise("rprop", formula=Formula(prepare), init=init, state=RpropState, tree_fields=("prev", "step_size"))


# --------------------------------------------------------------------------- ASGD


class AsgdState(NamedTuple):
    """State of :func:`asgd`, as ``torch.optim.ASGD`` keeps it.

    Attributes:
        count: Number of updates done (0-d int64 tensor); torch's ``step``.
        eta: The step size of the next update (0-d tensor; torch's ``eta``, one per parameter there).
        mu: The averaging weight of the next update (0-d tensor; torch's ``mu``).
        ax: The averaged parameters, a tree like the parameters (torch's ``ax``): read
            ``state.ax`` (``state.inner_state.ax`` under :func:`functopk.inject_hyperparams`,
            ``state[i].ax`` in a chain) and evaluate the model with it.

    ``eta`` and ``mu`` have torch's scalar dtype, chosen at ``init``: float64 when
    ``torch.get_default_dtype()`` is float64, float32 otherwise. As in torch's foreach
    ASGD, ``eta`` is computed on a tensor of that dtype and ``mu`` in float64, then rounded
    to it, so both have torch's bits.

    Example:
        >>> import torch
        >>> from functopk.optim.classic import asgd
        >>> asgd(0.1).init({"w": torch.zeros(2)})
        AsgdState(count=tensor(0), eta=tensor(0.1000), mu=tensor(1.), ax={'w': tensor([0., 0.])})
    """

    count: torch.Tensor  # type: ignore[assignment]
    eta: torch.Tensor
    mu: torch.Tensor
    ax: PyTree


@recorded
def asgd(
    learning_rate: ScalarOrSchedule = 1e-2,
    *,
    lambd: Hyper = 1e-4,
    alpha: Hyper = 0.75,
    t0: Hyper = 1e6,
    weight_decay: Hyper = 0.0,
    maximize: bool = False,
    foreach: bool | None = None,
) -> GradientTransformation:
    """Averaged stochastic gradient descent (Polyak & Juditsky, 1992): ``torch.optim.ASGD``.

    At step ``t`` (from 1), with ``g`` the gradient (negated with ``maximize``,
    plus ``weight_decay * params``), torch's new parameters are computed as its
    implementation computes them, ``params - eta * (g + lambd * params)`` (the
    foreach kernels) or ``params * (1 - lambd * eta) - eta * g`` (the for-loop),
    and the update is their difference from ``params`` (exact while a step is at
    most half the parameter, so ``apply_updates`` gives back torch's numbers).
    Then ``ax = ax + mu * (new_params - ax)`` (the for-loop copies the parameters
    while ``mu`` is 1), and the next step's scalars are
    ``eta = lr / (1 + lambd * lr * t)**alpha`` and ``mu = 1 / max(1, t - t0)``
    (from ``eta = lr``, ``mu = 1``), rounded as that implementation rounds them:
    ``eta`` in its dtype by the foreach kernels, in float64 then rounded by the
    for-loop (see :class:`AsgdState`; 0-d tensor hyperparameters may change
    ``eta``'s last bit). A schedule gives the first ``eta`` at ``init`` (its step-0
    value) and the next ``eta`` at each update, as torch with an LR scheduler.

    The averaged parameters are ``state.ax``: a copy of the parameters while
    ``t <= t0 + 1``, then (for an integer ``t0``) the mean of the parameters after
    steps ``t0 + 2`` to ``t``. The updates move the parameters, not the average:
    evaluate the model with ``ax`` for Polyak averaging. optax has no ASGD.

    Args:
        learning_rate: A number, a 0-d tensor or a schedule ``step -> lr`` (``>= 0``).
        lambd: Decay term, ``>= 0``: ``eta``'s decay and a weight decay of ``lambd`` per unit of ``eta``.
        alpha: Power of ``eta``'s decay, ``>= 0``.
        t0: The step from which the average starts.
        weight_decay: Coupled weight decay (L2): ``weight_decay * params`` added to the gradient.
        maximize: Ascend the objective instead (negate the gradient first).
        foreach: torch's flag: the implementation whose rounding to follow
            (:func:`~functopk.tree.torch_rounding.torch_foreach`; ``None``: the for-loop's on the CPU).

    Example:
        >>> import torch, functopk as ft
        >>> from functopk.optim.classic import asgd
        >>> tx = asgd(0.1, lambd=0.0, t0=0)
        >>> params = {"w": torch.tensor([1.0])}
        >>> state = tx.init(params)
        >>> for _ in range(4):
        ...     updates, state = tx.update({"w": torch.tensor([1.0])}, state, params)
        ...     params = ft.apply_updates(params, updates)
        >>> params["w"], state.ax["w"]    # the average of the iterates 0.8, 0.7 and 0.6
        (tensor([0.6000]), tensor([0.7000]))
    """
    learning_rate = check_scalar_or_schedule(learning_rate, "learning_rate", minimum=0.0)
    lambd = check_hyperparam(lambd, "lambd", minimum=0.0)
    alpha = check_hyperparam(alpha, "alpha", minimum=0.0)
    t0 = check_hyperparam(t0, "t0")
    weight_decay = check_hyperparam(weight_decay, "weight_decay", minimum=0.0)
    return _asgd(learning_rate, lambd, alpha, t0, weight_decay, check_bool(maximize, "maximize"), foreach)


def _asgd(learning_rate: Any, lambd: Hyper, alpha: Hyper, t0: Hyper, weight_decay: Hyper, maximize: bool,
          implementation: Any) -> GradientTransformation:  # fmt: skip
    coupled = None if is_zero(weight_decay) else weight_decay

    def init(params: Leaves) -> AsgdState:
        count = init_count(params)
        dtype = torch_rounding.torch_scalar_dtype(count.device)
        eta = torch.as_tensor(_value_at(learning_rate, count), dtype=dtype, device=count.device).clone()
        mu = torch.ones((), dtype=dtype, device=count.device)
        return AsgdState(count=count, eta=eta, mu=mu, ax=foreach.zeros_like(params))

    def prepare(state: AsgdState, like: Leaves, params: Leaves | None) -> tuple[Body, dict[str, Any]]:
        assert params is not None  # needs_params
        loop = not torch_rounding.torch_foreach(implementation, params)  # whose rounding: torch's for-loop or foreach
        lr = _value_at(learning_rate, state.count)
        eta, mu = asgd_next_eta_mu(state.count, state.eta.dtype, lr, lambd, alpha, t0, loop)

        def body(w: Writer, g: Leaves, fields: tuple[Any, ...], p: Leaves | None) -> tuple[Leaves, tuple[Any, ...]]:
            assert p is not None
            g = first_moves(w.new, g, p, maximize, coupled)
            # torch's new parameters, with its kernels; the update is their difference from params (exact wherever
            # the step is under |params|, so apply_updates gives them back)
            new_params = asgd_new_params(g, p, state.eta, lambd, loop)
            ax = w.toward(fields[0], new_params, state.mu)
            if loop:
                asgd_copy_while_mu_is_one_(ax, new_params, state.mu)
            if new_params:  # the update, in the fresh new parameters' buffers
                torch._foreach_sub_(new_params, p)
            return new_params, (ax,)

        return body, {"count": state.count + 1, "eta": eta, "mu": mu}

    return leafwise("asgd", formula=Formula(prepare), init=init, state=AsgdState, tree_fields=("ax",),
                    needs_params=True)  # fmt: skip


def asgd_new_params(
    grads: Leaves, params: Leaves, eta: torch.Tensor, lambd: Hyper, loop: bool = False
) -> list[torch.Tensor]:
    """torch's new parameters, fresh: its foreach kernels'
    ``params - eta * (grads + lambd * params)``, or (``loop``) its for-loop's ``params * (1 - lambd * eta) - eta *
    grads`` with ``eta`` read as a Python float (here its float64 value, on device)."""
    if loop:
        wide = eta.to(foreach.scalar_dtype(eta.device))
        scaled = foreach.mul(params, foreach.for_leaves(1.0 - lambd * wide, params))
        neg_eta = cast(torch.Tensor, foreach.for_leaves(-wide, params))
        return foreach.addcmul_(scaled, grads, [neg_eta] * len(scaled))
    out = foreach.add_scaled(grads, lambd, params)
    if not out or out[0].device.type != "cpu":  # (foreach kernels: one launch for all leaves)
        return foreach.addcmul(params, out, [eta] * len(out), value=-1.0)
    for p, x in zip(params, out):  # into the fresh buffer: a second fresh tree costs page faults on CPU
        torch.addcmul(p, x, eta, value=-1.0, out=x)
    return out


def asgd_copy_while_mu_is_one_(ax: list[torch.Tensor], new_params: Leaves, mu: torch.Tensor) -> None:
    """Where ``mu`` is 1, the new parameters into ``ax`` (fresh buffers the caller owns), in place.

    torch's for-loop copies the parameters into ``ax`` while ``mu`` is 1 (until
    step ``t0 + 1``), where its foreach kernel adds ``mu * (params - ax)``, which
    can differ in the last bit; the choice is made on device.
    """
    one = mu == 1
    for a, x in zip(ax, new_params):
        torch.where(one, x, a, out=a)


def asgd_next_eta_mu(
    count: torch.Tensor, dtype: torch.dtype, lr: Hyper, lambd: Hyper, alpha: Hyper, t0: Hyper, loop: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """ASGD's ``eta`` (in ``dtype``) and ``mu`` after step ``count + 1``, rounded as torch's ASGD rounds them.

    torch's foreach kernels evaluate ``lr / ((1 + lambd * lr * step) ** alpha)``
    with ``step`` its float32 (or float64) step tensor and the rest Python
    floats: the same expression here, on the count cast to the state's dtype,
    gives the same bits. Its for-loop (``loop``) reads ``step`` as a Python float:
    the expression is float64 maths (float32 on MPS), or in a tensor ``lr``'s
    dtype, rounded to the state's dtype. ``mu`` is ``1 / max(1, step - t0)`` in
    Python floats in both, so here too.
    """
    device = count.device
    step = count + 1
    wide = step.to(foreach.scalar_dtype(device))
    t = (step.to(lr.dtype) if isinstance(lr, torch.Tensor) else wide) if loop else step.to(dtype)
    eta = lr / ((1 + lambd * lr * t) ** alpha)
    mu = 1.0 / torch.clamp_min(wide - t0, 1.0)
    return eta.to(dtype), mu.to(dtype)


# --------------------------------------------------------------------------- torch.optim param groups


TORCH_BUILDERS: dict[str, Callable[[dict[str, Any]], GradientTransformation]] = {
    "Adadelta": lambda g: adadelta(
        group_scalar(g["lr"]), rho=group_scalar(g["rho"]), eps=group_scalar(g["eps"]),
        weight_decay=group_scalar(g["weight_decay"]), maximize=g["maximize"],
    ),
    "Rprop": lambda g: rprop(
        group_scalar(g["lr"]), etas=group_scalar(g["etas"]), step_sizes=group_scalar(g["step_sizes"]),
        maximize=g["maximize"],
    ),
    "ASGD": lambda g: asgd(
        group_scalar(g["lr"]), lambd=group_scalar(g["lambd"]), alpha=group_scalar(g["alpha"]), t0=group_scalar(g["t0"]),
        weight_decay=group_scalar(g["weight_decay"]), maximize=g["maximize"], foreach=g.get("foreach"),
    ),
}  # fmt: skip
"""torch class name -> a builder taking that class's param-group dict (``capturable``, ``differentiable``
and other keys not named here are ignored; ``foreach`` picks ASGD's rounding)."""

TORCH_STATE_NAMES: dict[str, dict[str, str]] = {
    "Adadelta": {"count": "step", "square_avg": "square_avg", "acc_delta": "acc_delta"},
    "Rprop": {"count": "step", "prev": "prev", "step_size": "step_size"},
    "ASGD": {"count": "step", "eta": "eta", "mu": "mu", "ax": "ax"},
}
"""torch class name -> {state field here: torch's per-parameter state key}."""
