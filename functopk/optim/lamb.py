"""LAMB (You et al., 2020): Adam's direction rescaled per layer by a trust ratio, with optax's semantics.

There is no ``torch.optim`` class for LAMB; :func:`scale_by_trust_ratio` and
:func:`lamb` follow ``optax.scale_by_trust_ratio`` and ``optax.lamb`` (optax
0.2.8): the same argument names, defaults, maths and chain of transformations
(so the state is the tuple of the chained parts' states, as in optax).
"""

from __future__ import annotations

import torch

from functopk._checks import check_hyperparam, check_scalar_or_schedule
from functopk.base import EmptyState, GradientTransformation, ScalarOrSchedule, recorded
from functopk.build import leafwise
from functopk.combine import MaskOrFn, chain
from functopk.optim._shared import Hyper, Leaves
from functopk.optim.adaptive import scale_by_adam
from functopk.optim.elementary import add_decayed_weights, scale_by_learning_rate
from functopk.tree import foreach

__all__ = ["lamb", "scale_by_trust_ratio"]


def _on(value: Hyper, like: torch.Tensor) -> Hyper:
    """A tensor hyperparameter in ``like``'s dtype and on its device; a Python number unchanged."""
    return value.to(dtype=like.dtype, device=like.device) if isinstance(value, torch.Tensor) else value


def _ratios(param_norms: torch.Tensor, update_norms: torch.Tensor, min_norm: Hyper, coef: Hyper, eps: Hyper) -> Leaves:
    """optax's trust ratios from 1-D tensors of norms (one entry a leaf), as a list of 0-d tensors.

    Each norm is raised to ``min_norm`` where it is at most that; the ratio is
    ``coef * param_norm / (update_norm + eps)``, and 1 where either norm is 0.
    All on device: ``torch.where``, no host sync.
    """
    dtype = torch.promote_types(param_norms.dtype, update_norms.dtype)
    pn, un = param_norms.to(dtype), update_norms.to(dtype)
    low = _on(min_norm, pn)
    pn = torch.where(pn <= low, low, pn)
    un = torch.where(un <= low, low, un)
    ratio = _on(coef, pn) * pn / (un + _on(eps, un))
    ratio = torch.where((pn == 0) | (un == 0), torch.ones((), dtype=dtype, device=pn.device), ratio)
    return list(ratio.unbind())


@recorded
def scale_by_trust_ratio(
    min_norm: Hyper = 0.0, trust_coefficient: Hyper = 1.0, eps: Hyper = 0.0
) -> GradientTransformation:
    """Scale each leaf's update by its trust ratio ``|params| / |update|`` (You et al., 2020): LAMB's and LARS's.

    For each leaf, with both L2 norms raised to ``min_norm`` where they are below
    it, the update is multiplied by ``trust_coefficient * |params| / (|update| + eps)``,
    or by 1 where either norm is zero (a parameter at zero, or no update):
    ``optax.scale_by_trust_ratio`` (optax 0.2.8). The norms are accumulated in
    float32 at least (optax: in the leaf's dtype) and the ratios are computed on
    device, all leaves at once per device: no host sync. The parameters are needed.

    Args:
        min_norm: Lower bound of both norms, ``>= 0`` (0: none).
        trust_coefficient: Multiplies the ratio, ``>= 0``.
        eps: Added to the update's norm in the denominator, ``>= 0``.

    Example:
        >>> import torch
        >>> from functopk.optim.lamb import scale_by_trust_ratio
        >>> tx = scale_by_trust_ratio()
        >>> params = {"w": torch.tensor([6.0, 8.0]), "b": torch.zeros(2)}
        >>> updates = {"w": torch.tensor([0.3, 0.4]), "b": torch.tensor([1.0, 2.0])}
        >>> tx.update(updates, tx.init(params), params)[0]    # w: times 10 / 0.5; b: |params| == 0, unchanged
        {'w': tensor([6., 8.]), 'b': tensor([1., 2.])}
    """
    min_norm = check_hyperparam(min_norm, "min_norm", minimum=0.0)
    trust_coefficient = check_hyperparam(trust_coefficient, "trust_coefficient", minimum=0.0)
    eps = check_hyperparam(eps, "eps", minimum=0.0)

    def update(grads: Leaves, state: EmptyState, params: Leaves | None) -> tuple[Leaves, EmptyState]:
        if params is None or not grads:  # params: never None here (needs_params)
            return grads, state
        param_norms, update_norms = foreach.norms(params), foreach.norms(grads)
        groups: dict[torch.device, list[int]] = {}
        for i, g in enumerate(grads):
            groups.setdefault(g.device, []).append(i)
        ratios: dict[int, torch.Tensor] = {}
        for idx in groups.values():  # one stack per device (norms are on their leaf's device)
            stack = _ratios(
                torch.stack([param_norms[i] for i in idx]), torch.stack([update_norms[i] for i in idx]),
                min_norm, trust_coefficient, eps,
            )
            ratios.update(zip(idx, stack))
        return foreach.mul_list(grads, [ratios[i] for i in range(len(grads))]), state

    return leafwise("scale_by_trust_ratio", update, needs_params=True)


