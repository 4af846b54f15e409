"""In-place steps for ``torch.optim.Adadelta``, ``Rprop`` and ``ASGD``: :mod:`functopk.optim.classic`'s maths.

As :mod:`functopk.adapter.inplace` (its checks and conventions): the state
tensors are written with the in-place forms of the pure update's kernels
(``mul_``/``addcmul_`` for the running means, ``mul_`` and ``clamp_`` for
Rprop's step sizes, ``where(out=)`` for its kept gradient, ``addcmul_`` for
ASGD's average), and the rest is computed by the functions the pure
transformations use (:func:`~functopk.optim.classic.adadelta_delta`,
:func:`~functopk.optim.classic.rprop_factors`, ...): the results are the pure
path's bit for bit (``tests/adapter/test_inplace.py``). ASGD's ``eta`` and ``mu``
are shared 0-d leaves: new ones each step.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from functopk.adapter.inplace import Entries, InplaceStep, Run, all_numbers, fits, with_entry
from functopk.optim import classic
from functopk.tree import foreach, torch_rounding

__all__ = ["adadelta_step", "asgd_step", "rprop_step"]


def _first_moves(grads: list[torch.Tensor], params: list[torch.Tensor], h: Mapping[str, Any]) -> list[torch.Tensor]:
    """torch's: negate (``maximize``), then add ``weight_decay * params``, with the pure update's kernels."""
    g = foreach.neg(grads) if h["maximize"] else grads
    return foreach.add_scaled(g, h["weight_decay"], params) if h["weight_decay"] != 0 else g


def adadelta_step(h: Mapping[str, Any]) -> InplaceStep | None:
    """``torch.optim.Adadelta`` in place: the maths of :func:`functopk.optim.adadelta`.

    Example:
        >>> from functopk.adapter.inplace_classic import adadelta_step
        >>> adadelta_step({"lr": 1.0, "rho": 0.9, "eps": 1e-6, "weight_decay": 0.0, "maximize": False}) is not None
        True
    """
    lr, rho, eps = h["lr"], h["rho"], h["eps"]
    if not all_numbers(lr, rho, eps, h["weight_decay"]):
        return None

    def check(grads: list[torch.Tensor], params: list[torch.Tensor], entries: Entries) -> Run | None:
        if not fits(grads, params, entries, ("square_avg", "acc_delta")):
            return None

        def run() -> tuple[list[torch.Tensor], Entries]:
            g = _first_moves(grads, params, h)
            square_avg, acc_delta = [e["square_avg"] for e in entries], [e["acc_delta"] for e in entries]
            torch._foreach_mul_(square_avg, rho)
            torch._foreach_addcmul_(square_avg, g, g, value=1.0 - rho)
            delta = classic.adadelta_delta(square_avg, acc_delta, g, eps)
            torch._foreach_mul_(acc_delta, rho)
            torch._foreach_addcmul_(acc_delta, delta, delta, value=1.0 - rho)
            return foreach.mul_(delta, -lr), with_entry(entries, "step", entries[0]["step"] + 1)

        return run

    return check


def rprop_step(h: Mapping[str, Any]) -> InplaceStep | None:
    """``torch.optim.Rprop`` in place: the maths of :func:`functopk.optim.rprop`.

    Example:
        >>> from functopk.adapter.inplace_classic import rprop_step
        >>> rprop_step({"lr": 0.01, "etas": (0.5, 1.2), "step_sizes": (1e-6, 50.0), "maximize": False}) is not None
        True
    """
    (eta_minus, eta_plus), (low, high) = h["etas"], h["step_sizes"]
    if not all_numbers(eta_minus, eta_plus, low, high):
        return None

    def check(grads: list[torch.Tensor], params: list[torch.Tensor], entries: Entries) -> Run | None:
        if not fits(grads, params, entries, ("prev", "step_size")):
            return None

        def run() -> tuple[list[torch.Tensor], Entries]:
            g = foreach.neg(grads) if h["maximize"] else grads
            prev, step_size = [e["prev"] for e in entries], [e["step_size"] for e in entries]
            flipped, factors = classic.rprop_factors(g, prev, eta_minus, eta_plus)
            torch._foreach_mul_(step_size, factors)
            torch._foreach_clamp_min_(step_size, low)
            torch._foreach_clamp_max_(step_size, high)
            for x, f, kept in zip(g, flipped, prev):  # the gradient, 0 where its sign flipped, into prev
                torch.where(f, torch.zeros((), dtype=x.dtype, device=x.device), x, out=kept)
            return classic.rprop_direction(prev, step_size), with_entry(entries, "step", entries[0]["step"] + 1)

        return run

    return check


def asgd_step(h: Mapping[str, Any]) -> InplaceStep | None:
    """``torch.optim.ASGD`` in place: the maths of :func:`functopk.optim.asgd` (``addcmul_`` into ``ax``).

    Example:
        >>> from functopk.adapter.inplace_classic import asgd_step
        >>> h = {"lr": 0.01, "lambd": 1e-4, "alpha": 0.75, "t0": 1e6, "weight_decay": 0.0, "maximize": False}
        >>> asgd_step(h) is not None
        True
    """
    lr, lambd, alpha, t0 = h["lr"], h["lambd"], h["alpha"], h["t0"]
    if not all_numbers(lr, lambd, alpha, t0, h["weight_decay"]):
        return None

    def check(grads: list[torch.Tensor], params: list[torch.Tensor], entries: Entries) -> Run | None:
        if not fits(grads, params, entries, ("ax",)):
            return None

        def run() -> tuple[list[torch.Tensor], Entries]:
            g = _first_moves(grads, params, h)
            count, eta, mu = entries[0]["step"], entries[0]["eta"], entries[0]["mu"]
            loop = not torch_rounding.torch_foreach(h.get("foreach"), params)  # torch's for-loop rounds otherwise
            new_params = classic.asgd_new_params(g, params, eta, lambd, loop)
            ax = [e["ax"] for e in entries]
            if ax[0].device.type == "cpu":  # leaf by leaf: a fresh tree of differences costs page faults on CPU
                for a, x in zip(ax, new_params):
                    a.addcmul_(torch.sub(x, a), mu)
            else:
                torch._foreach_addcmul_(ax, foreach.sub(new_params, ax), [mu] * len(ax))
            if loop:
                classic.asgd_copy_while_mu_is_one_(ax, new_params, mu)
            torch._foreach_sub_(new_params, params)  # the update, in the fresh new parameters' buffers
            eta, mu = classic.asgd_next_eta_mu(count, eta.dtype, lr, lambd, alpha, t0, loop)
            shared = {"step": count + 1, "eta": eta, "mu": mu}  # one of each for the cohort: it steps together
            return new_params, [{**e, **shared} for e in entries]

        return run

    return check
