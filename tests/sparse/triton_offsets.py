"""A one-program Triton kernel around ``triton_reads.memory_offsets``, for ``tests/sparse/triton_interpreted.py``.

Its own module: it imports Triton, which the interpreter's tests switch on before the import.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from functopk.sparse.kernels.triton_reads import memory_offsets


@triton.jit
def _offsets_kernel(row, start, out, TILE: tl.constexpr):
    tl.store(out + tl.arange(0, TILE), memory_offsets(row, start, TILE))


def tile_offsets(row: torch.Tensor, start: int, tile: int) -> torch.Tensor:
    """The memory offsets (int64) of flat indices ``start .. start + tile - 1`` of the leaf of table ``row``."""
    out = torch.empty(tile, dtype=torch.int32)
    _offsets_kernel[(1,)](row, start, out, TILE=tile)
    return out.long()
