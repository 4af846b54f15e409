"""Hard-threshold sparsification: :func:`threshold` keeps every coordinate with ``|x| >= v``.

Sahu et al. 2021 ("Rethinking gradient sparsification as total error
minimization") show that, under error feedback, a fixed threshold bounds the
*total* error over training better than a fixed ``k`` does.
"""

from __future__ import annotations

import torch

from functopk._checks import check_hyperparam
from functopk.base import EmptyState, GradientTransformation, recorded
from functopk.build import leafwise

__all__ = ["threshold"]


@recorded
def threshold(v: float | torch.Tensor) -> GradientTransformation:
    """Hard-threshold sparsification: keep the coordinates with ``|x| >= v``, zero the rest.

    Sahu et al. 2021 ("Rethinking gradient sparsification as total error
    minimization") show that, under error feedback, a fixed threshold bounds the
    *total* error over training better than a fixed ``k`` does, and adapts the
    number of coordinates sent to the step. The count sent is therefore data
    dependent, but the output is a dense tree of the input's shape, so the
    transformation itself has static shapes and compiles with ``fullgraph=True``
    (a sparse exchange of the result would have a data-dependent size).

    ``|x|`` is compared with ``v`` converted to the leaf's dtype. ``v = 0`` keeps
    everything. NaN is kept (``|NaN| < v`` is false), like top-k, so it stays
    visible; ``±inf`` is kept. Kept values are the input's bits.

    Args:
        v: The threshold, ``>= 0``: a number or a 0-d float tensor
            (so :func:`functopk.inject_hyperparams` can schedule it).

    Example:
        >>> import torch, functopk as ft
        >>> tx = ft.threshold(1.0)
        >>> tx.update({"w": torch.tensor([0.5, -1.0, 2.0, -0.99])}, tx.init(None))[0]
        {'w': tensor([ 0., -1.,  2.,  0.])}
    """
    v = check_hyperparam(v, "v", minimum=0.0)

    def update(
        grads: list[torch.Tensor], state: EmptyState, params: list[torch.Tensor] | None
    ) -> tuple[list[torch.Tensor], EmptyState]:
        out = []
        for x in grads:
            thr = v.to(device=x.device, dtype=x.dtype) if isinstance(v, torch.Tensor) else v
            out.append(torch.where(x.abs() < thr, 0.0, x))
        return out, state

    return leafwise("threshold", update)
