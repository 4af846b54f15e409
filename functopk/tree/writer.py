"""Where an optimizer's new state goes: fresh tensors (the pure update) or the old state's own (in place).

An optimizer's step is written once, as maths on lists of leaves that takes a
*writer* (see :func:`functopk.leafwise`'s ``formula``). The writer decides where
the step's outputs go:

* the first operation that turns an old state field into its new value
  (``mu = w.lerp(mu, g, 1 - b1)``) either returns fresh tensors (:data:`FRESH`:
  the old state is only read, as a pure function must) or writes into the old
  state's tensors with the in-place foreach kernels and returns them
  (:data:`IN_PLACE`). Either way the result is then *owned* by the step, so the
  formula may go on with in-place kernels on it (``addcmul_`` after ``mul``);
* temporaries come from ``w.new``: the :mod:`functopk.tree.foreach` functions
  (fresh tensors, one foreach kernel per operation over all leaves), or, when
  the engine runs the formula batch by batch on CPU, the same functions writing
  into scratch rows reused from batch to batch (:class:`functopk.tree.chunked.Scratch`):
  no allocation per batch. The formula may modify a temporary in place.

The two give the same numbers bit for bit where the in-place kernels round as
the out-of-place ones: in float32 and float64, with Python-number scalars
(:data:`EXACT_DTYPES`; the in-place engine checks both before it uses
:data:`IN_PLACE`). The writer also carries what the engine knows about the
step's input: ``mostly_zero`` (most gradient coordinates are zero, as after a
top-k), which a formula may use for a faster road to the same bits.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from functopk.tree import foreach

__all__ = ["EXACT_DTYPES", "FRESH", "IN_PLACE", "IN_PLACE_SPARSE", "Writer", "in_place", "like"]

Leaves = Sequence[torch.Tensor]
Scalar = float | torch.Tensor

EXACT_DTYPES = (torch.float32, torch.float64)
"""Where the in-place kernels round as the out-of-place ones (in float16 and bfloat16 ``_foreach_mul_`` does not)."""


def like(x: object, p: torch.Tensor, exact: bool = True) -> bool:
    """Whether ``x`` can take an in-place step for parameter ``p``: a dense tensor of its shape, dtype and device,
    float32 or float64 (any dtype without ``exact``)."""
    return (
        isinstance(x, torch.Tensor) and x.layout == torch.strided and x.shape == p.shape
        and x.dtype == p.dtype and (x.dtype in EXACT_DTYPES or not exact) and x.device == p.device
    )  # fmt: skip


class Writer:
    """Fresh outputs: each method returns the new value of its first argument (a state field) in new tensors.

    Example:
        >>> import torch
        >>> mu = [torch.zeros(2)]
        >>> FRESH.lerp(mu, [torch.ones(2)], 0.5), mu            # the old state only read
        ([tensor([0.5000, 0.5000])], [tensor([0., 0.])])
        >>> IN_PLACE.lerp(mu, [torch.ones(2)], 0.5)[0] is mu[0]  # written into
        True
    """

    in_place = False
    mostly_zero = False
    new: Any = foreach
    """Where temporaries come from: functions named and called as :mod:`functopk.tree.foreach`'s."""

    def mul(self, x: Leaves, scalar: Scalar | Leaves) -> list[torch.Tensor]:
        """``x * scalar`` (a number, a 0-d tensor, or one tensor per leaf)."""
        if isinstance(scalar, (list, tuple)):
            return foreach.mul_list(x, scalar)
        return foreach.mul(x, scalar)  # type: ignore[arg-type]

    def lerp(self, x: Leaves, y: Leaves, weight: Scalar) -> list[torch.Tensor]:
        """``x + weight * (y - x)``: a running mean."""
        return foreach.lerp(x, y, weight)

    def addcmul(self, x: Leaves, y: Leaves, z: Leaves, value: float = 1.0) -> list[torch.Tensor]:
        """``x + value * y * z``."""
        return foreach.addcmul(x, y, z, value=value)

    def maximum(self, x: Leaves, y: Leaves) -> list[torch.Tensor]:
        """``max(x, y)`` elementwise."""
        return foreach.maximum(x, y)

    def scaled_plus(self, x: Leaves, scalar: Scalar, y: Leaves) -> list[torch.Tensor]:
        """``y + scalar * x`` (one kernel for a number: momentum's ``g + decay * buf``)."""
        return foreach.add_scaled(y, scalar, x)

    def toward(self, x: Leaves, y: Leaves, weight: torch.Tensor) -> list[torch.Tensor]:
        """``x + weight * (y - x)`` with a 0-d tensor ``weight``, as ``addcmul`` of the difference (ASGD's average)."""
        return foreach.addcmul(x, foreach.sub(y, x), [weight] * len(x))

    def zero_where(self, x: Leaves, conds: Leaves, values: Leaves) -> list[torch.Tensor]:
        """``0`` where ``cond``, else ``values``, leaf by leaf (the old ``x`` is not read)."""
        return [torch.where(c, _zero(v), v) for c, v in zip(conds, values)]

    def last_mul(self, xs: Leaves, scalar: Scalar) -> list[torch.Tensor]:
        """A temporary ``xs * scalar``, where this is the last use of ``xs``: written into ``xs`` when the engine
        owns it (a batch's temporary, not a gradient or a state), else fresh."""
        return self.new.mul(xs, scalar)