@recorded
def lamb(
    learning_rate: ScalarOrSchedule,
    *,
    b1: Hyper = 0.9,
    b2: Hyper = 0.999,
    eps: Hyper = 1e-6,
    eps_root: Hyper = 0.0,
    weight_decay: ScalarOrSchedule = 0.0,
    mask: MaskOrFn | None = None,
) -> GradientTransformation:
    """The LAMB optimizer (You et al., 2020, "Large Batch Optimization for Deep Learning"): ``optax.lamb``.

    ``chain(scale_by_adam(b1, b2, eps, eps_root), add_decayed_weights(weight_decay, mask),
    scale_by_trust_ratio(), scale_by_learning_rate(learning_rate))``, as optax 0.2.8
    chains it: Adam's bias-corrected direction plus the decoupled decay, rescaled per
    leaf (per layer) so that its norm is the parameters' norm, times ``-learning_rate``.
    The state is the tuple of the four parts' states (:class:`functopk.optim.ScaleByAdamState`
    first; a masked decay keeps ``EmptyState``, where optax wraps it in a ``MaskedState``).
    There is no ``torch.optim`` LAMB.

    Args:
        learning_rate: A number, a 0-d tensor or a schedule ``step -> lr``.
        b1: Decay of the first moment, in ``[0, 1)``.
        b2: Decay of the second moment, in ``[0, 1)``.
        eps: Added to the denominator outside the square root.
        eps_root: Added to the second moment inside the square root.
        weight_decay: Decoupled weight decay, added before the trust ratio: a number, a 0-d
            tensor or a schedule ``step -> value``.
        mask: Which parameters to decay: a tree of bools or a function ``params -> tree of
            bools`` (a prefix of the parameter tree, which optax accepts, is not); ``None`` decays all.

    Example:
        >>> import torch
        >>> from functopk.optim.lamb import lamb
        >>> tx = lamb(0.1)
        >>> params = {"w": torch.tensor([3.0, 4.0])}
        >>> updates, state = tx.update({"w": torch.tensor([0.2, -7.0])}, tx.init(params), params)
        >>> updates["w"]    # Adam's first step ~ sign(g) = [1, -1], rescaled to norm |params| = 5: -0.1 * 5 / sqrt(2)
        tensor([-0.3536,  0.3536])
    """
    learning_rate = check_scalar_or_schedule(learning_rate, "learning_rate")
    return chain(
        scale_by_adam(b1, b2, eps, eps_root),
        add_decayed_weights(weight_decay, mask),
        scale_by_trust_ratio(),
        scale_by_learning_rate(learning_rate),
    )
