"""Muon with ``torch.optim.Muon``'s semantics (Jordan et al., 2024).

Muon orthogonalises the momentum of each 2-D parameter with a few quintic
Newton-Schulz iterations (in bfloat16, as torch and the reference
implementation do) and steps along the result, scaled by a shape-dependent
factor of the learning rate. It is for the 2-D weights of hidden layers: other
parameters (biases, norms, embeddings, ...) belong to another optimizer, e.g.
through :func:`functopk.partition`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import optree
import torch

from functopk._checks import (
    check_bool,
    check_choice,
    check_hyperparam,
    check_int,
    check_scalar_or_schedule,
    describe,
    group_scalar,
    is_zero,
    path_str,
)
from functopk.base import GradientTransformation, ScalarOrSchedule, init_count, recorded
from functopk.build import leafwise
from functopk.optim._shared import Hyper, Leaves
from functopk.tree import foreach
from functopk.tree.maths import PyTree

__all__ = ["TORCH_BUILDERS", "TORCH_STATE_NAMES", "MuonState", "muon", "newton_schulz"]

_NAME = "muon"

_LR_RATIOS: dict[str | None, Callable[[int, int], float]] = {
    None: lambda rows, cols: math.sqrt(max(1, rows / cols)),
    "original": lambda rows, cols: math.sqrt(max(1, rows / cols)),
    "match_rms_adamw": lambda rows, cols: 0.2 * math.sqrt(max(rows, cols)),
    "spectral_unclamped": lambda rows, cols: math.sqrt(rows / cols),
}
"""torch's ``adjust_lr_fn`` options: the factor on the learning rate for a ``rows x cols`` parameter."""


class MuonState(NamedTuple):
    """State of :func:`muon`.

    Attributes:
        count: Number of updates done (0-d int64 tensor); learning-rate schedules are
            evaluated on it. torch's Muon keeps no step count.
        momentum_buffer: The momentum, a tree like the parameters (torch's ``momentum_buffer``).

    Example:
        >>> import torch
        >>> from functopk.optim.muon import muon
        >>> muon().init({"w": torch.zeros(2, 2)})
        MuonState(count=tensor(0), momentum_buffer={'w': tensor([[0., 0.],
                [0., 0.]])})
    """

    count: torch.Tensor  # type: ignore[assignment]
    momentum_buffer: PyTree


def _check_matrices(leaves: Leaves, treedef: optree.PyTreeSpec, name: str) -> None:
    """``ValueError`` naming the first leaf of the tree ``name`` that is not 2-D (torch's Muon refuses them too)."""
    for path, leaf in zip(treedef.paths(), leaves):
        if leaf.dim() != 2:
            raise ValueError(
                f"muon only supports 2-D parameters, but {name} leaf at {path_str(path)} has shape "
                f"{tuple(leaf.shape)}; give the other parameters to another optimizer, e.g. "
                "ft.partition({'muon': muon(...), 'adamw': ft.adamw(...)}, labels)"
            )


def _check_coefficients(coefficients: Any) -> tuple[Hyper, Hyper, Hyper]:
    """Three numbers or 0-d tensors ``(a, b, c)``."""
    if not isinstance(coefficients, (tuple, list)):
        raise TypeError(f"ns_coefficients must be a tuple (a, b, c), got {describe(coefficients)}")
    if len(coefficients) != 3:
        raise ValueError(f"ns_coefficients must hold exactly 3 values (a, b, c), got {len(coefficients)}")
    a, b, c = (check_hyperparam(v, f"ns_coefficients[{i}]") for i, v in enumerate(coefficients))
    return a, b, c


def newton_schulz(x: torch.Tensor, coefficients: tuple[Hyper, Hyper, Hyper], steps: int, eps: Hyper) -> torch.Tensor:
    """torch's quintic Newton-Schulz orthogonalisation of a matrix, in bfloat16, the same ops in the same order.

    ``X = x / max(||x||_F, eps)`` (transposed when ``x`` is tall), then ``steps``
    times ``A = X X^T``, ``X = a X + (b A + c A A) X``, each product one
    ``addmm`` as in ``torch.optim.Muon``. The result is bfloat16, shaped like
    ``x``; ``x`` is not changed (torch writes into it when it is bfloat16 already).
    Coefficients given as tensors take float32 products rounded once to bfloat16
    instead (``addmm`` takes numbers only): bit-equal on small matrices, within
    2e-2 relative in general (the sums are ordered differently).

    Example:
        >>> import torch
        >>> from functopk.optim.muon import newton_schulz
        >>> out = newton_schulz(torch.tensor([[3.0, 0.0], [0.0, 0.5]]), (3.4445, -4.775, 2.0315), 5, 1e-7)
        >>> out.dtype, out.float().diagonal().sub(1).abs().max() < 0.35  # singular values pushed near 1
        (torch.bfloat16, tensor(True))
    """
    a, b, c = coefficients
    tall = x.size(0) > x.size(1)
    y = x.to(torch.bfloat16)
    if tall:
        y = y.T
    norm = y.norm()
    y = y / (torch.maximum(norm, eps.to(norm.dtype)) if isinstance(eps, torch.Tensor) else norm.clamp(min=eps))
    tensors = any(isinstance(v, torch.Tensor) for v in coefficients)
    for _ in range(steps):
        gram = y @ y.T
        if tensors:  # addmm's maths: float32 products of the bfloat16 values, rounded once to bfloat16
            g32 = gram.float()
            poly = (g32 * b + (g32 @ g32) * c).to(torch.bfloat16)
            y = (y.float() * a + poly.float() @ y.float()).to(torch.bfloat16)
        else:
            y = torch.addmm(y, torch.addmm(gram, gram, gram, beta=b, alpha=c), y, beta=a)  # type: ignore[arg-type]
    return y.T if tall else y


