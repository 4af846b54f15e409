"""How the Triton kernels read the leaves: keys, tiles of the leaves, strided leaves, the sample (``@triton.jit``).

Helpers of :mod:`~functopk.sparse.kernels.triton_kernels` (imported with it, only where Triton is).

* key: the order-preserving integer of ``|x|`` in the common dtype: the bits
  of ``|x|`` (sign cleared) as int32 (fp16, bf16 and fp32 trees, upcast to
  fp32 exactly) or int64 (fp64 trees), NaN mapped to the key of ``+inf``. Keys
  compare as the magnitudes do.
* the leaf table (:mod:`~functopk.sparse.kernels.triton_layout`): a row of
  ``ROW`` int64 words per leaf (address, flat offset, numel, dtype code,
  layout), then per program ``(leaf, start)``.
* a tile is ``TILE`` consecutive flat indices of one leaf. A strided leaf's
  tile is loaded from where its coordinates lie (:func:`memory_offsets`), so
  that the tile stays in flat order; where the order does not matter it is
  read in memory order instead.
"""

from __future__ import annotations

import triton
import triton.language as tl

from functopk.sparse.kernels import triton_layout

__all__ = ["carry", "key_of", "leaf_of", "leaf_tile", "load_as", "memory_offsets", "sample_keys"]

# dtype codes of the leaf table (every kernel reading a table compiles a branch per dtype its keys allow)
F32 = tl.constexpr(1)
F16 = tl.constexpr(2)
BF16 = tl.constexpr(4)
F64 = tl.constexpr(8)
ROW = tl.constexpr(triton_layout.ROW)  # int64 words per leaf in the table (see triton_layout.ROW for the columns)


@triton.jit
def key_of(x, KEY64: tl.constexpr):
    """Order-preserving integer key of ``|x|``; NaN ranks as ``+inf``."""
    if KEY64:
        bits = x.to(tl.float64).to(tl.int64, bitcast=True) & 0x7FFFFFFFFFFFFFFF
        return tl.minimum(bits, 0x7FF0000000000000)
    else:
        bits = x.to(tl.float32).to(tl.int32, bitcast=True) & 0x7FFFFFFF
        return tl.minimum(bits, 0x7F800000)


@triton.jit
def load_as(addr, offs, mask, DT: tl.constexpr, KEY64: tl.constexpr, VAL_T: tl.constexpr):
    """Keys and values (in ``VAL_T``) of ``offs`` in the leaf of dtype ``DT`` at byte address ``addr``."""
    x = tl.load(addr.to(tl.pointer_type(DT)) + offs, mask=mask, other=0.0)
    return key_of(x, KEY64), x.to(VAL_T)


@triton.jit
def carry(t, d):
    """``(t // d, t % d)`` of a non-negative int32 ``t`` with ``t // d`` below ``2**20``: a float32 quotient,
    off by at most one, corrected."""
    q = (t.to(tl.float32) * (1.0 / d.to(tl.float32))).to(tl.int32)
    r = t - q * d
    q = tl.where(r >= d, q + 1, tl.where(r < 0, q - 1, q))
    r = tl.where(r >= d, r - d, tl.where(r < 0, r + d, r))
    return q, r


@triton.jit
def memory_offsets(row, start, TILE: tl.constexpr):
    """Where flat offsets ``start .. start + TILE - 1`` of the strided leaf of table row ``row`` lie (int32).

    The row holds the leaf's logical sizes ``D1, D2, D3`` (``D0`` implied) and memory strides
    ``M0 .. M3``. The tile's first offset is split into its four indices once; each lane's indices
    follow by carrying ``0 .. TILE - 1`` through the sizes (a quotient below ``TILE + 1`` at each level).
    """
    d1 = tl.load(row + 5).to(tl.int32)
    d2 = tl.load(row + 6).to(tl.int32)
    d3 = tl.load(row + 7).to(tl.int32)
    q3 = start.to(tl.int32) // d3  # (int32: a leaf has fewer than 2**31 coordinates)
    c3 = start.to(tl.int32) - q3 * d3
    q2 = q3 // d2
    c2 = q3 - q2 * d2
    c0 = q2 // d1
    c1 = q2 - c0 * d1
    q, x3 = carry(c3 + tl.arange(0, TILE), d3)
    q, x2 = carry(c2 + q, d2)
    x1 = q * 0
    if d1 > 1:  # four dimensions (fewer: D1 is 1)
        q, x1 = carry(c1 + q, d1)
    x0 = c0 + q
    return (x0 * tl.load(row + 8).to(tl.int32) + x1 * tl.load(row + 9).to(tl.int32)
            + x2 * tl.load(row + 10).to(tl.int32) + x3 * tl.load(row + 11).to(tl.int32))


