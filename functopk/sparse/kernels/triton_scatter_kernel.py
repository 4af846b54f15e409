"""The Triton kernel that adds a sparse update into the leaves where they lie (``@triton.jit``).

Launched by :mod:`~functopk.sparse.kernels.triton_scatter`; imported only where Triton is installed
(a CUDA device, or CPU tensors under ``TRITON_INTERPRET=1``). It reads the leaf table of
:mod:`~functopk.sparse.kernels.triton_layout` (a row per leaf: address, flat offset, numel, dtype code,
then the sizes and memory strides of a strided leaf).
"""

from __future__ import annotations

import triton
import triton.language as tl

from functopk.sparse.kernels.triton_reads import BF16, F16, F32, F64, ROW, leaf_of

__all__ = ["scatter_add_kernel"]


@triton.jit
def _add_as(addr, offs, v, mask, DT: tl.constexpr):
    """``x += v`` at element offsets ``offs`` of the leaf of dtype ``DT`` at byte address ``addr`` (``v`` cast
    to ``DT`` first, as ``index_add_`` casts its source: through float32, as torch turns a double into a
    half or a bfloat16, rounding twice)."""
    ptr = addr.to(tl.pointer_type(DT)) + offs
    x = tl.load(ptr, mask=mask, other=0.0)
    if DT == tl.float64:
        w = v.to(tl.float64)
    else:
        w = v.to(tl.float32).to(DT)
    tl.store(ptr, x + w, mask=mask)


@triton.jit(do_not_specialize=["n_leaves", "count"])
def scatter_add_kernel(table, n_leaves, indices, values, count, BLOCK: tl.constexpr, HAS_F16: tl.constexpr,
                       HAS_BF16: tl.constexpr, HAS_F64: tl.constexpr):
    """Add ``values[j]`` into the tree's coordinate at flat index ``indices[j]``, for ``j < count``.

    Each lane finds its index's leaf by a binary search over the table's flat offsets
    (:func:`~.triton_reads.leaf_of`), splits the offset within the leaf into the four logical
    indices of the row's sizes (a contiguous leaf's row has one dimension, of stride 1) and adds at
    the memory offset they give.
    The indices are distinct, so every element is written by one lane: no atomics, and the result
    does not depend on the order the programs run in. ``HAS_*``: whether the tree has leaves of that
    dtype (a branch is compiled only for those; float32's always is).
    """
    j = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    valid = j < count
    pos = tl.load(indices + j, mask=valid, other=0)
    v = tl.load(values + j, mask=valid, other=0.0)
    row = table + ROW * leaf_of(table, n_leaves, pos, valid, BLOCK)
    local = pos - tl.load(row + 1, mask=valid, other=0)
    d1 = tl.load(row + 5, mask=valid, other=1)
    d2 = tl.load(row + 6, mask=valid, other=1)
    d3 = tl.load(row + 7, mask=valid, other=1)
    x3 = local % d3
    q = local // d3
    x2 = q % d2
    q = q // d2
    x1 = q % d1
    x0 = q // d1
    offs = (
        x0 * tl.load(row + 8, mask=valid, other=0)
        + x1 * tl.load(row + 9, mask=valid, other=0)
        + x2 * tl.load(row + 10, mask=valid, other=0)
        + x3 * tl.load(row + 11, mask=valid, other=0)
    )
    addr = tl.load(row, mask=valid, other=0)
    code = tl.load(row + 3, mask=valid, other=0)
    _add_as(addr, offs, v, valid & (code == F32), tl.float32)
    if HAS_F16:
        _add_as(addr, offs, v, valid & (code == F16), tl.float16)
    if HAS_BF16:
        _add_as(addr, offs, v, valid & (code == BF16), tl.bfloat16)
    if HAS_F64:
        _add_as(addr, offs, v, valid & (code == F64), tl.float64)
