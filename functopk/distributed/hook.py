"""``topk_hook``: a DDP communication hook with top-k sparse exchange and per-bucket error feedback."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from functopk._checks import check_bool, check_density, check_int
from functopk.distributed.exchange import _check_group_arg, _comm_error, _receive, _resolve_group, _send, _wire_bytes
from functopk.sparse.api import k_from_density

__all__ = ["HookStats", "TopKHookState", "topk_hook"]


class HookStats(NamedTuple):
    """Communication counts of :func:`topk_hook`, for one rank.

    Attributes:
        bytes_sent: Bytes this rank handed to collectives: ``k * (index + value
            bytes)`` per compressed bucket, ``n * value bytes`` per dense one.
        bytes_gathered: Bytes of the collectives' results on this rank: ``P``
            times the above for compressed buckets, ``n * value bytes`` for dense.
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


class TopKHookState:
    """State of :func:`topk_hook`: configuration, per-bucket residuals, statistics.

    Args:
        process_group: The group to reduce over (default: the world).
        density: Fraction of each bucket's coordinates sent per step, in ``(0, 1]``;
            ``k = functopk.sparse.k_from_density(density, bucket size)``. A bucket for
            which ``k`` pairs would be no smaller than the dense bucket is
            allreduced densely.
        warmup_iters: Iterations of plain (dense, averaged) allreduce before
            compressing. DDP rebuilds its buckets after the first iteration, so
            compressing from iteration 0 would build residuals for buckets that
            then disappear (they are dropped, losing that memory); at least 1
            avoids it. Dense warm-up also helps accuracy early in training.
        reselect: gTop-k re-selection of each bucket's summed top ``k`` (see
            :func:`distributed_topk`).

    Attributes:
        iter: Iterations seen (counted when the last bucket of an iteration passes).
        residuals: Error-feedback memory per bucket, keyed by the bucket's
            parameters (their identities, in order) and size, so a rebuilt or
            reordered bucket never picks up another bucket's memory. Entries
            of buckets not seen in an iteration are dropped at its end.
        last_step: :class:`HookStats` of the last finished iteration.
        total: :class:`HookStats` summed over all iterations.

    Example:
        >>> from functopk.distributed import TopKHookState
        >>> TopKHookState(density=0.01, warmup_iters=5)
        TopKHookState(density=0.01, warmup_iters=5, reselect=False, iter=0)
    """

    def __init__(
        self,
        process_group: dist.ProcessGroup | None = None,
        *,
        density: float = 0.01,
        warmup_iters: int = 10,
        reselect: bool = False,
    ) -> None:
        _check_group_arg(process_group, "process_group")
        self.process_group: dist.ProcessGroup | None = process_group
        self.density: float = float(check_density(density, allow_tensor=False))
        self.warmup_iters: int = check_int(warmup_iters, "warmup_iters", minimum=0)
        self.reselect: bool = check_bool(reselect, "reselect")
        self.iter: int = 0
        self.residuals: dict[tuple[Any, ...], torch.Tensor] = {}
        self.last_step: HookStats = HookStats()
        self.total: HookStats = HookStats()
        self._step: HookStats = HookStats()
        self._seen: set[tuple[Any, ...]] = set()

    def __repr__(self) -> str:
        return (f"TopKHookState(density={self.density}, warmup_iters={self.warmup_iters}, "
                f"reselect={self.reselect}, iter={self.iter})")  # fmt: skip

    def _record(self, bucket: Any, stats: HookStats, key: tuple[Any, ...] | None) -> None:
        self._step = self._step + stats
        if key is not None:
            self._seen.add(key)
        if bucket.is_last():
            self.last_step, self.total = self._step, self.total + self._step
            self._step = HookStats()
            if self.iter >= self.warmup_iters:
                for stale in set(self.residuals) - self._seen:
                    del self.residuals[stale]
            self._seen = set()
            self.iter += 1