@triton.jit
def leaf_tile(src, table, n, n_leaves, p, s, ordered, FLAT: tl.constexpr, KEY64: tl.constexpr,
               VAL_T: tl.constexpr, TILE: tl.constexpr, SUB: tl.constexpr):
    """Tile ``s`` of program ``p`` read from the leaves: (keys, flat indices, values, valid).

    A strided leaf's tile is read in flat order when ``ordered``, else where it lies in memory (faster;
    for counts only: the flat indices returned then do not match the keys).
    """
    if FLAT:  # one buffer: program p owns [p * SUB * TILE, (p + 1) * SUB * TILE)
        offs = (p * SUB + s).to(tl.int64) * TILE + tl.arange(0, TILE)
        mask = offs < n
        x = tl.load(src + offs, mask=mask, other=0.0)
        return key_of(x, KEY64), offs, x.to(VAL_T), mask
    else:  # the table: a row per leaf (triton_layout.ROW), then per program (leaf, start)
        prog = table + ROW * n_leaves + 2 * p
        leaf = tl.load(prog)
        start = tl.load(prog + 1) + s * TILE
        row = table + ROW * leaf
        offs = start + tl.arange(0, TILE)
        mask = offs < tl.load(row + 2)
        where = offs
        if ordered:
            if tl.load(row + 4) > 1:  # a strided leaf
                where = memory_offsets(row, start, TILE).to(tl.int64)
        addr = tl.load(row)
        code = tl.load(row + 3)
        key_t: tl.constexpr = tl.int64 if KEY64 else tl.int32
        key = tl.zeros([TILE], key_t)
        val = tl.zeros([TILE], VAL_T)
        if code == F32:
            key, val = load_as(addr, where, mask, tl.float32, KEY64, VAL_T)
        if code == F16:
            key, val = load_as(addr, where, mask, tl.float16, KEY64, VAL_T)
        if code == BF16:
            key, val = load_as(addr, where, mask, tl.bfloat16, KEY64, VAL_T)
        if KEY64:  # only fp64 trees have fp64 leaves
            if code == F64:
                key, val = load_as(addr, where, mask, tl.float64, KEY64, VAL_T)
        return key, tl.load(row + 1) + offs, val, mask


@triton.jit
def leaf_of(table, n_leaves, pos, valid, N: tl.constexpr):
    """The table row of the leaf holding each flat index ``pos`` (``N`` lanes): a binary search for the last
    leaf whose flat offset is at most ``pos`` (an empty leaf shares its offset with the next one, so the
    search passes it)."""
    lo = tl.zeros([N], tl.int64)
    size = n_leaves
    while size > 1:
        half = size // 2
        ok = tl.load(table + ROW * (lo + half) + 1, mask=valid, other=0) <= pos
        lo = tl.where(ok, lo + half, lo)
        size = size - half
    return lo


@triton.jit
def _sample_key(addr, local, valid, code, key, C: tl.constexpr, DT: tl.constexpr, KEY64: tl.constexpr):
    """``key`` with the keys of the sampled coordinates of dtype code ``C`` filled in."""
    this, _ = load_as(addr, local, valid & (code == C), DT, KEY64, DT)
    return tl.where(code == C, this, key)


@triton.jit
def sample_keys(src, table, n_leaves, stride, count, FLAT: tl.constexpr, KEY64: tl.constexpr, SAMPLE: tl.constexpr):
    """Keys of the systematic sample (flat indices ``0, stride, 2 stride, ...``; ``count`` of them), -1 past it."""
    j = tl.arange(0, SAMPLE)
    valid = j < count
    pos = j.to(tl.int64) * stride
    if FLAT:
        key = key_of(tl.load(src + pos, mask=valid, other=0.0), KEY64)
    else:
        lo = leaf_of(table, n_leaves, pos, valid, SAMPLE)
        addr = tl.load(table + ROW * lo, mask=valid, other=0)
        local = pos - tl.load(table + ROW * lo + 1, mask=valid, other=0)  # where it lies (strided: any order)
        code = tl.load(table + ROW * lo + 3, mask=valid, other=0)
        key_t: tl.constexpr = tl.int64 if KEY64 else tl.int32
        key = tl.zeros([SAMPLE], key_t)
        key = _sample_key(addr, local, valid, code, key, F32, tl.float32, KEY64)
        key = _sample_key(addr, local, valid, code, key, F16, tl.float16, KEY64)
        key = _sample_key(addr, local, valid, code, key, BF16, tl.bfloat16, KEY64)
        if KEY64:  # only fp64 trees have fp64 leaves
            key = _sample_key(addr, local, valid, code, key, F64, tl.float64, KEY64)
    return tl.where(valid, key, -1)
