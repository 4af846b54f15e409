"""One bucket's exchange in ``topk_hook``, once the hook has done its bookkeeping.

:func:`topk_hook` decides what a bucket gets (dense or compressed), counts it
and hands one of these functions the rest, to run on the backward thread or,
with ``TopKHookState(overlap=True)``, on the state's worker thread
(:mod:`functopk.distributed.offload`). Each returns a future of the bucket
buffer holding the mean over ranks, and appends the bucket's non-finite flag
to the :class:`~functopk.distributed.residuals.ResidualStore` once its
exchange has finished.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from functopk.distributed.config import HookConfig
from functopk.distributed.hook_tree import tree_bucket
from functopk.distributed.memory import BucketMemory, mask_velocity, used_mask
from functopk.distributed.residuals import ResidualStore
from functopk.distributed.threshold import threshold_select
from functopk.distributed.wire import comm_error, nonfinite, receive, send

__all__: list[str] = []


def dense_bucket(
    store: ResidualStore, mem: BucketMemory | None, buf: torch.Tensor, check: bool, group: dist.ProcessGroup,
    world: int,
) -> torch.futures.Future[torch.Tensor]:
    """Allreduce the bucket (with momentum correction: the velocity); then record whether it is finite."""
    if mem is not None:  # send the velocity: plain momentum SGD
        buf.copy_(store.velocity(mem, buf, store.rescale()))
    buf.div_(world)  # divide first, as DDP's default hook does
    work = dist.all_reduce(buf, group=group, async_op=True)

    def dense_done() -> torch.Tensor:
        if check:
            store.add_flag(~torch.isfinite(buf).all())
        return buf

    return work.get_future().then(_finisher(group, "the dense allreduce of topk_hook", dense_done))


def sparse_bucket(
    store: ResidualStore,
    config: HookConfig,
    hold_unused: bool,
    mem: BucketMemory,
    buf: torch.Tensor,
    k: int,
    comm: tuple[dist.ProcessGroup, int, int],
) -> torch.futures.Future[torch.Tensor]:
    """Add the residual, select ``k``, exchange (all-gather or tree) and average into ``buf``.

    ``hold_unused``: hold back the residual of parameters whose local gradient
    is all zero (DDP's ``find_unused_parameters``).
    """
    group, rank, world = comm
    n = buf.numel()
    # Step I: error feedback. What was not sent before is added back (with momentum correction, through the
    # velocity); `acc` becomes this iteration's candidate residual once the selected part is sent.
    acc = store.accumulate(mem, buf)
    keep = used_mask(mem, buf) if hold_unused else None
    select = None if config.selection == "exact" else partial(_threshold_select, store, mem)
    if config.exchange == "tree":  # Steps II and III through gTop-k's tree instead (hook_tree.py)
        return tree_bucket(buf, acc, keep, k, select, comm, store.add_flag, mem.vscratch)
    what = "the sparse all-gather of topk_hook"
    # Step II: select this rank's k largest |acc|, zero them in acc (the residual is what was not sent) and
    # start the all-gather of (index, value) pairs. With unused parameters, select among parameters with a
    # non-zero gradient only; the others keep their residual.
    eligible = acc if keep is None else torch.where(keep, acc, 0)
    idx, vals, work, gathered = send(eligible, k, group, world, what, async_op=True, select=select)
    if keep is not None:
        torch.where(keep, eligible, acc, out=acc)

    def finish() -> torch.Tensor:
        # Step III, when the gather is done: a non-finite value on any rank marks the iteration (it is then
        # skipped everywhere); the gathered pairs, averaged, become the bucket's gradient (with reselect, only
        # the global top k of that mean, and this rank's values it dropped go back to the residual).
        store.add_flag(nonfinite(gathered, world, k, n, buf.dtype))
        out = receive(buf.zero_(), gathered, (idx, vals), acc, world, config.reselect)
        if mem.vscratch is not None:  # momentum factor masking: no velocity where the residual was spent
            mask_velocity(mem.vscratch, idx, acc if config.reselect else None, keep)
        return out

    return work.get_future().then(_finisher(group, what, finish))


def _threshold_select(store: ResidualStore, mem: BucketMemory, flat: torch.Tensor, k: int):
    """``selection="threshold"``: the exact top ``k`` through the bucket's previous threshold."""
    idx, vals, mem.threshold, fell_back = threshold_select(flat, k, mem.threshold)
    store.threshold_fallbacks += fell_back
    return idx, vals


def _finisher(
    group: dist.ProcessGroup, what: str, fn: Callable[[], torch.Tensor]
) -> Callable[[torch.futures.Future[Any]], torch.Tensor]:
    """A ``Future.then`` callback: re-raise a failed collective clearly, else return ``fn()``."""

    def callback(fut: torch.futures.Future[Any]) -> torch.Tensor:
        try:
            fut.wait()
        except Exception as exc:  # the backend's error type varies (RuntimeError, DistBackendError, ...)
            raise comm_error(what, group, exc) from exc
        return fn()

    return callback
