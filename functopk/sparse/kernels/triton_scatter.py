"""A sparse update added into a tree's leaves with one kernel launch, whatever the number of leaves.

:func:`functopk.apply_sparse_updates_` on CUDA tensors (and, with
``KernelConfig(backend="triton")``, on CPU tensors under ``TRITON_INTERPRET=1``)
comes here instead of its ATen path, which reads on the host how many indices
fall in each leaf and launches two kernels per leaf that receives any. Here:

* leaves that lie back to back in one buffer with one dtype (a gradient
  buffer's views, parameters flattened into one storage): one ``index_add_``
  into that buffer;
* otherwise one launch of :func:`~.triton_scatter_kernel.scatter_add_kernel`,
  reading the leaf table of :mod:`~functopk.sparse.kernels.triton_layout`
  (built once per set of leaves and cached; strided leaves such as
  ``channels_last`` weights are written where they lie);
* leaves with gaps or overlaps (which the kernels could read only through a
  copy), a dtype the table has no code for, tensor subclasses (a ``DTensor``
  shard) and a CUDA graph capture before any table was built: not served
  (``False``), the ATen path runs.

The numbers are the ATen path's bit for bit: each value is cast to its leaf's
dtype and added once (the indices are distinct).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from functopk.sparse.config import DEFAULT_CONFIG, KernelConfig
from functopk.sparse.kernels.triton_layout import CODES, Plan, plan

__all__ = ["BLOCK", "add_", "launch"]

BLOCK = 256
"""Indices per program."""

_PLAIN = (torch.Tensor, torch.nn.Parameter)


def launch(p: Plan, indices: torch.Tensor, values: torch.Tensor, dtypes: set[torch.dtype]) -> tuple:
    """The kernel launch ``(kernel, grid, args, meta)`` for a table plan (nothing runs; a test compiles it)."""
    from functopk.sparse.kernels.triton_scatter_kernel import scatter_add_kernel

    count = indices.numel()
    meta = dict(BLOCK=BLOCK, HAS_F16=torch.float16 in dtypes, HAS_BF16=torch.bfloat16 in dtypes,
                HAS_F64=torch.float64 in dtypes)  # fmt: skip
    return scatter_add_kernel, max(1, -(-count // BLOCK)), (p.table, p.leaves, indices, values, count), meta


def add_(
    leaves: Sequence[torch.Tensor], indices: torch.Tensor, values: torch.Tensor, config: KernelConfig = DEFAULT_CONFIG
) -> bool:
    """Add ``values`` at the flat ``indices`` of ``leaves`` (in place), if served here (see the module).

    ``indices``: distinct int64 flat indices in range (checked by the caller); ``values``: one per index,
    of any float dtype. Returns whether it ran (``False``: nothing was written).
    """
    if any(x.dtype not in CODES or type(x) not in _PLAIN for x in leaves):  # (no table code; a DTensor shard)
        return False
    p = plan(leaves, config)
    if p.source == "flat" and p.flat is not None:
        p.flat.index_add_(0, indices, values.to(p.flat.dtype))
        return True
    if p.source != "table" or p.held:
        return False
    if not indices.numel():
        return True
    kernel, grid, args, meta = launch(p, indices, values, {x.dtype for x in leaves})
    kernel[(grid,)](*args, **meta)
    return True
