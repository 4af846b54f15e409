"""In-place steps of :class:`~functopk.adapter.groups.ParamGroupOptimizer`: the new state written into the old.

The adapter owns the tensors of ``opt.state`` between steps (its ``state_dict``
hands out copies and its ``load_state_dict`` keeps copies), so, as
``torch.optim``'s foreach implementations do, a step may write the new moments
into the old ones instead of allocating a fresh state and dropping the old one.
Each step here runs the kernels of the pure transformation that
:mod:`functopk.adapter.registry` builds for the class, in the same order and with
the same scalars, with the state as their output: the results are the same bit
for bit (``tests/adapter/test_inplace.py``). The updates are fresh tensors, added
to the parameters by the adapter, except for SGD, RMSprop and Adamax on CPU,
whose whole step runs slice by slice and adds each update slice into its
parameter slice itself (:mod:`functopk.adapter.inplace_chunked`; ``run`` then
returns ``None`` for the updates): no parameter-sized tree per step.

A builder returns ``None`` (the adapter then runs the pure transformation)
where that equality is not certain: a hyperparameter that is a tensor
(schedulers may change it in place; the pure path reads it on device). A step's
check returns ``None`` where a state tensor is not a dense real tensor of its
parameter's shape, dtype and device, or a gradient not of its parameter's
(a sparse SGD momentum from a torch checkpoint, a state loaded in another dtype),
or the dtype is not float32 or float64 (in float16 and bfloat16 the in-place
foreach kernels round differently).

This module has the steps of SGD (with momentum), Adam, AdamW, RMSprop, Adagrad
and Adamax and what all steps share; :mod:`functopk.adapter.inplace_adam_variants`
has NAdam's and RAdam's, :mod:`functopk.adapter.inplace_classic` Adadelta's,
Rprop's and ASGD's. Adafactor (a factored state a fraction of the parameters' size)
and Muon (its step is matrix products) take the pure path.

Shared leaves (a cohort's step count, which parameters stepping without this
cohort may hold too) are never written in place: each step makes a new one.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from functopk.adapter import inplace_chunked
from functopk.optim.adaptive import adam_config, adam_direction
from functopk.tree import chunked, foreach

__all__ = [
    "MOSTLY_ZERO", "UPDATES_WANTED", "InplaceBuilder", "InplaceStep", "adagrad_step", "adam_step", "adamax_step",
    "rmsprop_step", "sgd_step",
]

Entries = list[dict[str, Any]]
Run = Callable[[], tuple[list[torch.Tensor] | None, Entries]]
InplaceStep = Callable[[list[torch.Tensor], list[torch.Tensor], Entries], Run | None]
"""``(grads, params, entries) -> run``: checks that the tensors fit (``None`` if not) and changes nothing;
``run()`` then does the step, returning the updates (``None``: it added them into the parameters itself)
and the new entries (the same part tensors)."""
InplaceBuilder = Callable[[Mapping[str, Any]], InplaceStep | None]
"""A param group's hyperparameters (torch's keys) -> its in-place step, or ``None`` where there is none."""


def all_numbers(*values: Any) -> bool:
    """Whether every value is a Python number (not a tensor, whose value the pure path reads on device)."""
    return all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)


_EXACT_DTYPES = (torch.float32, torch.float64)
"""Where the in-place kernels round as the pure ones (in float16 and bfloat16, ``_foreach_mul_`` does not)."""


def _like(x: Any, p: torch.Tensor) -> bool:
    return (
        isinstance(x, torch.Tensor) and x.layout == torch.strided and x.shape == p.shape
        and x.dtype == p.dtype and x.dtype in _EXACT_DTYPES and x.device == p.device
    )  # fmt: skip


def fits(
    grads: Sequence[torch.Tensor], params: Sequence[torch.Tensor], entries: Entries, names: Sequence[str]
) -> bool:
    """Each gradient and each state tensor named ``names`` is a dense float32/float64 tensor like its parameter,
    and the state tensors are distinct."""
    parts = [e.get(n) for e in entries for n in names]
    if len({id(x) for x in parts}) != len(parts):  # a tensor written twice would be stepped twice
        return False
    return all(_like(g, p) for g, p in zip(grads, params)) and all(
        _like(e.get(n), p) for e, p in zip(entries, params) for n in names
    )


def with_entry(entries: Entries, name: str, value: torch.Tensor) -> Entries:
    return [{**e, name: value} for e in entries]


MOSTLY_ZERO = "functopk: mostly-zero gradients"
"""A key of the hyperparameters given to a builder: ``True`` when most gradient coordinates are zero.

``ParamGroupOptimizer`` sets it when its ``sparsify`` is a constant exact top-k;
:func:`adam_step` then floors ``nu`` before ``sqrt`` where that changes no bit
(:func:`functopk.optim.adaptive.sqrt_floor`), which avoids ``sqrt``'s slow path for zeros.
"""

UPDATES_WANTED = "functopk: updates wanted"
"""A key of the hyperparameters given to a builder: ``True`` when the adapter needs the updates themselves.

