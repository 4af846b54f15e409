"""Data-parallel training with sparse top-k communication, on ``torch.distributed``.

Three layers, each usable alone (see ``docs/distributed.md``):

* :func:`sparse_allreduce` sums (or averages) every rank's ``(index, value)``
  pairs into one dense vector: one ``all_gather`` of a packed byte buffer, then
  ``index_add_`` into a single output. Memory is ``O(n + P*k)``, never ``P``
  dense copies.
* :func:`distributed_topk` is a :class:`~functopk.GradientTransformation` for
  functional data-parallel training: local error feedback and top-k, the
  exchange, the mean; optionally gTop-k re-selection of the global top ``k``.
* :func:`topk_hook` with :class:`TopKHookState` is a DDP communication hook
  (``ddp.register_comm_hook(state, topk_hook)``) doing the same per DDP bucket.

The transport is ``torch.distributed`` itself (gloo on CPU, NCCL on GPU); every
function here needs an initialised process group when it *runs*, none when it
is imported or built.

**Wire format.** Each rank sends ``capacity`` pairs as one ``uint8`` buffer:
``capacity`` indices, then ``capacity`` values, back to back. Indices are
int32 when ``numel < 2**31 - 1`` and int64 otherwise; values keep their dtype.
So a rank sends ``capacity * (index bytes + value bytes)`` bytes (8 per pair for
fp32 gradients) and every rank receives ``P`` times that. Packing both arrays
into one buffer costs one collective (one latency) instead of two; unpacking is
a byte view of the gathered buffer (a copy only in the rare case where a part is
not aligned for its dtype). A rank with fewer than ``capacity`` pairs pads with
the index ``numel`` (one past the end) and the value 0, so the padding records
the true count on the wire and lands in a scratch slot that is dropped.

**Summation order.** The gathered pairs are added rank by rank (rank 0's first),
one ``index_add_`` per rank; for a mean, each value is scaled by ``1/P`` as it
is added (sparing a pass over the dense result). When each rank's indices are
distinct (always so for top-k), no two additions in one call touch the same
coordinate, so the sum is deterministic on every device, including CUDA, where
``index_add_`` uses atomics; every rank then holds bit-identical results, which
data-parallel replicas need in order not to drift apart.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from functopk.base import GradientTransformation, Params, Updates
from functopk.sparsify import k_from_density, topk_mask
from functopk.tree import FlatLayout

__all__ = [
    "DistributedTopKState",
    "HookStats",
    "TopKHookState",
    "distributed_topk",
    "sparse_allreduce",
    "topk_hook",
]

_INT32_MAX = 2**31 - 1


# --------------------------------------------------------------------------- helpers


def _index_dtype(numel: int) -> torch.dtype:
    """The index dtype on the wire: int32 while ``numel`` (the padding index) fits."""
    return torch.int32 if numel < _INT32_MAX else torch.int64


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _check_group_arg(group: Any, name: str) -> None:
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"{name} must be a torch.distributed.ProcessGroup or None, got {type(group).__name__}")


def _resolve_group(group: dist.ProcessGroup | None, what: str) -> tuple[dist.ProcessGroup, int, int]:
    """``(group, rank in group, group size)``; ``RuntimeError`` if there is no process group."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            f"{what} needs an initialised torch.distributed process group: call "
            "torch.distributed.init_process_group(...) first (torchrun sets up its environment)"
        )
    if group is None:
        group = dist.group.WORLD
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError(f"{what}: this process (global rank {dist.get_rank()}) is not a member of the given group")
    return group, rank, dist.get_world_size(group)


def _comm_error(what: str, group: dist.ProcessGroup, exc: BaseException) -> RuntimeError:
    rank = dist.get_rank(group) if dist.is_initialized() else "?"
    size = dist.get_world_size(group) if dist.is_initialized() else "?"
    return RuntimeError(
        f"functopk.distributed: {what} failed on rank {rank} of {size}; another rank probably died, "
        f"raised before reaching this collective, or timed out (process-group timeout). "
        f"Backend error: {type(exc).__name__}: {exc}"
    )