def _zero(x: torch.Tensor) -> torch.Tensor:
    return torch.zeros((), dtype=x.dtype, device=x.device)


class _InPlace(Writer):
    """The state's own tensors as outputs (number scalars, float32/float64 tensors: the engine checks)."""

    in_place = True

    def __init__(self, mostly_zero: bool, new: Any = foreach) -> None:
        self.mostly_zero, self.new = mostly_zero, new

    def mul(self, x: Leaves, scalar: Scalar | Leaves) -> list[torch.Tensor]:
        if x:
            torch._foreach_mul_(list(x), list(scalar) if isinstance(scalar, (list, tuple)) else scalar)  # type: ignore[arg-type]
        return list(x)

    def lerp(self, x: Leaves, y: Leaves, weight: Scalar) -> list[torch.Tensor]:
        if x:
            torch._foreach_lerp_(list(x), list(y), weight)  # type: ignore[arg-type]  # (a number: the engine checks)
        return list(x)

    def addcmul(self, x: Leaves, y: Leaves, z: Leaves, value: float = 1.0) -> list[torch.Tensor]:
        return foreach.addcmul_(list(x), y, z, value=value)

    def maximum(self, x: Leaves, y: Leaves) -> list[torch.Tensor]:
        if x:
            torch._foreach_maximum_(list(x), list(y))
        return list(x)

    def scaled_plus(self, x: Leaves, scalar: Scalar, y: Leaves) -> list[torch.Tensor]:
        return foreach.add_scaled_into(y, scalar, list(x))  # type: ignore[arg-type]  # (a number: the engine checks)

    def toward(self, x: Leaves, y: Leaves, weight: torch.Tensor) -> list[torch.Tensor]:
        if x and x[0].device.type == "cpu":  # leaf by leaf: a fresh tree of differences costs page faults on CPU
            for a, b in zip(x, y):
                a.addcmul_(torch.sub(b, a), weight)
        elif x:
            torch._foreach_addcmul_(list(x), foreach.sub(y, x), [weight] * len(x))
        return list(x)

    def zero_where(self, x: Leaves, conds: Leaves, values: Leaves) -> list[torch.Tensor]:
        for out, c, v in zip(x, conds, values):
            torch.where(c, _zero(v), v, out=out)
        return list(x)

    def last_mul(self, xs: Leaves, scalar: Scalar) -> list[torch.Tensor]:
        owns = getattr(self.new, "owns", None)
        if owns is not None and owns(xs):
            return foreach.mul_(xs, scalar)  # type: ignore[arg-type]
        return self.new.mul(xs, scalar)


FRESH = Writer()
"""The pure update's writer."""
IN_PLACE = _InPlace(mostly_zero=False)
"""The in-place engine's writer."""
IN_PLACE_SPARSE = _InPlace(mostly_zero=True)
"""The in-place engine's writer for a step whose input is mostly zero (the output of a top-k)."""


def in_place(mostly_zero: bool, new: Any) -> Writer:
    """The in-place writer with temporaries from ``new`` (a batch's scratch: :mod:`functopk.tree.chunked`)."""
    return _InPlace(mostly_zero, new)