``ParamGroupOptimizer`` sets it with ``sparsify_on="update"`` (its ``sparsify`` runs on the updates
before they are added); the steps that would add their updates slice by slice
(:mod:`functopk.adapter.inplace_chunked`) then return them instead.
"""


def _sliced(h: Mapping[str, Any], params: list[torch.Tensor]) -> bool:
    """Whether the step runs slice by slice into the parameters (no update tree): see :mod:`inplace_chunked`."""
    return not h.get(UPDATES_WANTED, False) and chunked.applies(params)


def adam_step(h: Mapping[str, Any], decoupled: bool = False) -> InplaceStep | None:
    """``torch.optim.Adam`` (``AdamW`` with ``decoupled``) in place: the maths of :func:`functopk.adam`.

    The moments are updated with ``lerp_``, ``mul_``/``addcmul_`` (and ``maximum_``
    for ``amsgrad``), where the pure update calls the out-of-place kernels.
    """
    lr, (b1, b2), eps, wd = h["lr"], h["betas"], h["eps"], h["weight_decay"]
    if not all_numbers(lr, b1, b2, eps, wd):
        return None
    cfg = adam_config(b1, b2, eps, 0.0, amsgrad=h["amsgrad"], maximize=h["maximize"])
    b1, b2 = float(b1), float(b2)  # (numbers: no tensor is read)
    decoupled = decoupled or h.get("decoupled_weight_decay", False)
    names = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq") if cfg.amsgrad else ("exp_avg", "exp_avg_sq")
    mostly_zero = bool(h.get(MOSTLY_ZERO, False))

    def check(grads: list[torch.Tensor], params: list[torch.Tensor], entries: Entries) -> Run | None:
        if not fits(grads, params, entries, names):
            return None

        def run() -> tuple[list[torch.Tensor], Entries]:
            mu, nu, nu_max = ([e[n] for e in entries] for n in ("exp_avg", "exp_avg_sq", names[-1]))
            g = foreach.neg(grads) if cfg.maximize else grads
            if wd != 0 and not decoupled:
                g = foreach.add_scaled(g, wd, params)
            torch._foreach_lerp_(mu, g, 1.0 - b1)
            torch._foreach_mul_(nu, b2)
            torch._foreach_addcmul_(nu, g, g, value=1.0 - b2)
            if cfg.amsgrad:
                torch._foreach_maximum_(nu_max, nu)
            count = entries[0]["step"]
            out = adam_direction(mu, nu_max if cfg.amsgrad else nu, count, cfg, lr, mu, mostly_zero)
            if wd != 0 and decoupled:
                foreach.add_scaled_(out, foreach.for_leaves(-lr * wd, g), params)
            return out, with_entry(entries, "step", count + 1)

        return run

    return check


def sgd_step(h: Mapping[str, Any]) -> InplaceStep | None:
    """``torch.optim.SGD`` with momentum in place: the maths of :func:`functopk.sgd`, the buffer as the output.

    Without dampening the buffer is ``grad + momentum * buffer`` in one ``add``
    kernel per parameter written into the buffer (``out=``), the pure update's kernel.
    """
    lr, momentum, dampening = h["lr"], h["momentum"], h["dampening"]
    if not all_numbers(lr, momentum, dampening, h["weight_decay"]) or momentum == 0:
        return None  # (no momentum: no state to update)

    def check(grads: list[torch.Tensor], params: list[torch.Tensor], entries: Entries) -> Run | None:
        if not fits(grads, params, entries, ("momentum_buffer",)):
            return None

        def run() -> tuple[list[torch.Tensor] | None, Entries]:
            buf = [e["momentum_buffer"] for e in entries]
            count = entries[0]["count"]
            factor = None
            if dampening != 0:  # the first step undamped, as in functopk.trace
                one = torch.ones((), dtype=foreach.scalar_dtype(count.device), device=count.device)
                factor = foreach.for_leaves(torch.where(count == 0, one, 1.0 - dampening), grads)
            if _sliced(h, params):
                body = inplace_chunked.sgd_body(h, factor)
                chunked.add_(params, [grads, buf], body, rows=inplace_chunked.ROWS)
                return None, with_entry(entries, "count", count + 1)
            g = _prefix(grads, params, h)
            if factor is None:
                foreach.add_scaled_into(g, momentum, buf)
            else:
                torch._foreach_mul_(buf, momentum)
                torch._foreach_add_(buf, foreach.mul(g, factor))
            # (the state's buffer is scaled into a new tensor; Nesterov's fresh sum, in place)
            out = foreach.mul_(foreach.add_scaled(g, momentum, buf), -lr) if h["nesterov"] else foreach.mul(buf, -lr)
            return out, with_entry(entries, "count", count + 1)

        return run

    return check


def _prefix(grads: list[torch.Tensor], params: list[torch.Tensor], h: Mapping[str, Any]) -> list[torch.Tensor]:
    """torch.optim's first two moves, as :func:`functopk.sgd` and friends: ``maximize``, then L2 weight decay."""
    g = foreach.mul(grads, -1.0) if h["maximize"] else grads
    return foreach.add_scaled(g, h["weight_decay"], params) if h["weight_decay"] != 0 else g


