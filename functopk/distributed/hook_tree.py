"""``topk_hook``'s ``exchange="tree"`` path: one bucket's pairs through gTop-k's tree, run synchronously.

The rounds are those of ``distributed_topk(exchange="tree")``
(:func:`functopk.distributed.tree.tree_reduce_`, one implementation for
both). They run inside the hook call and the hook returns a future that is
already complete, so the exchange does not overlap with the rest of the
backward pass. Why not chain the rounds asynchronously: each round's send
depends on the previous round's merge, so the next round would have to be
issued from a future callback, on a backend thread, while the backward thread
issues the next bucket's rounds to the same peers. Point-to-point messages
between two ranks are matched by order (and tag, which NCCL ignores), so the
two buckets' messages could cross and each rank would merge another bucket's
pairs. Running the rounds on the caller's thread keeps every rank's messages
in one order, the order in which DDP calls the hook (the same on all ranks).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from functopk.distributed.futures import failed
from functopk.distributed.memory import mask_velocity
from functopk.distributed.tree import tree_reduce_
from functopk.distributed.wire import local_topk

__all__: list[str] = []

Select = Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]


def tree_bucket(
    buf: torch.Tensor,
    acc: torch.Tensor,
    keep: torch.Tensor | None,
    k: int,
    select: Select | None,
    comm: tuple[dist.ProcessGroup, int, int],
    flag: Callable[[torch.Tensor], None],
    velocity: torch.Tensor | None = None,
) -> torch.futures.Future[torch.Tensor]:
    """Exchange one bucket over the tree: a completed future of ``buf`` holding the mean over ranks.

    Args:
        buf: The bucket buffer; overwritten with the tree's result divided by ``P``.
        acc: ``grads + residual`` (this rank's candidate residual), changed in
            place: the sent entries zeroed, the sent values a merge dropped put back.
        keep: With unused parameters held back, the coordinates that may be
            sent (the others keep their ``acc`` value); ``None`` for all.
        k: Pairs each rank sends.
        select: ``select(flat, k) -> (idx, vals)``, the exact top ``k``
            (``None``: :func:`functopk.distributed.wire.local_topk`).
        comm: ``(group, rank, world)``.
        flag: Takes this bucket's non-finite flag (a 0-d bool, the same on
            every rank) once the rounds finish.
        velocity: With momentum correction, the candidate velocity: cleared
            where this rank's residual was spent (sent and not put back).

    Returns:
        A completed future of ``buf``, or one failed with a ``RuntimeError``
        naming functopk and the likely cause (a peer died or timed out) if a
        send or receive failed, which DDP raises from ``backward()``; then no
        flag is given, so the iteration's residuals are kept.
    """
    group, rank, world = comm
    eligible = acc if keep is None else torch.where(keep, acc, 0)
    idx, vals = (select or local_topk)(eligible, k)
    eligible.index_fill_(0, idx, 0)
    try:
        bad = tree_reduce_(eligible, (idx, vals), buf.zero_(), group, rank, world, "the tree exchange of topk_hook")
    except RuntimeError as exc:
        return failed(exc)  # DDP raises it from backward() (see functopk.distributed.futures)
    if keep is not None:  # the put-back went into eligible: held-back coordinates keep their acc value
        torch.where(keep, eligible, acc, out=acc)
    if velocity is not None:
        mask_velocity(velocity, idx, acc, keep)
    flag(bad)
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(buf)
    return fut
