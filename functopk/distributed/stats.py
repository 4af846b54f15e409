"""``HookStats``: what :func:`functopk.distributed.topk_hook` hands to the collectives, counted per rank."""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["HookStats"]


class HookStats(NamedTuple):
    """Communication counts of :func:`topk_hook`, for one rank.

    Attributes:
        bytes_sent: Bytes this rank handed to collectives: ``k * (index + value
            bytes)`` per compressed bucket (``exchange="tree"``: what it sends over
            the tree's rounds, :func:`functopk.distributed.tree.tree_wire_bytes`,
            ``log2(P)`` times that for power-of-two ``P``), ``n * value bytes``
            per dense one.
        bytes_gathered: Bytes of the collectives' results on this rank: ``P``
            times ``k`` pairs for compressed buckets (``exchange="tree"``: the
            bytes it receives over the rounds), ``n * value bytes`` for dense.
        bytes_dense: What plain allreduce would have handed over: ``n * value bytes`` per bucket.
        coords_sent: Coordinates sent (``k`` per compressed bucket, ``n`` per dense one).
        coords: All coordinates of the buckets.

    Adding two ``HookStats`` adds them field by field.

    Example:
        >>> from functopk.distributed import HookStats
        >>> step = HookStats(bytes_sent=8, coords_sent=1, coords=100)
        >>> step + step
        HookStats(bytes_sent=16, bytes_gathered=0, bytes_dense=0, coords_sent=2, coords=200)
    """

    bytes_sent: int = 0
    bytes_gathered: int = 0
    bytes_dense: int = 0
    coords_sent: int = 0
    coords: int = 0

    def __add__(self, other: HookStats) -> HookStats:  # type: ignore[override]
        return HookStats(*(a + b for a, b in zip(self, other)))
