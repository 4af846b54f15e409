"""Adafactor with ``torch.optim.Adafactor``'s semantics (Shazeer & Stern, 2018).

Adafactor keeps, for every parameter of two or more dimensions, only the row and
column means of the squared gradient (factored over the last two dimensions) and
estimates the full second moment as their outer product over the mean of the
row factor; 0-d and 1-d parameters keep the full running mean. Its step size is
*relative*: ``max(eps2, RMS(param)) * min(lr, 1/sqrt(t))``, and each update is
clipped to RMS ``d`` at most.

The maths is torch's, kernel for kernel where rounding depends on it (the
single-tensor implementation that ``torch.optim.Adafactor`` runs by default),
except that every step-dependent scalar (``t ** beta2_decay``, the relative step,
the RMS of the parameters and of the update) is a 0-d tensor computed on device
in float64, where torch reads values back to the host with ``.item()`` and
computes in Python floats (or, with a tensor ``lr``, partly in ``lr``'s dtype:
so here).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple, cast

import torch

from functopk._checks import (
    check_bool,
    check_hyperparam,
    check_scalar_or_schedule,
    describe,
    group_scalar,
    is_zero,
)
from functopk.base import GradientTransformation, ScalarOrSchedule, init_count, recorded
from functopk.build import leafwise
from functopk.optim._shared import Hyper, Leaves
from functopk.tree import foreach
from functopk.tree.maths import PyTree

__all__ = ["TORCH_BUILDERS", "TORCH_STATE_NAMES", "AdafactorState", "adafactor"]

_NAME = "adafactor"
_FIELDS = ("row_var", "col_var", "variance")
_PLACEHOLDER = torch.Size((0,))


class AdafactorState(NamedTuple):
    """State of :func:`adafactor`: torch's per-parameter entries, one tree each.

    Every tree field has one leaf per parameter. A parameter keeps either the
    factored pair (``row_var``, ``col_var``: two or more dimensions) or the full
    ``variance`` (0-d and 1-d), as in torch; the field it does not keep holds a
    *placeholder*, an empty tensor of shape ``(0,)`` (its dtype and device),
    where torch's ``optimizer.state[p]`` simply has no such key.

    Attributes:
        count: Number of updates done (0-d int64 tensor); torch's ``step`` is ``count``.
        row_var: Running mean of the squared gradient over the last dimension, of shape
            ``shape[:-1] + (1,)``; a placeholder for 0-d and 1-d parameters.
        col_var: Running mean over the second-to-last dimension, of shape
            ``shape[:-2] + (1, shape[-1])``; a placeholder for 0-d and 1-d parameters.
        variance: Running mean of the squared gradient, shaped like the parameter, for
            0-d and 1-d parameters; a placeholder for the others.

    Example:
        >>> import torch
        >>> from functopk.optim.adafactor import adafactor
        >>> state = adafactor().init({"w": torch.zeros(2, 3), "b": torch.zeros(3)})
        >>> {k: tuple(v.shape) for k, v in state.row_var.items()}, state.variance["w"]
        ({'w': (2, 1), 'b': (0,)}, tensor([]))
    """

    count: torch.Tensor  # type: ignore[assignment]
    row_var: PyTree
    col_var: PyTree
    variance: PyTree


def _state_shapes(x: torch.Tensor) -> tuple[torch.Size, torch.Size, torch.Size]:
    """The shapes of ``row_var``, ``col_var`` and ``variance`` for a parameter like ``x``."""
    if x.dim() >= 2:
        shape = x.shape
        return shape[:-1] + (1,), shape[:-2] + (1, shape[-1]), _PLACEHOLDER
    return _PLACEHOLDER, _PLACEHOLDER, x.shape


def _state_shape(k: int, x: torch.Tensor) -> torch.Size:
    """The shape of state field ``_FIELDS[k]`` for a parameter like ``x``."""
    return _state_shapes(x)[k]


def _check_eps(eps: Any) -> tuple[Hyper | None, Hyper]:
    """torch's ``eps=(eps1, eps2)``: ``eps1`` ``None`` (the dtype's machine epsilon) or ``>= 0``, ``eps2 >= 0``."""
    if not isinstance(eps, (tuple, list)):
        raise TypeError(f"eps must be a pair (eps1, eps2), got {describe(eps)}")
    if len(eps) != 2:
        raise ValueError(f"eps must be a pair (eps1, eps2), got {len(eps)} values")
    eps1 = None if eps[0] is None else check_hyperparam(eps[0], "eps[0] (eps1)", minimum=0.0)
    return eps1, check_hyperparam(eps[1], "eps[1] (eps2)", minimum=0.0)


class _Config(NamedTuple):
    beta2_decay: Hyper
    eps1: Hyper | None
    eps2: Hyper
    d: Hyper
    weight_decay: Hyper
    maximize: bool


def _f64(value: Hyper, dtype: torch.dtype) -> Hyper:
    """A tensor hyperparameter in the scalar dtype (numbers stay Python numbers)."""
    return value.to(dtype) if isinstance(value, torch.Tensor) else value


def _mean_square(g: torch.Tensor, dim: int) -> torch.Tensor:
    """``mean(g**2, dim)`` as torch computes it: the squared norm over the size, without a ``g``-sized temporary."""
    return torch.linalg.vector_norm(g, dim=dim, keepdim=True).square_().div_(g.size(dim))


def _lerp_at(fields: Leaves, idx: list[int], targets: Leaves, weight: torch.Tensor) -> None:
    """``fields[i] = lerp(fields[i], target, weight)`` for the listed leaves (one foreach ``lerp``)."""
    old = [fields[i] for i in idx]
    for i, new in zip(idx, foreach.lerp(old, targets, foreach.for_leaves(weight, old))):
        fields[i] = new


def _second_moments(
    grads: Leaves, fields: list[Leaves], weight: torch.Tensor, eps1: Hyper | None
) -> tuple[Leaves, list[Leaves]]:
    """torch's variance estimate and the unscaled update ``grad / max(sqrt(v), eps1)`` for each leaf.

    Factored leaves: the running row/column means of ``grad**2``,
    ``v = row @ col / max(mean(row), eps1)``; the others: the running mean ``v`` of ``grad**2``.
    """
    rows, cols, variances = (list(f) for f in fields)
    factored = [i for i, g in enumerate(grads) if g.dim() >= 2]
    full = [i for i, g in enumerate(grads) if g.dim() < 2]
    _lerp_at(rows, factored, [_mean_square(grads[i], -1) for i in factored], weight)
    _lerp_at(cols, factored, [_mean_square(grads[i], -2) for i in factored], weight)
    g_full = [grads[i] for i in full]
    _lerp_at(variances, full, foreach.mul_list(g_full, g_full), weight)
    out = []
    for i, g in enumerate(grads):
        e1 = torch.finfo(g.dtype).eps if eps1 is None else eps1
        # clamp to eps1**2 before the root keeps eps1's magnitude; in place on the fresh product, else fresh
        if g.dim() >= 2:
            estimate = rows[i] @ cols[i]
            estimate.div_(torch.clamp(rows[i].mean(dim=-2, keepdim=True), min=e1)).clamp_(min=e1 * e1)
        else:
            estimate = torch.clamp(variances[i], min=e1 * e1)
        out.append(estimate.rsqrt_().mul_(g))
    return out, [rows, cols, variances]


def _scale(updates: Leaves, params: Leaves, inv_root: torch.Tensor, lr: Hyper, cfg: _Config) -> Leaves:
    """``-alpha / max(1, RMS(U) / d) * U`` with ``alpha = max(eps2, RMS(param)) * min(lr, 1/sqrt(t))``, per leaf.

    torch computes these scalars in Python floats. With a tensor ``lr`` its
    ``min(lr, 1/sqrt(t))`` is that tensor (unless ``1/sqrt(t)`` is smaller), and
    the products with it are rounded to ``lr``'s dtype: so they are here.
    """
    dtype = inv_root.dtype
    roots = [math.sqrt(max(x.numel(), 1)) for x in params]  # torch divides by 0 for an empty parameter
    p_rms = torch._foreach_div([n.to(dtype) for n in torch._foreach_norm(params)], roots) if params else []
    floors = [torch.clamp(r, min=_f64(cfg.eps2, dtype)) for r in p_rms]
    d = _f64(cfg.d, dtype)
    u_norms = [n.to(dtype) for n in torch._foreach_norm(updates)] if updates else []
    denoms = [torch.clamp(n / (root * d), min=1.0) for n, root in zip(u_norms, roots)]
    if isinstance(lr, torch.Tensor):
        by_root = inv_root < lr.to(dtype)
        coefs = [
            torch.where(by_root, -(f * inv_root) / den, (-(f.to(lr.dtype) * lr) / den.to(lr.dtype)).to(dtype))
            for f, den in zip(floors, denoms)
        ]
    else:
        rho = torch.clamp(inv_root, max=lr)
        coefs = [-(f * rho) / den for f, den in zip(floors, denoms)]
    if updates:  # in place: the updates are fresh (no second tree)
        torch._foreach_mul_(list(updates), [c.to(u.dtype) for c, u in zip(coefs, updates)])
    return updates


def _step(
    grads: Leaves, params: Leaves, fields: list[Leaves], count: torch.Tensor, lr: Hyper, cfg: _Config
) -> tuple[Leaves, list[Leaves]]:
    """One Adafactor update on leaf lists: ``(updates, [row_vars, col_vars, variances])``."""
    dtype = foreach.scalar_dtype(count.device)
    t = (count + 1).to(dtype)
    weight = torch.pow(t, _f64(cfg.beta2_decay, dtype))  # 1 - beta2_t = t ** beta2_decay
    if cfg.maximize:
        grads = foreach.neg(grads)
    updates, new_fields = _second_moments(grads, fields, weight, cfg.eps1)
    out = _scale(updates, params, 1.0 / torch.sqrt(t), lr, cfg)
    if not is_zero(cfg.weight_decay):
        # decoupled: torch multiplies by 1 - lr * weight_decay (in lr's dtype for a tensor lr); 1 - that is exact
        factor = 1.0 - lr * cfg.weight_decay
        shrink = factor.to(dtype) - 1.0 if isinstance(factor, torch.Tensor) else factor - 1.0
        foreach.add_scaled_(out, foreach.for_leaves(shrink, params), params)
    return out, new_fields


def _transform(learning_rate: ScalarOrSchedule, cfg: _Config) -> GradientTransformation:
    """The transformation for checked hyperparameters: leafwise maths, torch's state shapes."""

    def init(params: Leaves) -> AdafactorState:
        fields = [[x.new_zeros(_state_shapes(x)[k]) for x in params] for k in range(len(_FIELDS))]
        return AdafactorState(init_count(params), *fields)

    def update(grads: Leaves, state: AdafactorState, params: Leaves | None) -> tuple[Leaves, AdafactorState]:
        lr = learning_rate(state.count) if callable(learning_rate) else learning_rate
        fields = [state.row_var, state.col_var, state.variance]
        out, new = _step(grads, cast(Leaves, params), fields, state.count, lr, cfg)  # needs_params: a list
        return out, AdafactorState(state.count + 1, *new)

    return leafwise(
        _NAME, update, init=init, state=AdafactorState, tree_fields=_FIELDS, needs_params=True,
        shapes={f: functools.partial(_state_shape, k) for k, f in enumerate(_FIELDS)},
    )


