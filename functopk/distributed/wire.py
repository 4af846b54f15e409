"""The wire: what the transform, the hook, the tree and the agreement check share to move top-k pairs.

Packing (:func:`pack`, :func:`unpack`; the format is described in
:mod:`functopk.distributed`), the process group and its errors
(:func:`resolve_group`, :func:`comm_error`, :func:`gather_or_fail`), and one
fixed-``k`` exchange in three steps: :func:`send` (select and start the
all-gather), :func:`nonfinite` (the step's verdict) and :func:`receive` (sum
the pairs, optionally re-select). :func:`functopk.distributed.sparse_allreduce`
is built on the same pieces.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from functopk.sparse.api import topk_indices, topk_mask

__all__ = [
    "all_gather", "check_group_arg", "comm_error", "gather_or_fail", "index_dtype", "itemsize", "local_topk",
    "nonfinite", "pack", "receive", "reselect_", "resolve_group", "scatter_add_", "send", "start_exchange",
    "unpack", "wire_bytes",
]  # fmt: skip

_INT32_MAX = 2**31 - 1


# --------------------------------------------------------------------------- helpers


def index_dtype(numel: int) -> torch.dtype:
    """The index dtype on the wire: int32 while ``numel`` (the padding index) fits."""
    return torch.int32 if numel < _INT32_MAX else torch.int64


def itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def check_group_arg(group: Any, name: str) -> None:
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"{name} must be a torch.distributed.ProcessGroup or None, got {type(group).__name__}")


def resolve_group(group: dist.ProcessGroup | None, what: str) -> tuple[dist.ProcessGroup, int, int]:
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


def comm_error(what: str, group: dist.ProcessGroup, exc: BaseException) -> RuntimeError:
    rank = dist.get_rank(group) if dist.is_initialized() else "?"
    size = dist.get_world_size(group) if dist.is_initialized() else "?"
    return RuntimeError(
        f"functopk.distributed: {what} failed on rank {rank} of {size}; another rank probably died, "
        f"raised before reaching this collective, or timed out (process-group timeout). "
        f"Backend error: {type(exc).__name__}: {exc}"
    )


def all_gather(out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup, async_op: bool) -> Any:
    """``all_gather`` into one tensor (``all_gather_single`` where torch has it)."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(out, inp, group=group, async_op=async_op)


def gather_or_fail(out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup, what: str) -> None:
    """A blocking all-gather whose failure raises :func:`comm_error` naming ``what``."""
    try:
        all_gather(out, inp, group, False)
    except RuntimeError as exc:
        raise comm_error(what, group, exc) from exc


def pack(indices: torch.Tensor, values: torch.Tensor, capacity: int, numel: int) -> torch.Tensor:
    """One rank's pairs as ``uint8``: ``capacity`` indices, then ``capacity`` values (padding: index ``numel``)."""
    idx_dtype = index_dtype(numel)
    count = indices.numel()
    idx = indices.to(idx_dtype).contiguous()  # to() returns int32 indices as they are, strided or not
    vals = values.contiguous()
    if count < capacity:
        idx = torch.cat([idx, torch.full((capacity - count,), numel, dtype=idx_dtype, device=idx.device)])
        vals = torch.cat([vals, vals.new_zeros(capacity - count)])
    return torch.cat([idx.view(torch.uint8), vals.view(torch.uint8)])