def rmsprop_step(h: Mapping[str, Any]) -> InplaceStep | None:
    """``torch.optim.RMSprop`` in place: the maths of :func:`functopk.rmsprop` (``mul_``/``addcmul_``, ``lerp_``)."""
    lr, alpha, eps, momentum = h["lr"], h["alpha"], h["eps"], h["momentum"]
    if not all_numbers(lr, alpha, eps, momentum, h["weight_decay"]):
        return None
    names = ("square_avg",) + (("grad_avg",) if h["centered"] else ()) + (("momentum_buffer",) if momentum else ())

    def check(grads: list[torch.Tensor], params: list[torch.Tensor], entries: Entries) -> Run | None:
        if not fits(grads, params, entries, names):
            return None

        def run() -> tuple[list[torch.Tensor] | None, Entries]:
            count = entries[0]["step"]
            if _sliced(h, params):
                state = [[e[n] for e in entries] for n in names]
                chunked.add_(params, [grads, *state], inplace_chunked.rmsprop_body(h), rows=inplace_chunked.ROWS)
                return None, with_entry(entries, "step", count + 1)
            g = _prefix(grads, params, h)
            nu = [e["square_avg"] for e in entries]
            torch._foreach_mul_(nu, alpha)
            torch._foreach_addcmul_(nu, g, g, value=1.0 - alpha)
            square = nu
            if h["centered"]:
                mu = [e["grad_avg"] for e in entries]
                torch._foreach_lerp_(mu, g, 1.0 - alpha)
                square = foreach.addcmul(nu, mu, mu, value=-1.0)
            out = foreach.div_into(g, foreach.add_scalar_(foreach.sqrt(square), eps))
            if momentum:  # the state's buffer, scaled into a new tensor; else the fresh quotient, in place
                out = foreach.mul(foreach.add_scaled_into(out, momentum, [e["momentum_buffer"] for e in entries]), -lr)
            else:
                out = foreach.mul_(out, -lr)
            return out, with_entry(entries, "step", count + 1)

        return run

    return check


def adagrad_step(h: Mapping[str, Any]) -> InplaceStep | None:
    """``torch.optim.Adagrad`` in place: the maths of :func:`functopk.adagrad` (``addcmul_`` into the sum)."""
    lr, lr_decay, eps = h["lr"], h["lr_decay"], h["eps"]
    if not all_numbers(lr, lr_decay, eps, h["weight_decay"]):
        return None

    def check(grads: list[torch.Tensor], params: list[torch.Tensor], entries: Entries) -> Run | None:
        if not fits(grads, params, entries, ("sum",)):
            return None

        def run() -> tuple[list[torch.Tensor], Entries]:
            g = _prefix(grads, params, h)
            total = [e["sum"] for e in entries]
            torch._foreach_addcmul_(total, g, g)
            out = foreach.div_into(g, foreach.add_scalar_(foreach.sqrt(total), eps))
            count = entries[0]["step"]
            if lr_decay == 0:
                return foreach.mul_(out, -lr), with_entry(entries, "step", count + 1)
            # functopk.adagrad's schedule: in float64 (float32 for float32 leaves), as torch's Python float
            decayed = -lr / (1.0 + count.to(foreach.scalar_dtype(count.device)) * lr_decay)
            return foreach.mul_(out, foreach.for_leaves(decayed, out)), with_entry(entries, "step", count + 1)

        return run

    return check


def adamax_step(h: Mapping[str, Any]) -> InplaceStep | None:
    """``torch.optim.Adamax`` in place: the maths of :func:`functopk.optim.adamax` (``lerp_``, ``maximum_``)."""
    lr, (b1, b2), eps = h["lr"], h["betas"], h["eps"]
    if not all_numbers(lr, b1, b2, eps, h["weight_decay"]):
        return None

    def check(grads: list[torch.Tensor], params: list[torch.Tensor], entries: Entries) -> Run | None:
        if not fits(grads, params, entries, ("exp_avg", "exp_inf")):
            return None

        def run() -> tuple[list[torch.Tensor] | None, Entries]:
            mu, nu = [e["exp_avg"] for e in entries], [e["exp_inf"] for e in entries]
            count = entries[0]["step"]
            t = (count + 1).to(foreach.scalar_dtype(count.device))
            step = foreach.for_leaves((lr / (1.0 - torch.pow(b1, t))) * -1.0, grads)
            if _sliced(h, params):
                body = inplace_chunked.adamax_body(h, step)
                chunked.add_(params, [grads, mu, nu], body, rows=inplace_chunked.ROWS)
                return None, with_entry(entries, "step", count + 1)
            g = foreach.neg(grads) if h["maximize"] else grads
            if h["weight_decay"] != 0:
                g = foreach.add_scaled(g, h["weight_decay"], params)
            torch._foreach_lerp_(mu, g, 1.0 - b1)
            torch._foreach_mul_(nu, b2)
            torch._foreach_maximum_(nu, foreach.add_scalar_(foreach.abs(g), eps))
            return foreach.mul_(foreach.div(mu, nu), step), with_entry(entries, "step", count + 1)  # m / u

        return run

    return check