@recorded
def adafactor(
    learning_rate: ScalarOrSchedule = 1e-2,
    *,
    beta2_decay: Hyper = -0.8,
    eps: tuple[Hyper | None, Hyper] = (None, 1e-3),
    d: Hyper = 1.0,
    weight_decay: Hyper = 0.0,
    maximize: bool = False,
) -> GradientTransformation:
    """Adafactor (Shazeer & Stern, 2018) as ``torch.optim.Adafactor`` computes it, defaults included.

    At step ``t`` (from 1), with ``G`` the gradient (negated with ``maximize``),
    ``w = t ** beta2_decay`` (torch's ``1 - beta2_t``) and ``rho = min(lr, 1/sqrt(t))``:

    * parameters of two or more dimensions keep ``R = lerp(R, mean(G**2, -1), w)`` and
      ``C = lerp(C, mean(G**2, -2), w)`` and estimate ``V = R @ C / max(mean(R, -2), eps1)``;
      0-d and 1-d ones keep ``V = lerp(V, G**2, w)``;
    * ``U = G / max(sqrt(V), eps1)``, clipped: ``U / max(1, RMS(U) / d)``;
    * the new parameter is ``param * (1 - lr * weight_decay) - max(eps2, RMS(param)) * rho * U``
      (the RMS of the parameter before the decay), returned as an update for
      :func:`functopk.apply_updates`.

    This is torch's variant, not the paper's nor optax's: ``lr`` caps the relative step
    and scales the decoupled weight decay, and ``eps1`` enters only the variance
    estimate and the update (the paper and optax add it to ``G**2``).
    ``optax.adafactor`` differs in its arguments and defaults too (no learning rate
    by default, factoring only dimensions of size 128 or more, ``eps=1e-30`` added
    to ``G**2``, optional momentum); this function is named ``adafactor`` all the
    same, and its semantics are torch's.

    The state (:class:`AdafactorState`) holds torch's ``row_var``, ``col_var``
    and ``variance`` as trees with one entry per parameter, empty tensors where
    torch keeps no such entry. One difference from torch: with ``eps1=None``,
    each leaf uses its own dtype's machine epsilon, whereas torch uses the
    first parameter's dtype for all of them (the same unless dtypes are mixed).

    Args:
        learning_rate: The cap on the relative step and the weight decay's factor
            (torch's ``lr``): a number, a 0-d tensor or a schedule ``step -> lr``.
        beta2_decay: The exponent ``<= 0`` of the second moment's decay ``1 - t**beta2_decay``.
        eps: ``(eps1, eps2)``: ``eps1`` keeps the variance estimate away from 0 (``None``:
            the machine epsilon of each leaf's dtype); ``eps2`` is the least
            parameter RMS the relative step uses.
        d: The update clipping threshold, ``>= 1``.
        weight_decay: Decoupled weight decay, applied as ``param * (1 - lr * weight_decay)``.
        maximize: Ascend the objective instead.

    Example:
        >>> import torch, functopk as ft
        >>> from functopk.optim.adafactor import adafactor
        >>> tx = adafactor(0.01)
        >>> params = {"w": torch.full((2, 2), 3.0), "b": torch.tensor([0.0, 0.0])}
        >>> grads = {"w": torch.ones(2, 2), "b": torch.tensor([5.0, -5.0])}
        >>> updates, state = tx.update(grads, tx.init(params), params)
        >>> updates["w"]  # -max(1e-3, RMS(w)) * min(lr, 1/sqrt(1)) * sign(grad), RMS(U) = 1
        tensor([[-0.0300, -0.0300],
                [-0.0300, -0.0300]])
        >>> updates["b"]  # eps2 * lr, since RMS(b) = 0 < eps2
        tensor([-1.0000e-05,  1.0000e-05])
    """
    learning_rate = check_scalar_or_schedule(learning_rate, "learning_rate", minimum=0.0)
    beta2_decay = check_hyperparam(beta2_decay, "beta2_decay")
    if not isinstance(beta2_decay, torch.Tensor) and beta2_decay > 0.0:
        raise ValueError(f"beta2_decay must be <= 0, got {beta2_decay}")
    eps1, eps2 = _check_eps(eps)
    cfg = _Config(
        beta2_decay=beta2_decay,
        eps1=eps1,
        eps2=eps2,
        d=check_hyperparam(d, "d", minimum=1.0),
        weight_decay=check_hyperparam(weight_decay, "weight_decay", minimum=0.0),
        maximize=check_bool(maximize, "maximize"),
    )
    return _transform(learning_rate, cfg)


