"""Per-leaf top-k: :func:`layerwise_topk`, the selection of Deep Gradient Compression's reference code.

Lin et al. 2018's reference implementation sparsifies every tensor separately
and leaves 1-d parameters dense; :func:`functopk.topk` selects across the
whole model instead.
"""

from __future__ import annotations

from typing import Any, cast

import torch

from functopk._checks import check_int, check_k_or_density
from functopk.base import EmptyState, GradientTransformation, recorded
from functopk.build import leafwise
from functopk.sparse import dispatch
from functopk.sparse.api import topk_sparsify
from functopk.sparse.k import k_from_density

__all__ = ["check_method", "layerwise_topk"]


def check_method(method: Any) -> str:
    """A top-k selection method for :func:`functopk.topk_sparsify`: ``None`` is its default, ``"exact"``.

    An unknown name is a ``ValueError`` now rather than at the first update.

    Example:
        >>> from functopk.compress.layerwise import check_method
        >>> check_method(None), check_method("torch")
        ('exact', 'torch')
    """
    if method is None:
        return "exact"
    return dispatch.check_method(method)  # check_choice: TypeError for a non-str


@recorded
def layerwise_topk(
    k: int | None = None, *, density: float | None = None, min_size: int = 4096, method: str | None = None
) -> GradientTransformation:
    """Per-leaf top-k: keep the ``k`` largest ``|x|`` of *each* leaf (or a fraction of each).

    This is the selection of Deep Gradient Compression's reference
    implementation (Lin et al. 2018), which sparsifies every tensor separately,
    as opposed to :func:`functopk.topk`'s global selection across the whole
    model. Within a leaf the rules of global top-k hold (ties: lower index first;
    NaN ranks as an infinite magnitude; exactly ``k`` kept; kept values are the
    input's bits), since each leaf goes through :func:`functopk.topk_sparsify`.

    Leaves with fewer than ``min_size`` coordinates are passed through dense.
    The default, 4096, keeps every bias and normalisation weight of torchvision's
    ResNets (at most 2048 elements) and the fc bias dense, as the reference does
    for all 1-d parameters; at a density of 0.1% such a leaf would send 1 to 4
    coordinates, too few to be useful. Use ``min_size=0`` to sparsify every leaf.

    With ``k``, a leaf of at most ``k`` coordinates is kept whole. With
    ``density``, leaf ``i`` keeps ``k_from_density(density, numel_i)``.
    ``density`` must be a number: per-leaf ``k`` sets the shapes of per-leaf
    selections, so a scheduled density needs the global :func:`functopk.topk`.

    Args:
        k: Coordinates kept per leaf.
        density: Fraction of each leaf kept, in ``(0, 1]``.
        min_size: Leaves with fewer coordinates than this stay dense (``>= 0``).
        method: Passed to :func:`functopk.topk_sparsify` (e.g. ``"torch"`` for
            the compile-friendly selection); ``None`` uses its default.

    Example:
        >>> import torch, functopk as ft
        >>> tx = ft.layerwise_topk(1, min_size=3)
        >>> grads = {"w": torch.tensor([1.0, -5.0, 2.0]), "v": torch.tensor([4.0, 3.0, 0.5]),
        ...          "bias": torch.tensor([0.1, 0.2])}
        >>> tx.update(grads, tx.init(None))[0]
        {'w': tensor([ 0., -5.,  0.]), 'v': tensor([4., 0., 0.]), 'bias': tensor([0.1000, 0.2000])}
    """
    if callable(density):
        raise TypeError(
            "layerwise_topk needs a numeric density (per-leaf k sets shapes); a scheduled density needs the "
            "global functopk.topk"
        )
    k, density = check_k_or_density(k, density, allow_tensor=False)
    min_size = check_int(min_size, "min_size", minimum=0)
    method = check_method(method)

    def leaf_k(numel: int) -> int:
        return min(k, numel) if k is not None else cast(int, k_from_density(density, numel))

    def update(
        grads: list[torch.Tensor], state: EmptyState, params: list[torch.Tensor] | None
    ) -> tuple[list[torch.Tensor], EmptyState]:
        out = [x if x.numel() == 0 or x.numel() < min_size else topk_sparsify(x, leaf_k(x.numel()), method=method)
               for x in grads]
        return out, state

    return leafwise("layerwise_topk", update, init=lambda params: EmptyState())