def _bytes_as(chunk: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """View a 1-d ``uint8`` chunk as ``dtype`` (copying it first if it is not aligned for ``dtype``)."""
    if chunk.storage_offset() % itemsize(dtype):
        chunk = chunk.clone()
    return chunk.view(dtype)


def unpack(gathered: torch.Tensor, world: int, capacity: int, numel: int, value_dtype: torch.dtype):
    """Per-rank ``(indices, values)`` views of a gathered buffer."""
    idx_dtype = index_dtype(numel)
    ibytes = capacity * itemsize(idx_dtype)
    seg = ibytes + capacity * itemsize(value_dtype)
    return [
        (_bytes_as(gathered[r * seg : r * seg + ibytes], idx_dtype),
         _bytes_as(gathered[r * seg + ibytes : (r + 1) * seg], value_dtype))
        for r in range(world)
    ]  # fmt: skip


def scatter_add_(
    out: torch.Tensor, pairs: list[tuple[torch.Tensor, torch.Tensor]], scale: float = 1.0
) -> torch.Tensor:
    """Add ``scale`` times every rank's pairs into ``out`` in place, rank 0 first (see the module docstring).

    Scaling each value as it is added (``1/P`` for a mean) spares a pass over ``out``.
    """
    for idx, vals in pairs:
        out.index_add_(0, idx, vals, alpha=scale)
    return out


def local_topk(flat: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Ascending int64 indices and values of the ``k`` entries of largest ``|flat|``.

    The library's exact selection (:func:`functopk.topk_indices`): NaN ranks as
    infinite, ties go to the lower index, values are the input's bits.
    """
    sel = topk_indices(flat.detach(), k)
    return sel.indices, sel.values


def reselect_(total: torch.Tensor, idx: torch.Tensor, vals: torch.Tensor, residual: torch.Tensor, k: int):
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


def start_exchange(idx: torch.Tensor, vals: torch.Tensor, numel: int, group: dist.ProcessGroup, world: int,
              async_op: bool):  # fmt: skip
    """Start the fixed-``k`` exchange (every rank sends exactly ``len(idx)`` pairs): ``(work, gathered)``."""
    k = idx.numel()
    gathered = torch.empty(world * k * (itemsize(index_dtype(numel)) + vals.element_size()),
                           dtype=torch.uint8, device=vals.device)  # fmt: skip
    work = all_gather(gathered, pack(idx, vals, k, numel), group, async_op)
    return work, gathered


def wire_bytes(k: int, numel: int, value_dtype: torch.dtype) -> int:
    """Bytes one rank sends for ``k`` pairs."""
    return k * (itemsize(index_dtype(numel)) + itemsize(value_dtype))


def send(
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
    zeroed). ``select(acc, k) -> (idx, vals)`` replaces :func:`local_topk`
    (it must select the same coordinates). A collective that fails at once
    raises :func:`comm_error` naming ``what``.
    """
    idx, vals = (select or local_topk)(acc, k)
    acc.index_fill_(0, idx, 0)  # what was not sent
    try:
        work, gathered = start_exchange(idx, vals, acc.numel(), group, world, async_op)
    except RuntimeError as exc:
        raise comm_error(what, group, exc) from exc
    return idx, vals, work, gathered


def nonfinite(gathered: torch.Tensor, world: int, k: int, numel: int, value_dtype: torch.dtype) -> torch.Tensor:
    """A 0-d bool on device: is any value of the gathered pairs NaN or Inf (no host sync)?

    Top-k ranks NaN and Inf as infinite magnitudes, so a rank whose ``grads +
    residual`` holds one sends it: this one ``O(P k)`` test covers this rank's
    own gradients and every value received. (The mean of finite values cannot
    overflow: it is at most their largest magnitude.)
    """
    ibytes = k * itemsize(index_dtype(numel))
    values = gathered.view(world, -1)[:, ibytes:].contiguous().view(value_dtype)
    return ~torch.isfinite(values).all()


def receive(
    out: torch.Tensor,
    gathered: torch.Tensor,
    sent: tuple[torch.Tensor, torch.Tensor],
    residual: torch.Tensor,
    world: int,
    reselect: bool,
) -> torch.Tensor:
    """Add the mean of every rank's pairs into the zeroed ``out``; with ``reselect``, gTop-k (see :func:`reselect_`)."""
    idx, vals = sent
    k = idx.numel()
    scatter_add_(out, unpack(gathered, world, k, out.numel(), out.dtype), 1.0 / world)
    if reselect:
        reselect_(out, idx, vals, residual, k)
    return out