def _check_adjust(adjust_lr_fn: Any) -> Callable[[int, int], float]:
    """The learning-rate factor of one of torch's ``adjust_lr_fn`` options."""
    return _LR_RATIOS[check_choice(adjust_lr_fn, "adjust_lr_fn", tuple(_LR_RATIOS))]


class _Config(NamedTuple):
    weight_decay: Hyper
    momentum: Hyper
    nesterov: bool
    coefficients: tuple[Hyper, Hyper, Hyper]
    eps: Hyper
    ns_steps: int
    ratio_of: Callable[[int, int], float]


def _shrink(lr: Hyper, weight_decay: Hyper) -> Hyper:
    """The decoupled decay's factor on the parameters, minus 1.

    torch multiplies by ``1 - lr * weight_decay``, computed in Python floats, or in
    ``lr``'s dtype for a tensor ``lr``; 1 minus that factor is exact in float64.
    """
    factor = 1.0 - lr * weight_decay
    if isinstance(factor, torch.Tensor):
        return factor.to(foreach.scalar_dtype(factor.device)) - 1.0
    return factor - 1.0


def _transform(learning_rate: ScalarOrSchedule, cfg: _Config) -> GradientTransformation:
    """The transformation for checked hyperparameters: leafwise maths, 2-D leaves checked by its hook."""
    decays = not is_zero(cfg.weight_decay)

    def init_leaves(params: Leaves) -> MuonState:
        return MuonState(count=init_count(params), momentum_buffer=foreach.zeros_like(params))

    def update_leaves(grads: Leaves, state: MuonState, params: Leaves | None) -> tuple[Leaves, MuonState]:
        buf = foreach.lerp(state.momentum_buffer, grads, foreach.for_leaves(1.0 - cfg.momentum, grads))
        direction = foreach.lerp(grads, buf, foreach.for_leaves(cfg.momentum, grads)) if cfg.nesterov else buf
        lr = learning_rate(state.count) if callable(learning_rate) else learning_rate
        out = []
        for m in direction:
            o = newton_schulz(m, cfg.coefficients, cfg.ns_steps, cfg.eps).to(m.dtype)
            scale = -(lr * cfg.ratio_of(m.size(0), m.size(1)))  # in lr's dtype for a tensor lr, as torch's
            out.append(o.mul_(scale.to(m.dtype) if isinstance(scale, torch.Tensor) else scale))
        if decays and params is not None:
            foreach.add_scaled_(out, foreach.for_leaves(_shrink(lr, cfg.weight_decay), grads), params)
        return out, MuonState(count=state.count + 1, momentum_buffer=buf)

    return leafwise(
        _NAME, update_leaves, init=init_leaves, state=MuonState, tree_fields=("momentum_buffer",),
        needs_params=decays, validate=_check_matrices,
    )


