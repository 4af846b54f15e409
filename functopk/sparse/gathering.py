"""The coordinate set a stream gathers its gradients at between selections: :class:`GatherPlan`.

After :meth:`functopk.sparse.StreamingTopK.gather`, a step needs each
gradient at a fixed set of flat indices only. A plan holds those indices, split
by leaf (one host read, when it is made), and, for each leaf that a supported
layer uses (:mod:`functopk.sparse.layers`), the layer's *claim*: a coordinate
leaf whose gradient is the weight's gradient at the leaf's indices, computed
without the dense weight gradient. A stream keeps its plan while the indices
stay the same (an optimizer's set between refreshes), so the coordinate leaves
and the kernels' plans are made once per set.
"""

from __future__ import annotations

from typing import Any

import torch

from functopk._checks import describe
from functopk.sparse.hooks import OnGradient, hook_weakly
from functopk.sparse.layers import Claim
from functopk.sparse.updates import check_ascending_indices
from functopk.tree.layout import FlatLayout

__all__ = ["GatherPlan", "checked_indices", "stale"]


def checked_indices(
    indices: Any, device: torch.device, numel: int, known: torch.Tensor | None = None
) -> torch.Tensor:
    """``indices`` as int64 flat indices into ``numel`` coordinates on ``device``; ``TypeError``/``ValueError`` else.

    Indices equal to ``known`` (a set checked before: a stream's current one) are not checked again: ``known`` is
    returned.

    Example:
        >>> import torch
        >>> checked_indices(torch.tensor([0, 3], dtype=torch.int32), torch.device("cpu"), 4)
        tensor([0, 3])
    """
    if not isinstance(indices, torch.Tensor) or indices.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"indices must be an int64 or int32 tensor, got {describe(indices)}")
    if indices.dim() != 1 or indices.device != device:
        raise ValueError(
            f"indices must be 1-d on {device} (the parameters' device), got shape "
            f"{tuple(indices.shape)} on {indices.device}"
        )
    idx = indices.long()
    if known is not None and idx.shape == known.shape and torch.equal(idx, known):
        return known
    check_ascending_indices(idx, numel, "indices")
    return idx


def stale(path: str) -> RuntimeError:
    """The error of a coordinate leaf whose gradient arrives after its set ended.

    Example:
        >>> "Run the forward again" in str(stale("['w']"))
        True
    """
    return RuntimeError(
        f"StreamingTopK: the forward of a layer using {path} ran while the stream gathered at a coordinate set, "
        "and its backward came after that set ended (result(), gather() with other indices, or remove()): its "
        "weight gradient was computed for the old set only. Run the forward again"
    )


class GatherPlan:
    """Flat indices into ``leaves`` split by leaf, with the claims of the supported layers that use them.

    Args:
        indices: Checked int64 ascending flat indices (:func:`checked_indices`).
        leaves: The stream's parameters, in flat order.

    Example:
        >>> import torch
        >>> w, b = torch.zeros(2, 3, requires_grad=True), torch.zeros(2, requires_grad=True)
        >>> plan = GatherPlan(torch.tensor([1, 5, 6]), [w, b])
        >>> plan.bounds
        [(0, 0, 2), (6, 2, 3)]
        >>> plan.gathered(0, torch.arange(6.0))
        tensor([1., 5.])
    """

    def __init__(self, indices: torch.Tensor, leaves: list[torch.Tensor]) -> None:
        self.indices = indices
        self.bounds = FlatLayout.from_tree(leaves).bounds(indices, name="indices")  # (offset, lo, hi) per leaf
        self.claims: dict[int, Claim] = {}  # leaf position -> the claim of the layers that use it

    def gathered(self, i: int, grad: torch.Tensor) -> torch.Tensor:
        """Leaf ``i``'s dense gradient at its indices (``O(k_i)``)."""
        off, lo, hi = self.bounds[i]
        return grad.detach().reshape(-1).index_select(0, self.indices[lo:hi] - off)

    def write(self, values: torch.Tensor, i: int, grad: torch.Tensor, *, claimed: bool, first: bool) -> None:
        """Leaf ``i``'s gradient at its indices into ``values``: a claim's leaf holds exactly them, a dense gradient
        is gathered. The first write sets (a -0.0 stays -0.0), later ones add (a tied or repeated use)."""
        _, lo, hi = self.bounds[i]
        if hi > lo:
            part = (grad.reshape(-1) if claimed else self.gathered(i, grad)).to(values.dtype)
            if first:
                values[lo:hi] = part
            else:
                values[lo:hi] += part

    def claim(self, i: int, weight: torch.Tensor, owner: Any, on_gradient: OnGradient) -> Claim:
        """Leaf ``i``'s claim, made at its first use: a coordinate leaf hooked as ``on_gradient(owner, i, leaf)``.

        A leaf with no index in the set gets an empty coordinate leaf: its layers compute no weight gradient at all.
        """
        if i not in self.claims:
            off, lo, hi = self.bounds[i]
            leaf = torch.zeros(hi - lo, dtype=weight.dtype, device=weight.device, requires_grad=True)
            hook_weakly(owner, on_gradient, leaf, i)  # goes with the leaf; holds the owner weakly
            self.claims[i] = Claim(leaf, self.indices[lo:hi] - off, {})
        return self.claims[i]

    def claim_leaves(self) -> list[tuple[int, torch.Tensor]]:
        """``(leaf position, coordinate leaf)`` for every claim made."""
        return [(i, claim.leaf) for i, claim in self.claims.items()]

    def owns(self, i: int, leaf: torch.Tensor) -> bool:
        """Whether ``leaf`` is this plan's coordinate leaf of leaf ``i``."""
        claim = self.claims.get(i)
        return claim is not None and claim.leaf is leaf
