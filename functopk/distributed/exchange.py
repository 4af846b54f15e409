"""The sparse exchange: wire format, ``sparse_allreduce``, and the pieces the transform and the hook share."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from functopk._checks import check_bool, check_int, describe
from functopk.sparse.api import topk_indices, topk_mask

__all__ = ["sparse_allreduce"]

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
        assert group is not None  # initialised above
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


def _gather_or_fail(out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup, what: str) -> None:
    """A blocking all-gather whose failure raises :func:`_comm_error` naming ``what``."""
    try:
        _all_gather(out, inp, group, False)
    except RuntimeError as exc:
        raise _comm_error(what, group, exc) from exc


def _pack(indices: torch.Tensor, values: torch.Tensor, capacity: int, numel: int) -> torch.Tensor:
    """One rank's pairs as ``uint8``: ``capacity`` indices, then ``capacity`` values (padding: index ``numel``)."""
    index_dtype = _index_dtype(numel)
    count = indices.numel()
    idx = indices.to(index_dtype).contiguous()  # to() returns int32 indices as they are, strided or not
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
    """Ascending int64 indices and values of the ``k`` entries of largest ``|flat|``.

    The library's exact selection (:func:`functopk.topk_indices`): NaN ranks as
    infinite, ties go to the lower index, values are the input's bits.
    """
    sel = topk_indices(flat.detach(), k)
    return sel.indices, sel.values


def _reselect(total: torch.Tensor, idx: torch.Tensor, vals: torch.Tensor, residual: torch.Tensor, k: int):
    """gTop-k: keep the global top ``k`` of ``total`` (the sum or the mean over ranks); this rank's
    dropped values go back to ``residual``.

    ``total`` and ``residual`` are owned by the caller and changed in place.
    """
    keep = topk_mask(total, k)  # library tie rule: identical bits on every rank give an identical set
    total.masked_fill_(~keep, 0)
    # Put back the values the global selection dropped. Added, not written: residual is zero where a value
    # was sent, but an index may also name a held-back coordinate (its value 0, its residual kept).
    residual.index_add_(0, idx, torch.where(keep[idx], torch.zeros_like(vals), vals))
    return total, residual


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
        raise TypeError(f"indices must be a 1-d integer tensor, got {describe(indices)}")
    if not isinstance(values, torch.Tensor) or values.dim() != 1 or not values.is_floating_point():
        raise TypeError(f"values must be a 1-d floating-point tensor, got {describe(values)}")
    if indices.shape != values.shape:
        raise ValueError(f"indices and values must have the same length, got {indices.numel()} and {values.numel()}")
    if indices.device != values.device:
        raise ValueError(f"indices and values must be on one device, got {indices.device} and {values.device}")
    numel = check_int(numel, "numel", minimum=1)
    check_bool(average, "average")
    if capacity is not None:
        capacity = check_int(capacity, "capacity")
        if capacity < indices.numel():
            raise ValueError(f"capacity={capacity} is smaller than this rank's {indices.numel()} pairs")
    _check_group_arg(group, "group")
    group, _, world = _resolve_group(group, "sparse_allreduce")
    if indices.numel():
        torch._assert_async(
            (indices >= 0).all() & (indices < numel).all(), f"sparse_allreduce: indices must lie in [0, {numel})"
        )
    device = values.device
    if capacity is None:
        counts = torch.empty(world, dtype=torch.int64, device=device)
        _gather_or_fail(counts, torch.full((1,), indices.numel(), dtype=torch.int64, device=device), group,
                        "the count exchange of sparse_allreduce")  # fmt: skip
        capacity = int(counts.max())  # host sync: the buffer sizes depend on it
    packed = _pack(indices, values, capacity, numel)  # local work stays outside the collective's error report
    gathered = torch.empty(world * packed.numel(), dtype=torch.uint8, device=device)
    _gather_or_fail(gathered, packed, group, "the sparse all-gather")
    out = torch.zeros(numel + 1, dtype=values.dtype, device=device)  # the last slot takes the padding
    _scatter_add_(out, _unpack(gathered, world, capacity, numel, values.dtype), 1.0 / world if average else 1.0)
    return out[:numel]


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


def _send(
    acc: torch.Tensor,
    k: int,
    group: dist.ProcessGroup,
    world: int,
    what: str,
    *,
    async_op: bool,
    select: Any = None,
) -> tuple[torch.Tensor, torch.Tensor, Any, torch.Tensor]:
    """Send the top ``k`` of ``acc`` (grads + residual): ``(idx, vals, work, gathered)``.

    ``acc`` is changed in place into the new residual (the sent entries
    zeroed). ``select(acc, k) -> (idx, vals)`` replaces :func:`_local_topk`
    (it must select the same coordinates). A collective that fails at once
    raises :func:`_comm_error` naming ``what``.
    """
    idx, vals = (select or _local_topk)(acc, k)
    acc.index_fill_(0, idx, 0)  # what was not sent
    try:
        work, gathered = _exchange(idx, vals, acc.numel(), group, world, async_op)
    except RuntimeError as exc:
        raise _comm_error(what, group, exc) from exc
    return idx, vals, work, gathered


def _nonfinite(gathered: torch.Tensor, world: int, k: int, numel: int, value_dtype: torch.dtype) -> torch.Tensor:
    """A 0-d bool on device: is any value of the gathered pairs NaN or Inf (no host sync)?

    Top-k ranks NaN and Inf as infinite magnitudes, so a rank whose ``grads +
    residual`` holds one sends it: this one ``O(P k)`` test covers this rank's
    own gradients and every value received. (The mean of finite values cannot
    overflow: it is at most their largest magnitude.)
    """
    ibytes = k * _itemsize(_index_dtype(numel))
    values = gathered.view(world, -1)[:, ibytes:].contiguous().view(value_dtype)
    return ~torch.isfinite(values).all()


def _receive(
    out: torch.Tensor,
    gathered: torch.Tensor,
    sent: tuple[torch.Tensor, torch.Tensor],
    residual: torch.Tensor,
    world: int,
    reselect: bool,
) -> torch.Tensor:
    """Add the mean of every rank's pairs into the zeroed ``out``; with ``reselect``, gTop-k (see :func:`_reselect`)."""
    idx, vals = sent
    k = idx.numel()
    _scatter_add_(out, _unpack(gathered, world, k, out.numel(), out.dtype), 1.0 / world)
    if reselect:
        _reselect(out, idx, vals, residual, k)
    return out

