"""The whole in-place step of SGD, RMSprop and Adamax on CPU, slice by slice, added into the parameters.

:mod:`functopk.adapter.inplace`'s steps compute an update tree and the adapter
adds it to the parameters; for these three classes that fresh parameter-sized
tree (on CPU: first-touch page faults every step) and its extra pass were most
of the gap to ``torch.optim``'s foreach step, which fuses the add into the
parameters (``add_(alpha=-lr)``, ``addcdiv_``). Here each step is a *body* run
by :func:`functopk.tree.chunked.add_` on slices of about a million elements:
the same kernels as the whole-tensor step, in the same order, with the same
scalars (so the results are the pure path's bit for bit; torch's fused kernels
round once where update-then-add rounds twice, and are not used), writing the
state slices in place and the update into a cache-sized scratch row that is
added into the parameter slice at once. Per step: no parameter-sized tree, one
scratch buffer of one or two rows of at most a million elements.

A body is ``body(scratch, p, g, *state) -> update`` on equal-shaped slices;
``scratch`` has :data:`ROWS` rows.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

__all__ = ["ROWS", "adamax_body", "rmsprop_body", "sgd_body"]

ROWS = 2
"""Scratch rows a body uses: the modified gradient and the update."""

Body = Callable[..., torch.Tensor]


def _prefix(out: torch.Tensor, g: torch.Tensor, p: torch.Tensor, h: Mapping[str, Any]) -> torch.Tensor:
    """torch's first moves on a gradient slice, into ``out`` where there are any: negate, add weight decay."""
    if h["maximize"]:
        g = torch.mul(g, -1.0, out=out)
    if h["weight_decay"] != 0:
        g = torch.add(g, p, alpha=h["weight_decay"], out=out)
    return g


def sgd_body(h: Mapping[str, Any], factor: torch.Tensor | float | None) -> Body:
    """SGD with momentum (``h``: torch's hyperparameters, numbers): ``buf = g + momentum * buf`` (with
    ``dampening``: ``buf = momentum * buf + factor * g``, ``factor`` the 0-d first-step-undamped factor),
    the update ``-lr * buf`` (Nesterov: ``-lr * (g + momentum * buf)``).

    Example:
        >>> import torch
        >>> h = {"lr": 0.5, "momentum": 0.9, "dampening": 0.0, "nesterov": False, "weight_decay": 0.0,
        ...      "maximize": False}
        >>> g, buf = torch.ones(2), torch.ones(2)
        >>> sgd_body(h, None)([torch.empty(2), torch.empty(2)], torch.zeros(2), g, buf), buf
        (tensor([-0.9500, -0.9500]), tensor([1.9000, 1.9000]))
    """
    momentum, nesterov = h["momentum"], h["nesterov"]
    prefix = h["maximize"] or h["weight_decay"] != 0
    neg_lr = -h["lr"]

    def body(s: list[torch.Tensor], p: torch.Tensor, g: torch.Tensor, buf: torch.Tensor) -> torch.Tensor:
        if prefix:
            g = _prefix(s[0], g, p, h)
        if factor is None:
            torch.add(g, buf, alpha=momentum, out=buf)
        else:
            buf.mul_(momentum).add_(torch.mul(g, factor, out=s[1]))
        if nesterov:
            return torch.add(g, buf, alpha=momentum, out=s[1]).mul_(neg_lr)
        return torch.mul(buf, neg_lr, out=s[1])

    return body


def rmsprop_body(h: Mapping[str, Any]) -> Body:
    """RMSprop: ``square_avg`` (and ``grad_avg`` when centered, ``momentum_buffer`` with momentum) in place;
    the state slices follow the gradient in that order.

    Example:
        >>> import torch
        >>> h = {"lr": 0.1, "alpha": 0.5, "eps": 0.0, "momentum": 0.0, "centered": False, "weight_decay": 0.0,
        ...      "maximize": False}
        >>> rmsprop_body(h)([torch.empty(1), torch.empty(1)], torch.zeros(1), torch.ones(1), torch.zeros(1))
        tensor([-0.1414])
    """
    alpha, eps, momentum, centered = h["alpha"], h["eps"], h["momentum"], h["centered"]
    neg_lr = -h["lr"]

    def body(s: list[torch.Tensor], p: torch.Tensor, g: torch.Tensor, *state: torch.Tensor) -> torch.Tensor:
        g = _prefix(s[0], g, p, h)
        nu = state[0]
        nu.mul_(alpha).addcmul_(g, g, value=1.0 - alpha)
        square = nu
        if centered:
            mu = state[1]
            mu.lerp_(g, 1.0 - alpha)
            square = torch.addcmul(nu, mu, mu, value=-1.0, out=s[1])
        out = torch.sqrt(square, out=s[1]).add_(eps)
        torch.div(g, out, out=out)
        if momentum:
            buf = state[-1]
            return torch.mul(torch.add(out, buf, alpha=momentum, out=buf), neg_lr, out=out)
        return out.mul_(neg_lr)

    return body


def adamax_body(h: Mapping[str, Any], step: torch.Tensor | float) -> Body:
    """Adamax: ``exp_avg`` and ``exp_inf`` in place, the update ``step * exp_avg / exp_inf`` (``step``: the 0-d
    ``-lr / (1 - b1 ** t)``).

    Example:
        >>> import torch
        >>> h = {"betas": (0.5, 0.5), "eps": 0.0, "weight_decay": 0.0, "maximize": False}
        >>> adamax_body(h, torch.tensor(-2.0))([torch.empty(1), torch.empty(1)], torch.zeros(1), torch.ones(1),
        ...                                     torch.zeros(1), torch.zeros(1))
        tensor([-1.])
    """
    (b1, b2), eps = h["betas"], h["eps"]

    def body(s: list[torch.Tensor], p: torch.Tensor, g: torch.Tensor, mu: torch.Tensor, nu: torch.Tensor) -> Any:
        g = torch.neg(g, out=s[0]) if h["maximize"] else g
        if h["weight_decay"] != 0:
            g = torch.add(g, p, alpha=h["weight_decay"], out=s[0])
        mu.lerp_(g, 1.0 - b1)
        nu.mul_(b2)
        floor = torch.abs(g, out=s[1]).add_(eps)
        torch.maximum(nu, floor, out=nu)
        return torch.div(mu, nu, out=floor).mul_(step)

    return body
