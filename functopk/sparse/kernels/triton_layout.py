"""Where the Triton kernel reads a tree's leaves from: one flat buffer, a table of the leaves, or a copy.

The kernels read the leaves in place wherever they can:

* one flat buffer, when the leaves are contiguous and lie back to back in one
  storage in flat order (a gradient buffer, a DDP bucket);
* otherwise a table with a row per leaf (its address, flat offset, size, dtype
  and layout), built on the host and copied to the device from pinned memory
  (asynchronous: no synchronisation), cached by the leaves' addresses, sizes,
  dtypes and strides. A leaf need not be contiguous: any dense, non-overlapping
  layout (``channels_last``, ``channels_last_3d``, a transpose, a permutation of
  the dimensions) is read where it lies, the table row giving its sizes and
  memory strides (:func:`dense_dims`). Only a leaf with gaps or overlaps (a
  slice with a step, an expanded tensor), or a permutation of more than
  :data:`DIMS` dimensions that cannot be merged, is copied first.

While a CUDA graph is being captured no table can be copied in: the table
cached by an earlier call on the same leaves (the warm-up before a capture) is
read, and kept for the graph's lifetime; without one, the leaves are copied
into one flat buffer (each read and written once).
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Sequence

import torch

from functopk.sparse.config import DEFAULT_CONFIG, KernelConfig

__all__ = ["CODES", "DIMS", "ROW", "Plan", "capturing", "concatenated", "dense_dims", "plan", "tiling"]

CODES = {torch.float32: 1, torch.float16: 2, torch.bfloat16: 4, torch.float64: 8}
"""Dtype codes of the leaf table (the same numbers as the kernels' ``F32``, ``F16``, ``BF16``, ``F64``)."""

DIMS = 4
"""The most dimensions (after merging) of a strided leaf read in place (a table row has room for this many)."""

ROW = 12
"""int64 words per leaf in the table: address, flat offset, numel, dtype code, then the layout: the number of
merged dimensions ``r`` (1: contiguous), the logical sizes ``D1, D2, D3`` and the memory strides
``M0, M1, M2, M3`` of :func:`dense_dims`, padded in front to :data:`DIMS` (size 1, stride 0)."""

_LAYOUTS: OrderedDict[tuple, tuple] = OrderedDict()  # leaves' key -> ("flat", None, 0) or ("table", table, programs)
_MAX_LAYOUTS = 16
_CAPTURED: dict[tuple, tuple] = {}  # tables read by captured CUDA graphs: never freed (a graph may replay any time)
_MAX_CAPTURED = 64


@dataclasses.dataclass(frozen=True)
class Plan:
    """How one call reads its leaves: the launch grid and what the kernels are specialised on.

    Attributes:
        flat: The leaves as one 1-d buffer (``None``: read through ``table``).
        table: int64, a row of :data:`ROW` words per leaf, then per program (leaf, start).
        leaves: Number of rows of the leaf table.
        programs: Programs of every launch after step 1 (each owns ``tiles * tile`` coordinates of one leaf).
        n: Coordinates in all.
        dtype: The common dtype (values are returned in it).
        tile: Coordinates per tile; ``tiles``: tiles per program.
        source: ``"flat"`` (the leaves lie back to back in one buffer), ``"table"`` or ``"copy"`` (concatenated,
            while a CUDA graph is captured).
        held: Copies the table points to (leaves with gaps or overlaps), kept alive while the kernels are queued.
    """

    flat: torch.Tensor | None
    table: torch.Tensor | None
    leaves: int
    programs: int
    n: int
    dtype: torch.dtype
    tile: int
    tiles: int
    source: str
    held: tuple[torch.Tensor, ...] = ()


def tiling(config: KernelConfig) -> tuple[int, int]:
    """(coordinates per tile, tiles per program) for ``config.triton_block`` coordinates per program.

    Example:
        >>> from functopk.sparse.config import KernelConfig
        >>> tiling(KernelConfig()), tiling(KernelConfig(triton_block=64))
        ((2048, 16), (16, 4))
    """
    block = config.triton_block
    tile = min(2048, max(16, block // 4))
    return tile, max(1, block // tile)


def dense_dims(shape: Sequence[int], stride: Sequence[int]) -> tuple[tuple[int, int], ...] | None:
    """(size, memory stride) per dimension of a dense, non-overlapping layout, in logical order, or ``None``.

    Dimensions of size 1 are dropped and logically adjacent ones that are adjacent in memory too are merged,
    so a contiguous tensor has one dimension and a ``channels_last`` one (N, C, H, W) three: N, C and H*W.
    ``None`` when the layout has gaps, overlaps or a negative stride.

    Example:
        >>> x = torch.zeros(2, 3, 4, 5).to(memory_format=torch.channels_last)
        >>> dense_dims(x.shape, x.stride()), dense_dims((4, 3), (3, 1)), dense_dims((4,), (2,))
        (((2, 60), (3, 1), (20, 3)), ((12, 1),), None)
    """
    dims = [(size, step) for size, step in zip(shape, stride) if size != 1]
    expect = 1
    for size, step in sorted(dims, key=lambda d: d[1]):  # innermost in memory first
        if step != expect:
            return None
        expect *= size
    merged: list[tuple[int, int]] = []
    for size, step in dims:
        if merged and merged[-1][1] == size * step:
            merged[-1] = (merged[-1][0] * size, step)
        else:
            merged.append((size, step))
    return tuple(merged) or ((1, 1),)


def _row(x: torch.Tensor, offset: int, dims: tuple[tuple[int, int], ...] | None) -> list[int]:
    """The table row of leaf ``x`` at flat ``offset`` (``dims``: its strided layout; ``None``: contiguous)."""
    head = [x.data_ptr(), offset, x.numel(), CODES[x.dtype]]
    if dims is None:
        return head + [1, 1, 1, x.numel(), 0, 0, 0, 1]
    pad = DIMS - len(dims)
    sizes = [1] * pad + [size for size, _ in dims]
    strides = [0] * pad + [step for _, step in dims]
    return head + [len(dims), *sizes[1:], *strides]


def _table(flats: Sequence[torch.Tensor], strided: dict[int, tuple], block: int) -> tuple[torch.Tensor, int]:
    """The leaf table (see :class:`Plan`) on the leaves' device, and the number of programs."""
    rows: list[int] = []
    programs: list[int] = []
    offset = 0
    for i, f in enumerate(flats):
        rows += _row(f, offset, strided.get(i))
        for start in range(0, f.numel(), block):
            programs += [i, start]
        offset += f.numel()
    host = torch.tensor(rows + programs, dtype=torch.int64)
    if flats[0].device.type == "cuda":  # pinned and asynchronous: no synchronisation (ordered on the stream)
        return host.pin_memory().to(flats[0].device, non_blocking=True), len(programs) // 2
    return host, len(programs) // 2


def _back_to_back(ptrs: tuple[int, ...], sizes: tuple[int, ...], dtypes: tuple[torch.dtype, ...]) -> bool:
    """Whether the (contiguous) leaves lie back to back in memory, in flat order, with one dtype."""
    if any(d != dtypes[0] for d in dtypes):
        return False
    size, offset = dtypes[0].itemsize, 0
    for ptr, numel in zip(ptrs, sizes):
        if numel and ptr != ptrs[0] + offset * size:
            return False
        offset += numel
    return True


def _flat_view(flats: Sequence[torch.Tensor], n: int) -> torch.Tensor | None:
    """The leaves (back to back) as one 1-d view of the first one's storage, or ``None`` if it does not hold them."""
    if len(flats) == 1:
        return flats[0].detach().reshape(-1)
    try:
        return flats[0].detach().as_strided((n,), (1,))
    except RuntimeError:  # back to back in memory, but not all in the first leaf's storage
        return None


def capturing(device: torch.device) -> bool:
    """Whether the current CUDA stream is being captured into a graph (never on other devices).

    Example:
        >>> capturing(torch.device("cpu"))
        False
    """
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def concatenated(leaves: Sequence[torch.Tensor], dtype: torch.dtype, n: int) -> torch.Tensor:
    """The leaves in flat order (each row-major) as one contiguous buffer of ``dtype``: every leaf read once.

    The contiguous leaves of ``dtype`` are copied by one foreach copy, the others (strided, or of another
    dtype) one copy each, straight into their place: no intermediate copy of a strided leaf.

    Example:
        >>> concatenated([torch.ones(2), torch.arange(4.0).view(2, 2).t()], torch.float32, 6)
        tensor([1., 1., 0., 2., 1., 3.])
    """
    flat = torch.empty(n, dtype=dtype, device=leaves[0].device)
    pairs = list(zip(flat.split([x.numel() for x in leaves]), leaves))
    same = [(part, x.detach().view(-1)) for part, x in pairs if x.dtype == dtype and x.is_contiguous()]
    if same:
        torch._foreach_copy_([part for part, _ in same], [x for _, x in same])
    for part, x in pairs:
        if x.dtype != dtype or not x.is_contiguous():
            part.view(x.shape).copy_(x.detach())
    return flat


def _readable(leaves: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], dict[int, tuple], list[torch.Tensor]]:
    """The leaves as the kernels read them, the strided layouts by leaf index, and the copies made.

    Contiguous and dense strided leaves are read where they lie; the rest become contiguous copies.
    """
    flats: list[torch.Tensor] = []
    strided: dict[int, tuple] = {}
    copies: list[torch.Tensor] = []
    for i, x in enumerate(leaves):
        if not x.is_contiguous():
            dims = dense_dims(x.shape, x.stride())
            if dims is not None and len(dims) <= DIMS:
                strided[i] = dims
            else:  # gaps, overlaps, or too many dimensions: a contiguous copy (reshape could be a strided view)
                x = x.detach().contiguous().view(-1)
                copies.append(x)
        flats.append(x)
    return flats, strided, copies


def _keep_for_graphs(key: tuple, layout: tuple) -> bool:
    """Keep a cached table alive for the CUDA graph being captured (a graph may replay any time later)."""
    if key not in _CAPTURED and len(_CAPTURED) >= _MAX_CAPTURED:
        return False
    _CAPTURED[key] = layout
    return True


def plan(leaves: Sequence[torch.Tensor], config: KernelConfig = DEFAULT_CONFIG) -> Plan:
    """How the kernels read ``leaves`` (see the module docstring): a flat view, a cached table, or a copy.

    Which of the first two, and the table, are cached by the leaves' addresses, sizes, dtypes and (for the
    strided ones) layouts: a few passes of attribute reads over the leaves, the host work of a call on a
    tree of many leaves.

    Example:
        >>> leaves = [torch.ones(3), torch.ones(2, dtype=torch.float16)]
        >>> p = plan(leaves)
        >>> p.flat is None, p.leaves, p.programs, p.n, p.dtype, p.source
        (True, 2, 2, 5, torch.float32, 'table')
    """
    flats, strided, copies = _readable(leaves)
    sizes = tuple(map(torch.Tensor.numel, flats))
    dtypes = tuple(x.dtype for x in flats)
    dtype = dtypes[0]
    for other in set(dtypes):
        dtype = torch.promote_types(dtype, other)
    n, (tile, tiles), device = sum(sizes), tiling(config), flats[0].device
    block, capture = tile * tiles, capturing(device)
    key = (device, block, tuple(map(torch.Tensor.data_ptr, flats)), sizes, dtypes, tuple(strided.items()))
    layout = _LAYOUTS.get(key)
    if layout is None:
        if not strided and _back_to_back(key[2], sizes, dtypes) and _flat_view(flats, n) is not None:
            layout = ("flat", None, 0)
        elif not capture:  # (a table copied while capturing would be filled only when the graph replays)
            layout = ("table", *_table(flats, strided, block))
        if layout is not None and not capture:
            _LAYOUTS[key] = layout
            if len(_LAYOUTS) > _MAX_LAYOUTS:
                _LAYOUTS.popitem(last=False)
    else:
        _LAYOUTS.move_to_end(key)
    programs = max(1, -(-n // block))
    if layout is not None and layout[0] == "flat":
        return Plan(_flat_view(flats, n), None, 1, programs, n, dtype, tile, tiles, "flat")
    if layout is None or (capture and not _keep_for_graphs(key, layout)):  # capturing, no table: one copy
        return Plan(concatenated(flats, dtype, n), None, 1, programs, n, dtype, tile, tiles, "copy")
    return Plan(None, layout[1], len(flats), max(1, layout[2]), n, dtype, tile, tiles, "table", tuple(copies))
