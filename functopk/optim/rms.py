"""RMSprop's running average of squared gradients and Adagrad's running sum of them.

Both divide the gradient by the root of their statistic (plus ``eps``, inside or
outside the root), with ``torch.optim``'s foreach kernels in its order, written
once as a :class:`~functopk.build.Formula` (fresh outputs for the pure update,
the state's own tensors for :func:`functopk.update_` and the ``torch.optim`` adapter).
"""

from __future__ import annotations

from typing import Any, NamedTuple

from functopk._checks import check_bool, check_hyperparam
from functopk.base import GradientTransformation, recorded
from functopk.build import Formula, leafwise
from functopk.inplace import Body
from functopk.optim._shared import Hyper, Leaves, is_number
from functopk.optim.adaptive import check_optional, ema_sq
from functopk.tree import foreach
from functopk.tree.maths import PyTree
from functopk.tree.writer import Writer

__all__ = ["ScaleByRmsState", "ScaleByRssState", "scale_by_rms", "scale_by_rss"]


def _root_plus_eps(new: Any, square: Leaves, eps: Hyper, eps_in_sqrt: bool) -> Leaves:
    """Fresh denominators (from ``new``: the writer's temporaries) ``sqrt(square + eps)`` (``eps_in_sqrt``) or
    ``sqrt(square) + eps``."""
    if eps_in_sqrt:
        return foreach.sqrt(foreach.add_scalar(square, eps))
    return foreach.add_scalar_(new.sqrt(square), eps)


# --------------------------------------------------------------------------- RMSprop


class ScaleByRmsState(NamedTuple):
    """State of :func:`scale_by_rms`.

    Attributes:
        nu: Running mean of the squared gradients.
        mu: With ``centered``, the running mean of the gradients; ``None`` otherwise.

    Example:
        >>> import torch, functopk as ft
        >>> ft.scale_by_rms().init({"w": torch.zeros(2)})
        ScaleByRmsState(nu={'w': tensor([0., 0.])}, mu=None)
    """

    nu: PyTree
    mu: PyTree | None


@recorded
def scale_by_rms(
    decay: Hyper = 0.9,
    eps: Hyper = 1e-8,
    initial_scale: Hyper = 0.0,
    *,
    eps_in_sqrt: bool = True,
    centered: bool = False,
) -> GradientTransformation:
    """Divide updates by the root of a running mean of their squares (RMSprop, Tieleman & Hinton, 2012).

    ``nu = decay * nu + (1 - decay) * g**2`` and the update is ``g / sqrt(nu + eps)``:
    optax's ``scale_by_rms``, defaults included. ``eps_in_sqrt=False`` puts ``eps``
    outside the root (``g / (sqrt(nu) + eps)``), as ``torch.optim.RMSprop`` does
    (whose ``alpha`` is ``decay``; :func:`functopk.rmsprop` passes that form). With
    ``centered`` the running mean ``mu`` of the gradients is kept too and
    ``nu - mu**2`` replaces ``nu`` (Graves, 2013; optax's ``scale_by_stddev``).

    Args:
        decay: Decay of the running means, in ``[0, 1)``.
        eps: Keeps the denominator away from zero.
        initial_scale: The starting value of ``nu``.
        eps_in_sqrt: Add ``eps`` under the square root (optax) or to it (torch).
        centered: Subtract the squared running mean of the gradients.

    Example:
        >>> import torch, functopk as ft
        >>> tx = ft.scale_by_rms(decay=0.75)
        >>> updates, _ = tx.update({"w": torch.tensor([2.0])}, tx.init({"w": torch.zeros(1)}))
        >>> updates["w"]    # 2 / sqrt(0.25 * 4 + 1e-8)
        tensor([2.])
    """
    decay = check_hyperparam(decay, "decay", minimum=0.0, below=1.0)
    eps = check_hyperparam(eps, "eps", minimum=0.0)
    initial_scale = check_hyperparam(initial_scale, "initial_scale", minimum=0.0)
    check_bool(eps_in_sqrt, "eps_in_sqrt")
    check_bool(centered, "centered")

    def init(params: Leaves) -> ScaleByRmsState:
        return ScaleByRmsState(
            nu=foreach.full_like(params, initial_scale), mu=foreach.zeros_like(params) if centered else None
        )

    def prepare(state: ScaleByRmsState, like: Leaves, params: Leaves | None) -> tuple[Body, dict[str, Any]]:
        check_optional(state.mu, centered, "scale_by_rms", "mu", "centered")
        return body, {}

    def body(w: Writer, g: Leaves, fields: tuple[Any, ...], p: Leaves | None) -> tuple[Leaves, tuple[Any, ...]]:
        nu = ema_sq(w, fields[0], g, decay)
        mu = None if fields[1] is None else w.lerp(fields[1], g, 1.0 - decay)  # present iff centered
        square = nu if mu is None else w.new.addcmul(nu, mu, mu, value=-1.0)
        return foreach.div_into(g, _root_plus_eps(w.new, square, eps, eps_in_sqrt)), (nu, mu)

    formula = Formula(prepare, in_place=is_number(decay), sliced=True)
    return leafwise("scale_by_rms", formula=formula, init=init, state=ScaleByRmsState, tree_fields=("nu", "mu"))