def _all_gather(out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup, async_op: bool) -> Any:
    """``all_gather`` into one tensor (``all_gather_single`` where torch has it)."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(out, inp, group=group, async_op=async_op)


def _pack(indices: torch.Tensor, values: torch.Tensor, capacity: int, numel: int) -> torch.Tensor:
    """One rank's pairs as ``uint8``: ``capacity`` indices, then ``capacity`` values (padding: index ``numel``)."""
    index_dtype = _index_dtype(numel)
    count = indices.numel()
    idx = indices.to(index_dtype)
    vals = values.contiguous()
    if count < capacity:
        idx = torch.cat([idx, torch.full((capacity - count,), numel, dtype=index_dtype, device=idx.device)])
        vals = torch.cat([vals, vals.new_zeros(capacity - count)])
    return torch.cat([idx.view(torch.uint8), vals.view(torch.uint8)])


def _bytes_as(chunk: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """View a 1-d ``uint8`` chunk as ``dtype`` (copying it first if it is not aligned for ``dtype``)."""
    if chunk.storage_offset() % _itemsize(dtype):
        chunk = chunk.clone()
    return chunk.view(dtype)


def _unpack(gathered: torch.Tensor, world: int, capacity: int, numel: int, value_dtype: torch.dtype):
    """Per-rank ``(indices, values)`` views of a gathered buffer."""
    index_dtype = _index_dtype(numel)
    ibytes = capacity * _itemsize(index_dtype)
    seg = ibytes + capacity * _itemsize(value_dtype)
    return [
        (_bytes_as(gathered[r * seg : r * seg + ibytes], index_dtype),
         _bytes_as(gathered[r * seg + ibytes : (r + 1) * seg], value_dtype))
        for r in range(world)
    ]  # fmt: skip


def _scatter_add_(
    out: torch.Tensor, pairs: list[tuple[torch.Tensor, torch.Tensor]], scale: float = 1.0
) -> torch.Tensor:
    """Add ``scale`` times every rank's pairs into ``out`` in place, rank 0 first (see the module docstring).

    Scaling each value as it is added (``1/P`` for a mean) spares a pass over ``out``.
    """
    for idx, vals in pairs:
        out.index_add_(0, idx, vals, alpha=scale)
    return out


def _local_topk(flat: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Indices (int64) and values of the ``k`` entries of largest ``|flat|`` (NaN ranks as infinite).

    The one place that selects; it will call the library's flat top-k once
    ``functopk.sparsify`` offers one (indices from ``torch.topk`` until then).
    """
    mags = torch.nan_to_num_(flat.detach().abs(), nan=math.inf, posinf=math.inf)
    idx = torch.topk(mags, k, sorted=False).indices
    return idx, flat[idx]


def _reselect(total: torch.Tensor, idx: torch.Tensor, vals: torch.Tensor, residual: torch.Tensor, k: int):
    """gTop-k: keep the global top ``k`` of ``total`` (the sum or the mean over ranks); this rank's
    dropped values go back to ``residual``.

    ``total`` and ``residual`` are owned by the caller and changed in place.
    """
    keep = topk_mask(total, k)  # library tie rule: identical bits on every rank give an identical set
    total.masked_fill_(~keep, 0)
    # residual is zero at idx (those values were sent); put back the ones the global selection dropped.
    residual.index_put_((idx,), torch.where(keep[idx], torch.zeros_like(vals), vals))
    return total, residual


def _check_density(density: Any) -> float:
    if isinstance(density, bool) or not isinstance(density, numbers.Real):
        raise TypeError(f"density must be a float in (0, 1], got {type(density).__name__} {density!r}")
    if not 0.0 < float(density) <= 1.0:
        raise ValueError(f"density must be in (0, 1], got {density}")
    return float(density)


def _check_k_or_density(k: Any, density: Any) -> tuple[int | None, float | None]:
    if (k is None) == (density is None):
        raise ValueError(f"give exactly one of k or density, got k={k!r}, density={density!r}")
    if k is None:
        return None, _check_density(density)
    if isinstance(k, bool) or not isinstance(k, numbers.Integral):
        raise TypeError(f"k must be an int, got {type(k).__name__} {k!r}")
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    return int(k), None


# --------------------------------------------------------------------------- sparse_allreduce


def sparse_allreduce(
    indices: torch.Tensor,
    values: torch.Tensor,
    numel: int,
    group: dist.ProcessGroup | None = None,
    *,
    average: bool = False,
    capacity: int | None = None,
) -> torch.Tensor:
    """Sum every rank's sparse vector ``(indices, values)`` into a dense vector of ``numel``.

    A collective: every rank of ``group`` must call it, with the same ``numel``,
    values dtype, ``average`` and ``capacity``. The pairs travel in one
    ``all_gather`` of a packed buffer (see the module docstring for the wire
    format) and are added with ``index_add_`` into one output buffer: memory
    ``O(numel + P * capacity)``.

    Ranks may hold different numbers of pairs. With ``capacity=None`` the
    counts are exchanged first (a second, tiny collective) and their maximum is
    read back to the host, a sync on GPU, because it sizes the buffers. Passing
    ``capacity`` (any bound ``>=`` every rank's count, the same on all ranks)
    skips both: one collective, no host sync.

    Duplicate indices, within a rank or across ranks, are summed. Indices must
    lie in ``[0, numel)``: this is checked on the calling rank with
    ``torch._assert_async`` (no host sync; an error on CPU, a device-side assert
    on CUDA) *before* the exchange, so the other ranks then fail in the
    collective (peer gone) or at the process-group timeout. NaN and Inf values
    are summed like any other value, so they reach every rank's result.

    Args:
        indices: 1-d integer tensor of flat positions.
        values: 1-d floating-point tensor of the same length and device.
        numel: Length of the dense vector, the same on every rank.
        group: The process group (default: the world).
        average: Divide the sum by the group size (the mean over ranks).
        capacity: Pairs per rank on the wire; ``None`` exchanges the counts first.

    Returns:
        A new 1-d tensor of ``numel`` elements, dtype and device of ``values``:
        the sum (or mean) over ranks. With distinct indices on each rank every
        rank gets bit-identical results. The inputs are not modified.

    Raises:
        TypeError, ValueError: bad arguments (named in the message).
        RuntimeError: no initialised process group, an index out of range, or
            the collective failed (for example because a peer died).

    Example:
        >>> import torch, torch.distributed as dist
        >>> from functopk.distributed import sparse_allreduce
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # torchrun does this
        >>> sparse_allreduce(torch.tensor([3, 0, 3]), torch.tensor([2.0, -1.0, 0.5]), 5)
        tensor([-1.0000,  0.0000,  0.0000,  2.5000,  0.0000])
        >>> dist.destroy_process_group()
    """
    if not isinstance(indices, torch.Tensor) or indices.dim() != 1 or indices.is_floating_point() \
            or indices.is_complex() or indices.dtype == torch.bool:
        raise TypeError(f"indices must be a 1-d integer tensor, got {_describe(indices)}")
    if not isinstance(values, torch.Tensor) or values.dim() != 1 or not values.is_floating_point():
        raise TypeError(f"values must be a 1-d floating-point tensor, got {_describe(values)}")
    if indices.shape != values.shape:
        raise ValueError(f"indices and values must have the same length, got {indices.numel()} and {values.numel()}")
    if indices.device != values.device:
        raise ValueError(f"indices and values must be on one device, got {indices.device} and {values.device}")
    if isinstance(numel, bool) or not isinstance(numel, numbers.Integral) or numel < 1:
        raise ValueError(f"numel must be an int >= 1, got {numel!r}")
    numel = int(numel)
    if not isinstance(average, bool):
        raise TypeError(f"average must be a bool, got {type(average).__name__}")
    if capacity is not None:
        if isinstance(capacity, bool) or not isinstance(capacity, numbers.Integral):
            raise TypeError(f"capacity must be an int or None, got {type(capacity).__name__} {capacity!r}")
        if capacity < indices.numel():
            raise ValueError(f"capacity={capacity} is smaller than this rank's {indices.numel()} pairs")
        capacity = int(capacity)
    _check_group_arg(group, "group")
    group, _, world = _resolve_group(group, "sparse_allreduce")
    if indices.numel():
        torch._assert_async(
            (indices >= 0).all() & (indices < numel).all(), f"sparse_allreduce: indices must lie in [0, {numel})"
        )
    device = values.device
    try:
        if capacity is None:
            counts = torch.empty(world, dtype=torch.int64, device=device)
            _all_gather(counts, torch.full((1,), indices.numel(), dtype=torch.int64, device=device), group, False)
            capacity = int(counts.max())  # host sync: the buffer sizes depend on it
        gathered = torch.empty(world * capacity * (_itemsize(_index_dtype(numel)) + values.element_size()),
                               dtype=torch.uint8, device=device)  # fmt: skip
        _all_gather(gathered, _pack(indices, values, capacity, numel), group, False)
    except RuntimeError as exc:
        raise _comm_error("the sparse all-gather", group, exc) from exc
    out = torch.zeros(numel + 1, dtype=values.dtype, device=device)  # the last slot takes the padding
    _scatter_add_(out, _unpack(gathered, world, capacity, numel, values.dtype), 1.0 / world if average else 1.0)
    return out[:numel]


def _describe(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return f"a tensor of shape {tuple(x.shape)} and dtype {x.dtype}"
    return f"{type(x).__name__} {x!r}"


def _exchange(idx: torch.Tensor, vals: torch.Tensor, numel: int, group: dist.ProcessGroup, world: int,
              async_op: bool):  # fmt: skip
    """Start the fixed-``k`` exchange (every rank sends exactly ``len(idx)`` pairs): ``(work, gathered)``."""
    k = idx.numel()
    gathered = torch.empty(world * k * (_itemsize(_index_dtype(numel)) + vals.element_size()),
                           dtype=torch.uint8, device=vals.device)  # fmt: skip
    work = _all_gather(gathered, _pack(idx, vals, k, numel), group, async_op)
    return work, gathered


def _wire_bytes(k: int, numel: int, value_dtype: torch.dtype) -> int:
    """Bytes one rank sends for ``k`` pairs."""
    return k * (_itemsize(_index_dtype(numel)) + _itemsize(value_dtype))


# --------------------------------------------------------------------------- the transform


class DistributedTopKState(NamedTuple):
    """State of :func:`distributed_topk`.

    Attributes:
        residual: This rank's error-feedback memory: a 1-d tensor over the flat
            layout of the parameters (``functopk.FlatLayout`` order), in their
            promoted dtype, in gradient units (before any learning rate).
        count: Steps taken (int64, 0-d).
        bytes_sent: Bytes this rank put on the wire in the last step (int64, 0-d):
            ``k * (index bytes + value bytes)``.
        bytes_gathered: Bytes every rank received in the last step (int64,
            0-d): ``P`` times ``bytes_sent``.
        update_density: Fraction of coordinates that are non-zero in the last
            averaged update (float32, 0-d): between ``k / n`` (all ranks chose
            the same coordinates) and ``P * k / n``; at most ``k / n`` with
            ``reselect=True``.
    """

    residual: torch.Tensor
    count: torch.Tensor
    bytes_sent: torch.Tensor
    bytes_gathered: torch.Tensor
    update_density: torch.Tensor


def distributed_topk(
    k: int | None = None,
    *,
    density: float | None = None,
    group: dist.ProcessGroup | None = None,
    reselect: bool = False,
) -> GradientTransformation:
    """Data-parallel gradient averaging with sparse top-k communication and error feedback.

    Each rank, each step: ``acc = grads + residual``; send the ``k`` entries of
    largest ``|acc|`` (global over the whole tree, as :func:`functopk.topk`);
    keep the rest as the new residual; sum every rank's pairs
    (:func:`sparse_allreduce`'s exchange) and emit the mean over ranks as a
    dense tree with the structure and dtypes of the gradients. Every rank emits
    bit-identical updates, so replicas stay identical. Put it first in a chain:
    ``chain(distributed_topk(density=0.01), sgd(lr, momentum=0.9))``.

    With ``reselect=True`` the summed vector is cut back to its own top ``k``
    (gTop-k, Shi et al. 2019, "A distributed synchronous SGD algorithm with
    global top-k sparsification for low bandwidth networks"), so the update is
    exactly ``k``-sparse across the group; each rank adds the values it sent at
    the coordinates dropped there back into its residual, so no gradient mass
    is lost. The exchange is still one all-gather (not gTop-k's tree
    reduction): the bytes on the wire are the same either way.

    The residual lives inside this transformation rather than in a wrapping
    ``error_feedback``: what must be subtracted from ``acc`` is what *this rank
    sent* (and, with ``reselect``, what the group dropped), which only the
    exchange knows; the averaged update it emits is not that.

    Runs eagerly: the exchange is a ``torch.distributed`` collective, so a
    ``torch.compile``-d step graph-breaks there. It has no host sync, and the
    state keeps its shapes and dtypes from step to step. NaN/Inf gradients rank
    as infinite magnitudes, are sent, and reach every rank's update.

    Args:
        k: Coordinates each rank sends per step.
        density: Instead of ``k``: the fraction of all coordinates sent per step
            (``k = functopk.k_from_density(density, n)``).
        group: The process group (default: the world), looked up at each update.
        reselect: Keep only the global top ``k`` of the sum (gTop-k).

    Example:
        >>> import torch, torch.distributed as dist, functopk as ft
        >>> from functopk.distributed import distributed_topk
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # torchrun does this
        >>> tx = distributed_topk(k=1)
        >>> state = tx.init({"w": torch.zeros(3)})
        >>> updates, state = tx.update({"w": torch.tensor([1.0, -3.0, 2.0])}, state)
        >>> updates["w"], state.residual, int(state.bytes_sent)
        (tensor([ 0., -3.,  0.]), tensor([1., 0., 2.]), 8)
        >>> dist.destroy_process_group()
    """
    k, density = _check_k_or_density(k, density)
    _check_group_arg(group, "group")
    if not isinstance(reselect, bool):
        raise TypeError(f"reselect must be a bool, got {type(reselect).__name__}")

    def resolve_k(numel: int) -> int:
        if numel < 1:
            raise ValueError("distributed_topk needs at least one coordinate, got an empty tree")
        if k is None:
            return k_from_density(density, numel)
        if k > numel:
            raise ValueError(f"k={k} exceeds the number of coordinates in the tree ({numel})")
        return k

    def layout_of(tree: Params, name: str) -> FlatLayout:
        layout = FlatLayout.from_tree(tree)
        for path, dtype in zip(layout.leaf_paths(), layout.dtypes):
            if not dtype.is_floating_point:
                raise TypeError(f"{name} leaf at {path} has dtype {dtype}; expected floating-point leaves")
        layout.device  # noqa: B018 - raises ValueError for leaves on several devices
        return layout

    def init(params: Params) -> DistributedTopKState:
        layout = layout_of(params, "params")
        resolve_k(layout.numel)
        device = layout.device
        zero = torch.zeros((), dtype=torch.int64, device=device)
        return DistributedTopKState(
            residual=torch.zeros(layout.numel, dtype=layout.common_dtype, device=device),
            count=zero,
            bytes_sent=zero,
            bytes_gathered=zero,
            update_density=torch.zeros((), dtype=torch.float32, device=device),
        )

    def update(
        updates: Updates, state: DistributedTopKState, params: Params | None = None
    ) -> tuple[Updates, DistributedTopKState]:
        del params
        if not isinstance(state, DistributedTopKState):
            raise TypeError(f"state must be a DistributedTopKState, got {type(state).__name__}")
        layout = layout_of(updates, "updates")
        res = state.residual
        if layout.numel != res.numel() or layout.device != res.device:
            raise ValueError(
                f"updates have {layout.numel} coordinates on {layout.device}, but the state's residual has "
                f"{res.numel()} on {res.device}; init the state from parameters shaped like the updates"
            )
        kk = resolve_k(layout.numel)
        grp, _, world = _resolve_group(group, "distributed_topk")

        acc = layout.ravel(updates, dtype=res.dtype).add_(res)  # a fresh buffer: ours to change
        idx, vals = _local_topk(acc, kk)
        residual = acc.index_fill_(0, idx, 0)  # what was not sent
        try:
            _, gathered = _exchange(idx, vals, layout.numel, grp, world, async_op=False)
        except RuntimeError as exc:
            raise _comm_error("the sparse all-gather of distributed_topk", grp, exc) from exc
        mean = _scatter_add_(torch.zeros_like(res), _unpack(gathered, world, kk, layout.numel, res.dtype), 1 / world)
        if reselect:
            mean, residual = _reselect(mean, idx, vals, residual, kk)
        sent = _wire_bytes(kk, layout.numel, res.dtype)
        new_state = DistributedTopKState(
            residual=residual,
            count=state.count + 1,
            bytes_sent=torch.full_like(state.bytes_sent, sent),
            bytes_gathered=torch.full_like(state.bytes_gathered, sent * world),
            update_density=(torch.count_nonzero(mean) / layout.numel).to(torch.float32),
        )
        return layout.unravel(mean), new_state

    return GradientTransformation(init, update)


# --------------------------------------------------------------------------- the DDP hook


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
            ``k = functopk.k_from_density(density, bucket size)``. A bucket for
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
        density = _check_density(density)
        if isinstance(warmup_iters, bool) or not isinstance(warmup_iters, numbers.Integral) or warmup_iters < 0:
            raise ValueError(f"warmup_iters must be an int >= 0, got {warmup_iters!r}")
        if not isinstance(reselect, bool):
            raise TypeError(f"reselect must be a bool, got {type(reselect).__name__}")
        self.process_group = process_group
        self.density = density
        self.warmup_iters = int(warmup_iters)
        self.reselect = reselect
        self.iter = 0
        self.residuals: dict[tuple, torch.Tensor] = {}
        self.last_step = HookStats()
        self.total = HookStats()
        self._step = HookStats()
        self._seen: set[tuple] = set()

    def __repr__(self) -> str:
        return (f"TopKHookState(density={self.density}, warmup_iters={self.warmup_iters}, "
                f"reselect={self.reselect}, iter={self.iter})")  # fmt: skip

    def _record(self, bucket: Any, stats: HookStats, key: tuple | None) -> None:
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
        >>> dist.destroy_process_group()
    """
    group, _, world = _resolve_group(state.process_group, "topk_hook")
    buf = bucket.buffer()
    n, vbytes = buf.numel(), buf.element_size()
    k = k_from_density(state.density, n)
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
    acc = residual.add_(buf)  # the residual buffer now holds acc = grads + residual
    idx, vals = _local_topk(acc, k)
    acc.index_fill_(0, idx, 0)  # ... and now the new residual
    state._record(bucket, HookStats(sent, sent * world, n * vbytes, k, n), key)
    work, gathered = _exchange(idx, vals, n, group, world, async_op=True)

    def finish() -> torch.Tensor:
        _scatter_add_(buf.zero_(), _unpack(gathered, world, k, n, buf.dtype), 1.0 / world)
        if state.reselect:
            _reselect(buf, idx, vals, residual, k)
        return buf

    return work.get_future().then(_finisher(group, "the sparse all-gather of topk_hook", finish))


# DDP's register_comm_hook compares the annotations with the real objects, and this
# module's annotations are strings (``from __future__ import annotations``).
topk_hook.__annotations__.update({"bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor]})


def _finisher(group: dist.ProcessGroup, what: str, fn: Any) -> Any:
    """A ``Future.then`` callback: re-raise a failed collective clearly, else return ``fn()``."""

    def callback(fut: torch.futures.Future) -> torch.Tensor:
        try:
            fut.wait()
        except Exception as exc:  # the backend's error type varies (RuntimeError, DistBackendError, ...)
            raise _comm_error(what, group, exc) from exc
        return fn()

    return callback