@recorded
def muon(
    learning_rate: ScalarOrSchedule = 1e-3,
    *,
    weight_decay: Hyper = 0.1,
    momentum: Hyper = 0.95,
    nesterov: bool = True,
    ns_coefficients: tuple[Hyper, Hyper, Hyper] = (3.4445, -4.775, 2.0315),
    eps: Hyper = 1e-7,
    ns_steps: int = 5,
    adjust_lr_fn: str | None = None,
) -> GradientTransformation:
    """Muon (Jordan et al., 2024): ``torch.optim.Muon``, defaults included, for 2-D parameters only.

    With ``G`` the gradient of a ``rows x cols`` parameter ``P``:

    * ``B = lerp(B, G, 1 - momentum)`` (the momentum buffer, from zero), and
      ``M = lerp(G, B, momentum)`` with ``nesterov``, else ``M = B``;
    * ``O = newton_schulz(M)``: ``ns_steps`` quintic iterations with ``ns_coefficients``, in bfloat16;
    * the new parameter is ``P * (1 - lr * weight_decay) - lr * ratio * O`` (decoupled
      decay), returned as an update for :func:`functopk.apply_updates`, where
      ``ratio`` is ``adjust_lr_fn``'s: ``sqrt(max(1, rows / cols))`` (``None`` or
      ``"original"``, Jordan's), ``0.2 * sqrt(max(rows, cols))`` (``"match_rms_adamw"``,
      Liu et al., 2025) or ``sqrt(rows / cols)`` (``"spectral_unclamped"``, Bernstein's).

    **Precision.** The Newton-Schulz iteration runs in bfloat16 whatever the
    parameters' dtype, as torch's does: ``O`` differs from the same iteration in
    exact arithmetic by ~1e-2 relative, float64 parameters included. Since the
    bfloat16 maths is torch's, op for op (bit-equal), and the rest runs in the
    parameters' dtype with torch's kernels, this agrees with torch in the same
    dtype to that dtype's precision (tested to 1e-12 relative in float64), not
    merely to bfloat16's. A tensor ``lr`` enters ``lr * ratio`` and
    ``1 - lr * weight_decay`` in its own dtype, as in torch.

    **Other parameters.** Like torch's, this refuses parameters that are not 2-D
    (``ValueError`` naming the leaf, at ``init`` and ``update``): give them to
    another optimizer with :func:`functopk.partition` (see the example).

    One difference: for bfloat16 parameters with ``nesterov=False``, torch's
    Newton-Schulz divides its momentum buffer by its norm in place
    (``buf.bfloat16()`` is ``buf``), renormalising it every step; here the buffer
    stays the plain momentum, as for other dtypes.

    Args:
        learning_rate: A number, a 0-d tensor or a schedule ``step -> lr``.
        weight_decay: Decoupled weight decay (torch's default 0.1).
        momentum: The momentum factor, ``>= 0``.
        nesterov: Use Nesterov momentum.
        ns_coefficients: The iteration's ``(a, b, c)``: numbers (0-d tensors are accepted
            and agree to ~1e-2, see :func:`newton_schulz`).
        eps: The least norm the momentum is divided by before the iteration.
        ns_steps: The number of iterations, an int in ``[0, 100)`` (a Python loop:
            list it in ``inject_hyperparams``'s ``static_args``).
        adjust_lr_fn: ``None``, ``"original"``, ``"match_rms_adamw"`` or ``"spectral_unclamped"``.

    Example:
        >>> import torch, functopk as ft
        >>> from functopk.optim.muon import muon
        >>> params = {"w": torch.eye(2) * 3.0, "b": torch.zeros(2)}
        >>> labels = ft.tree.map(lambda p: "muon" if p.dim() == 2 else "adamw", params)
        >>> tx = ft.partition({"muon": muon(0.1, weight_decay=0.0), "adamw": ft.adamw(0.1)}, labels)
        >>> grads = {"w": torch.tensor([[1.0, 0.0], [0.0, 0.01]]), "b": torch.ones(2)}
        >>> updates, state = tx.update(grads, tx.init(params), params)
        >>> updates["w"].diagonal().abs() > 0.05  # both directions get a sizeable step
        tensor([True, True])
    """
    learning_rate = check_scalar_or_schedule(learning_rate, "learning_rate", minimum=0.0)
    weight_decay = check_hyperparam(weight_decay, "weight_decay", minimum=0.0)
    momentum = check_hyperparam(momentum, "momentum", minimum=0.0)
    check_bool(nesterov, "nesterov")
    coefficients = _check_coefficients(ns_coefficients)
    eps = check_hyperparam(eps, "eps", minimum=0.0)
    ns_steps = check_int(ns_steps, "ns_steps", minimum=0, below=100)
    cfg = _Config(weight_decay, momentum, nesterov, coefficients, eps, ns_steps, _check_adjust(adjust_lr_fn))
    return _transform(learning_rate, cfg)


# --------------------------------------------------------------------------- the torch.optim adapter's tables


def _from_torch(group: dict[str, Any]) -> GradientTransformation:
    """:func:`muon` from a ``torch.optim.Muon`` param group."""
    return muon(
        group_scalar(group["lr"]),
        weight_decay=group_scalar(group["weight_decay"]),
        momentum=group_scalar(group["momentum"]),
        nesterov=group["nesterov"],
        ns_coefficients=group_scalar(group["ns_coefficients"]),
        eps=group_scalar(group["eps"]),
        ns_steps=group["ns_steps"],
        adjust_lr_fn=group["adjust_lr_fn"],
    )


TORCH_BUILDERS: dict[str, Callable[[dict[str, Any]], GradientTransformation]] = {"Muon": _from_torch}
"""``torch.optim`` class name -> a function of that class's complete param group returning :func:`muon`."""

TORCH_STATE_NAMES: dict[str, dict[str, str]] = {"Muon": {"momentum_buffer": "momentum_buffer"}}
"""``torch.optim`` class name -> {:class:`MuonState` field: torch's per-parameter state key}.

``count`` has no torch counterpart (torch's Muon keeps no step): it only drives
learning-rate schedules.
"""