# --------------------------------------------------------------------------- Adagrad


class ScaleByRssState(NamedTuple):
    """State of :func:`scale_by_rss`: the running sum of squared gradients.

    Example:
        >>> import torch, functopk as ft
        >>> ft.scale_by_rss().init({"w": torch.zeros(2)})
        ScaleByRssState(sum_of_squares={'w': tensor([0.1000, 0.1000])})
    """

    sum_of_squares: PyTree


@recorded
def scale_by_rss(
    initial_accumulator_value: Hyper = 0.1, eps: Hyper = 1e-7, *, eps_in_sqrt: bool = True
) -> GradientTransformation:
    """Divide updates by the root of the sum of all squared gradients so far (Adagrad, Duchi et al., 2011).

    ``s = s + g**2`` and the update is ``g / sqrt(s + eps)`` where ``s > 0`` and 0
    where ``s == 0``: optax's ``scale_by_rss``, defaults included.
    ``eps_in_sqrt=False`` gives ``torch.optim.Adagrad``'s form instead,
    ``g / (sqrt(s) + eps)`` (:func:`functopk.adagrad` passes it, with torch's
    defaults ``initial_accumulator_value=0``, ``eps=1e-10``).

    Args:
        initial_accumulator_value: The starting value of the sum, ``>= 0``.
        eps: Keeps the denominator away from zero, ``>= 0``.
        eps_in_sqrt: Add ``eps`` under the square root (optax) or to it (torch).

    Example:
        >>> import torch, functopk as ft
        >>> tx = ft.scale_by_rss(initial_accumulator_value=0.0, eps=0.0)
        >>> state = tx.init({"w": torch.zeros(2)})
        >>> for g in (3.0, 4.0):
        ...     updates, state = tx.update({"w": torch.tensor([g, 0.0])}, state)
        >>> updates["w"]    # 4 / sqrt(9 + 16), and 0 where the sum is 0
        tensor([0.8000, 0.0000])
    """
    initial_accumulator_value = check_hyperparam(
        initial_accumulator_value, "initial_accumulator_value", minimum=0.0
    )
    eps = check_hyperparam(eps, "eps", minimum=0.0)
    check_bool(eps_in_sqrt, "eps_in_sqrt")

    def init(params: Leaves) -> ScaleByRssState:
        return ScaleByRssState(sum_of_squares=foreach.full_like(params, initial_accumulator_value))

    def prepare(state: ScaleByRssState, like: Leaves, params: Leaves | None) -> tuple[Body, dict[str, Any]]:
        return body, {}

    def body(w: Writer, g: Leaves, fields: tuple[Any, ...], p: Leaves | None) -> tuple[Leaves, tuple[Any, ...]]:
        total = w.addcmul(fields[0], g, g)
        out = foreach.div_into(g, _root_plus_eps(w.new, total, eps, eps_in_sqrt))
        if eps_in_sqrt:  # 0 where nothing was accumulated (0 / sqrt(0) would be NaN for eps == 0)
            out = foreach.where_positive(total, out)
        return out, (total,)

    fields = ("sum_of_squares",)
    formula = Formula(prepare, sliced=not eps_in_sqrt)  # (optax's form: a where per leaf, not from scratch)
    return leafwise("scale_by_rss", formula=formula, init=init, state=ScaleByRssState, tree_fields=fields)