# --------------------------------------------------------------------------- the torch.optim adapter's tables


def _from_torch(group: dict[str, Any]) -> GradientTransformation:
    """:func:`adafactor` from a ``torch.optim.Adafactor`` param group (``foreach`` is ignored)."""
    return adafactor(
        group_scalar(group["lr"]),
        beta2_decay=group_scalar(group["beta2_decay"]),
        eps=group_scalar(group["eps"]),  # a pair; adafactor checks it
        d=group_scalar(group["d"]),
        weight_decay=group_scalar(group["weight_decay"]),
        maximize=group["maximize"],
    )


TORCH_BUILDERS: dict[str, Callable[[dict[str, Any]], GradientTransformation]] = {"Adafactor": _from_torch}
"""``torch.optim`` class name -> a function of that class's complete param group returning :func:`adafactor`."""

TORCH_STATE_NAMES: dict[str, dict[str, str]] = {
    "Adafactor": {"count": "step", "row_var": "row_var", "col_var": "col_var", "variance": "variance"},
}
"""``torch.optim`` class name -> {:class:`AdafactorState` field: torch's per-parameter state key}.

``row_var``/``col_var`` exist in torch's state for parameters of two or more
dimensions only, ``variance`` for the others: where torch has no key, this
state holds a ``(0,)``-shaped placeholder. torch keeps ``step`` per parameter as
a float tensor; ``count`` is the one shared int64 step count.
"""