def topk_hook(state: TopKHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: average gradients with top-k sparse exchange and error feedback.

    Register with ``ddp_model.register_comm_hook(TopKHookState(...), topk_hook)``.
    For each bucket (DDP's flat gradient buffer, about 25 MB by default), after
    ``state.warmup_iters`` dense iterations: add the bucket's residual, send its
    ``k`` largest-magnitude entries (selection is per bucket, not over the whole
    model), keep the rest as the residual, and complete the returned future
    with the mean over ranks written into the bucket buffer. All ranks get
    bit-identical buckets.

    The collective is started asynchronously, so DDP overlaps it with the rest
    of the backward pass as for plain allreduce. If it fails (a peer died or
    timed out), the future fails with a ``RuntimeError`` that says so, and
    DDP raises it from ``backward()``.

    Args:
        state: The hook's :class:`TopKHookState`.
        bucket: The gradient bucket DDP passes in.

    Returns:
        A future of the averaged dense bucket (the bucket buffer itself).

    Example:
        >>> import torch, torch.distributed as dist
        >>> from torch.nn.parallel import DistributedDataParallel as DDP
        >>> from functopk.distributed import TopKHookState, topk_hook
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # torchrun does this
        >>> model = DDP(torch.nn.Linear(100, 1))
        >>> state = TopKHookState(density=0.1, warmup_iters=1)
        >>> model.register_comm_hook(state, topk_hook)
        >>> for _ in range(3):
        ...     model(torch.randn(4, 100)).sum().backward()
        >>> state.last_step.coords_sent, state.last_step.coords, state.last_step.bytes_sent
        (10, 101, 80)
        >>> del model  # DDP holds the process group: release it first
        >>> dist.destroy_process_group()
    """
    group, _, world = _resolve_group(state.process_group, "topk_hook")
    buf = bucket.buffer()
    n, vbytes = buf.numel(), buf.element_size()
    k = k_from_density(state.density, n)
    assert isinstance(k, int)  # a Python density gives a Python count
    sent = _wire_bytes(k, n, buf.dtype)
    if state.iter < state.warmup_iters or sent >= n * vbytes:
        state._record(bucket, HookStats(n * vbytes, n * vbytes, n * vbytes, n, n), None)
        buf.div_(world)  # divide first, as DDP's default hook does
        work = dist.all_reduce(buf, group=group, async_op=True)
        return work.get_future().then(_finisher(group, "the dense allreduce of topk_hook", lambda: buf))

    key = (tuple(id(p) for p in bucket.parameters()), n, buf.dtype, buf.device)
    residual = state.residuals.get(key)
    if residual is None:
        residual = state.residuals[key] = torch.zeros_like(buf)
    residual.add_(buf)  # the residual buffer now holds acc = grads + residual, and after _send the new residual
    state._record(bucket, HookStats(sent, sent * world, n * vbytes, k, n), key)
    idx, vals, work, gathered = _send(residual, k, group, world, "the sparse all-gather of topk_hook", async_op=True)

    def finish() -> torch.Tensor:
        return _receive(buf.zero_(), gathered, (idx, vals), residual, world, state.reselect)

    return work.get_future().then(_finisher(group, "the sparse all-gather of topk_hook", finish))


# DDP's register_comm_hook compares the annotations with the real objects, and this
# module's annotations are strings (``from __future__ import annotations``).
topk_hook.__annotations__.update({"bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor]})


def _finisher(
    group: dist.ProcessGroup, what: str, fn: Callable[[], torch.Tensor]
) -> Callable[[torch.futures.Future[Any]], torch.Tensor]:
    """A ``Future.then`` callback: re-raise a failed collective clearly, else return ``fn()``."""

    def callback(fut: torch.futures.Future[Any]) -> torch.Tensor:
        try:
            fut.wait()
        except Exception as exc:  # the backend's error type varies (RuntimeError, DistBackendError, ...)
            raise _comm_error(what, group, exc) from exc
        return fn()

    return callback
