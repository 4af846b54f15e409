"""Lion (Chen et al., 2023): momentum whose sign is the step, with optax's semantics.

There is no ``torch.optim`` class for Lion; :func:`scale_by_lion` and
:func:`lion` follow ``optax.scale_by_lion`` and ``optax.lion`` (optax 0.2.8):
the same argument names, defaults, maths and chain of transformations (so the
state is the tuple of the chained parts' states, as in optax).

The weight decay (a number, a 0-d tensor or a schedule, as in optax) is
:func:`functopk.add_decayed_weights`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from functopk._checks import check_hyperparam, check_scalar_or_schedule
from functopk.base import GradientTransformation, ScalarOrSchedule, init_count, recorded
from functopk.build import leafwise
from functopk.combine import MaskOrFn, chain
from functopk.optim._shared import Hyper, Leaves
from functopk.optim.elementary import add_decayed_weights, scale_by_learning_rate
from functopk.tree import foreach
from functopk.tree.maths import PyTree

__all__ = [
    "ScaleByLionState",
    "lion",
    "scale_by_lion",
]


class ScaleByLionState(NamedTuple):
    """State of :func:`scale_by_lion` (optax's ``ScaleByLionState``).

    Attributes:
        count: Number of updates done (0-d int64 tensor; optax keeps an int32).
        mu: The momentum, a running mean of the gradients with decay ``b2``, a tree like the parameters.

    Example:
        >>> import torch
        >>> from functopk.optim.lion import scale_by_lion
        >>> scale_by_lion().init({"w": torch.zeros(2)})
        ScaleByLionState(count=tensor(0), mu={'w': tensor([0., 0.])})
    """

    count: torch.Tensor  # type: ignore[assignment]
    mu: PyTree


@recorded
def scale_by_lion(b1: Hyper = 0.9, b2: Hyper = 0.99) -> GradientTransformation:
    """Replace updates by the sign of a momentum interpolation: Lion's direction (Chen et al., 2023).

    The update is ``sign(b1 * mu + (1 - b1) * g)`` and then the momentum becomes
    ``mu = b2 * mu + (1 - b2) * g`` (from zero): ``optax.scale_by_lion`` (optax
    0.2.8) in its default ``mode="hard"``. Not here: optax's ``mu_dtype`` (the
    momentum keeps the parameters' dtype) and its ``"smooth"``/``"refined"`` modes.
    Both mixes are computed with one ``lerp`` each (``mu + w * (g - mu)``), the
    same numbers as optax's products up to rounding. Three foreach kernels a step.

    Args:
        b1: Weight of the momentum in the update's interpolation, in ``[0, 1)``.
        b2: Decay of the momentum, in ``[0, 1)``.

    Example:
        >>> import torch
        >>> from functopk.optim.lion import scale_by_lion
        >>> tx = scale_by_lion()
        >>> state = tx.init({"w": torch.zeros(1)})
        >>> updates, state = tx.update({"w": torch.tensor([10.0])}, state)
        >>> updates["w"], state.mu["w"]     # sign(0.1 * 10); mu = 0.01 * 10
        (tensor([1.]), tensor([0.1000]))
        >>> updates, state = tx.update({"w": torch.tensor([-0.5])}, state)
        >>> updates["w"]                    # sign(0.9 * 0.1 + 0.1 * -0.5): the momentum outweighs the gradient
        tensor([1.])
    """
    b1 = check_hyperparam(b1, "b1", minimum=0.0, below=1.0)
    b2 = check_hyperparam(b2, "b2", minimum=0.0, below=1.0)

    def init(params: Leaves) -> ScaleByLionState:
        return ScaleByLionState(count=init_count(params), mu=foreach.zeros_like(params))

    def update(grads: Leaves, state: ScaleByLionState, params: Leaves | None) -> tuple[Leaves, ScaleByLionState]:
        out = foreach.sign_(foreach.lerp(state.mu, grads, 1.0 - b1))
        mu = foreach.lerp(state.mu, grads, 1.0 - b2)
        return out, ScaleByLionState(count=state.count + 1, mu=mu)

    return leafwise("scale_by_lion", update, init=init, state=ScaleByLionState, tree_fields=("mu",))


@recorded
def lion(
    learning_rate: ScalarOrSchedule,
    *,
    b1: Hyper = 0.9,
    b2: Hyper = 0.99,
    weight_decay: ScalarOrSchedule = 1e-3,
    mask: MaskOrFn | None = None,
) -> GradientTransformation:
    """The Lion optimizer (Chen et al., 2023, "Symbolic Discovery of Optimization Algorithms"): ``optax.lion``.

    ``chain(scale_by_lion(b1, b2), add_decayed_weights(weight_decay, mask),
    scale_by_learning_rate(learning_rate))``, as optax 0.2.8 chains it: the update
    is ``-learning_rate * (sign(b1 * mu + (1 - b1) * g) + weight_decay * params)``,
    so the decay is multiplied by the learning rate (as in torch's AdamW). The state
    is the tuple of the three parts' states (a masked decay keeps ``EmptyState``,
    where optax wraps it in a ``MaskedState``). There is no ``torch.optim`` Lion.
    Lion's steps are larger than Adam's: a learning rate 3-10x smaller and a decay
    3-10x larger than AdamW's are typical. Not here: optax's ``mu_dtype``.

    Args:
        learning_rate: A number, a 0-d tensor or a schedule ``step -> lr``.
        b1: Weight of the momentum in the update's interpolation, in ``[0, 1)``.
        b2: Decay of the momentum, in ``[0, 1)``.
        weight_decay: Decoupled weight decay (times the learning rate): a number, a 0-d
            tensor or a schedule ``step -> value``.
        mask: Which parameters to decay: a tree of bools or a function ``params -> tree of
            bools`` (a prefix of the parameter tree, which optax accepts, is not); ``None`` decays all.

    Example:
        >>> import torch
        >>> from functopk.optim.lion import lion
        >>> tx = lion(0.1, weight_decay=0.5)
        >>> params = {"w": torch.tensor([2.0, -4.0])}
        >>> updates, state = tx.update({"w": torch.tensor([3.0, 0.0])}, tx.init(params), params)
        >>> updates["w"]    # -0.1 * (sign(0.1 * [3, 0]) + 0.5 * [2, -4])
        tensor([-0.2000,  0.2000])
    """
    learning_rate = check_scalar_or_schedule(learning_rate, "learning_rate")
    return chain(
        scale_by_lion(b1, b2),
        add_decayed_weights(weight_decay, mask),
        scale_by_learning_rate(learning_rate),
    )
