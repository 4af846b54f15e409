"""``sparse_allreduce``: every rank's ``(index, value)`` pairs summed into one dense vector.

It is the public face of the exchange that :func:`distributed_topk` and
:func:`topk_hook` run with a fixed ``k`` (:mod:`functopk.distributed.wire`);
here ranks may hold different numbers of pairs.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from functopk._checks import check_bool, check_int, describe
from functopk.distributed.wire import check_group_arg, gather_or_fail, pack, resolve_group, scatter_add_, unpack

__all__ = ["sparse_allreduce"]


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
    numel, capacity = _check_pairs(indices, values, numel, average, capacity)
    check_group_arg(group, "group")
    group, _, world = resolve_group(group, "sparse_allreduce")
    if indices.numel():  # checked before the exchange, without a host sync
        torch._assert_async(
            (indices >= 0).all() & (indices < numel).all(), f"sparse_allreduce: indices must lie in [0, {numel})"
        )
    device = values.device
    # Step I: the capacity. Unless given, exchange the counts; their maximum sizes the buffers (a host sync).
    if capacity is None:
        counts = torch.empty(world, dtype=torch.int64, device=device)
        gather_or_fail(counts, torch.full((1,), indices.numel(), dtype=torch.int64, device=device), group,
                       "the count exchange of sparse_allreduce")  # fmt: skip
        capacity = int(counts.max())  # host sync: the buffer sizes depend on it
    # Step II: pack this rank's pairs (padded to the capacity) and all-gather every rank's.
    packed = pack(indices, values, capacity, numel)  # local work stays outside the collective's error report
    gathered = torch.empty(world * packed.numel(), dtype=torch.uint8, device=device)
    gather_or_fail(gathered, packed, group, "the sparse all-gather")
    # Step III: add them rank by rank into one dense buffer; the padding lands in a last, dropped slot.
    out = torch.zeros(numel + 1, dtype=values.dtype, device=device)
    scatter_add_(out, unpack(gathered, world, capacity, numel, values.dtype), 1.0 / world if average else 1.0)
    return out[:numel]


def _check_pairs(indices: Any, values: Any, numel: Any, average: Any, capacity: Any) -> tuple[int, int | None]:
    """:func:`sparse_allreduce`'s checks of its tensors and numbers: ``(numel, capacity)`` as Python ints."""
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
    return numel, capacity
