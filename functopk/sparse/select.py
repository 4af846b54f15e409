"""Selection kernels: which coordinates a global top-k keeps.

These functions work on the list of a tree's leaves, each flattened to 1-d in
flat order (see :mod:`functopk.tree`), and never change them. The public
entry points are in :mod:`functopk.sparse.api`; this module holds the
algorithms (see ``docs/topk.md`` for the measurements behind them):

* :func:`mask_static`: the exact top-k as a boolean mask over the
  concatenated magnitudes, with static shapes only. ``torch.topk`` for an int
  ``k``; a radix select on the float bit patterns for a tensor ``k``.
* :func:`select_exact`: the exact top-k as sorted flat indices and values,
  without concatenating the leaves. A systematic sample brackets the k-th
  magnitude; one scan over the leaves, in cache-sized segments, gathers the
  candidates above the lower end of the bracket; an exact selection among the
  candidates finishes the job. If the sample was misleading (too few
  candidates) it falls back to :func:`mask_static`, so the result never
  depends on the sample, only the running time does. Data-dependent sizes and
  host reads: eager mode only.
* :func:`sample_threshold` and :func:`gaussian_threshold_flat`: approximate
  thresholds, for the approximate methods; :func:`scan_above` gathers the
  coordinates above a threshold with the exact kernel's scan.

Ranking rules shared by every exact kernel: magnitudes ``|x|`` are compared in
the common (promoted) dtype of the leaves, NaN counts as ``+inf``, and among
equal magnitudes the lower flat index wins.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

__all__ = [
    "SUPPORTED_DTYPES",
    "column_rows",
    "common_dtype",
    "flat_magnitudes",
    "gaussian_threshold_flat",
    "mask_static",
    "nonzero_1d",
    "radix_kth_key",
    "sample_stride",
    "sample_threshold",
    "scan_above",
    "select_exact",
    "select_static",
    "systematic_sample",
]

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

_INT_OF = {
    torch.float16: torch.int16,
    torch.bfloat16: torch.int16,
    torch.float32: torch.int32,
    torch.float64: torch.int64,
}
_MAGNITUDE_BITS = {torch.float16: 15, torch.bfloat16: 15, torch.float32: 31, torch.float64: 63}

# Tuning constants of the eager exact kernel (module attributes so that tests can
# shrink them to exercise every branch on small trees).
EXACT_MIN_NUMEL = 1 << 16
"""Trees smaller than this use the static kernel even in eager mode (it is as fast there)."""
SEGMENT = 1 << 19
"""Elements per segment of the direct scan (2 MiB of float32: the reused buffer stays in the L3 cache)."""
SAMPLE_SIZE = 1 << 16
"""Target size of the systematic sample that brackets the k-th magnitude."""
MARGIN = 4.0
"""Width of the bracket, in binomial standard deviations of the sample count on each side."""
BAND_MIN = 1 << 15
"""Candidate count above which the upper end of the bracket is used to shrink the final selection."""
MAX_ROWS = 256
"""Most rows of the column view of a leaf (see :func:`column_rows`)."""
COLUMN_BALANCE = 0.25
"""Balance constant of :func:`column_rows`."""
COLUMN_MAX_FRACTION = 0.003
"""Candidate fraction above which leaves are scanned directly (see :func:`column_rows`)."""
WORDS_MAX_FRACTION = 0.03
"""Candidate fraction above which the direct scan runs ``nonzero`` on the values rather than on words."""
MIN_COLUMNS = 256
"""Leaves with fewer than ``rows * MIN_COLUMNS`` elements are scanned directly."""
COLUMN_BLOCK = 1 << 21
"""Large leaves are viewed as columns block by block, of at most this many elements."""


def common_dtype(leaves: Sequence[torch.Tensor]) -> torch.dtype:
    """The promoted dtype of ``leaves`` (in which magnitudes are compared)."""
    dtype = leaves[0].dtype
    for leaf in leaves[1:]:
        dtype = torch.promote_types(dtype, leaf.dtype)
    return dtype


def _magnitudes_(x: torch.Tensor) -> torch.Tensor:
    """In place: ``|x|`` with NaN mapped to ``+inf``; returns ``x``."""
    return torch.nan_to_num_(x.abs_(), nan=math.inf, posinf=math.inf)


def flat_magnitudes(flats: Sequence[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """``|x|`` of every coordinate in flat order, in ``dtype``, NaN mapped to ``+inf`` (a new tensor)."""
    return _magnitudes_(torch.cat([f.to(dtype) for f in flats]))


# --------------------------------------------------------------------------- static (compile-friendly) kernels


def _tie_mask(mags: torch.Tensor, above: torch.Tensor, at: torch.Tensor, k: int | torch.Tensor) -> torch.Tensor:
    """``above`` plus the first ``k - #above`` entries of ``at`` in index order."""
    room = k - torch.count_nonzero(above)
    return above | (at & (torch.cumsum(at, 0) <= room))


def radix_kth_key(keys: torch.Tensor, k: torch.Tensor, bits: int) -> torch.Tensor:
    """The k-th largest of non-negative integer ``keys`` (a 0-d tensor), by radix select.

    Static shapes and no host reads: ``ceil(bits / 11)`` passes, each a
    histogram (``index_add_``) of the next digit over the keys whose higher
    digits match the prefix found so far.

    Args:
        keys: 1-d non-negative integer tensor (at most ``bits`` significant bits).
        k: 0-d integer tensor in ``[1, keys.numel()]``.
        bits: Number of significant bits of the keys.
    """
    passes = -(-bits // 11)
    widths = [bits // passes + (1 if i < bits % passes else 0) for i in range(passes)]
    need = k.to(torch.int64)
    prefix = torch.zeros((), dtype=torch.int64, device=keys.device)
    shift = bits
    for width in widths:
        shift -= width
        digit = (keys >> shift) & ((1 << width) - 1)
        if shift + width == bits:
            weight = torch.ones_like(digit, dtype=torch.int64)
        else:
            weight = ((keys >> (shift + width)) == prefix).to(torch.int64)
        hist = torch.zeros(1 << width, dtype=torch.int64, device=keys.device)
        hist.index_add_(0, digit.to(torch.int64), weight)
        at_least = hist.flip(0).cumsum(0).flip(0)  # at_least[d]: matching keys with digit >= d
        d = torch.count_nonzero(at_least >= need) - 1  # the largest digit that still holds the k-th
        need = need - (at_least.gather(0, d.reshape(1)) - hist.gather(0, d.reshape(1))).reshape(())
        prefix = (prefix << width) | d
    return prefix


def _keys(mags: torch.Tensor) -> torch.Tensor:
    """Order-preserving integer keys of non-negative, NaN-free magnitudes (their bit patterns)."""
    keys = mags.view(_INT_OF[mags.dtype])
    return keys.to(torch.int32) if keys.dtype == torch.int16 else keys


def mask_static(mags: torch.Tensor, k: int | torch.Tensor) -> torch.Tensor:
    """Boolean mask of the top ``k`` of ``mags`` (NaN-free magnitudes); ties: lower index wins.

    Static shapes and no host reads, so it compiles with ``fullgraph=True``.
    An int ``k`` uses ``torch.topk``; a 0-d integer tensor ``k`` (clamped to
    ``[1, n]``) uses :func:`radix_kth_key`.
    """
    if isinstance(k, torch.Tensor):
        k = k.to(device=mags.device, dtype=torch.int64).clamp(1, mags.numel())
        keys = _keys(mags)
        t = radix_kth_key(keys, k, _MAGNITUDE_BITS[mags.dtype])
        return _tie_mask(keys, keys > t, keys == t, k)
    t = torch.topk(mags, k, sorted=False).values.min()
    return _tie_mask(mags, mags > t, mags == t, k)


def select_static(flats: Sequence[torch.Tensor], k: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Sorted flat indices and values (in ``dtype``) of the exact top ``k``, via :func:`mask_static`.

    Materialises the concatenation. ``nonzero`` makes it eager-only; it is the
    fallback of :func:`select_exact` and its path for tiny trees.
    """
    flat = torch.cat([f.to(dtype) for f in flats])
    mask = mask_static(_magnitudes_(flat.clone()), k)
    idx = nonzero_1d(mask, k / mask.numel())
    return idx, flat.index_select(0, idx)


# --------------------------------------------------------------------------- sampling


def _next_prime(x: int) -> int:
    x = max(2, x)
    while any(x % p == 0 for p in range(2, math.isqrt(x) + 1)):
        x += 1
    return x


def sample_stride(numel: int, target: int) -> int:
    """A prime stride giving about ``target`` samples out of ``numel`` (1: take everything)."""
    if numel <= target:
        return 1
    return _next_prime(numel // target)


def systematic_sample(flats: Sequence[torch.Tensor], stride: int, dtype: torch.dtype) -> torch.Tensor:
    """Magnitudes (in ``dtype``, NaN as ``+inf``) of the coordinates whose flat index is ``stride // 2`` mod ``stride``.

    A systematic sample of the virtual concatenation: one strided view per
    leaf and one ``torch.cat``, deterministic, static shapes. A prime stride
    avoids locking onto the periodic structure of conv kernels.
    """
    views, offset = [], 0
    phase = stride // 2
    for f in flats:
        start = (phase - offset) % stride
        if start < f.numel():
            views.append(f[start::stride])
        offset += f.numel()
    if not views:
        return torch.zeros(0, dtype=dtype, device=flats[0].device)
    return _magnitudes_(torch.cat([v if v.dtype == dtype else v.to(dtype) for v in views]))


# --------------------------------------------------------------------------- eager exact kernel


def nonzero_1d(mask: torch.Tensor, density: float = 0.0) -> torch.Tensor:
    """``mask.nonzero()`` of a contiguous 1-d bool tensor, as 1-d int64, in ascending order.

    ATen's CPU ``nonzero`` costs about a nanosecond per element plus tens of
    nanoseconds per hit (branch mispredictions). For sparse masks (expected
    ``density`` of hits below 2%) the mask is first viewed as int64 words of 8
    flags: ``nonzero`` over the words finds the few words with a hit in an
    eighth of the elements, and only those are expanded.
    """
    n = mask.numel()
    if density > 0.02 or n < 4096 or mask.storage_offset() % 8:
        return mask.nonzero().view(-1)
    n8 = n - n % 8
    words = mask[:n8].view(torch.int64)
    w = words.nonzero().view(-1)
    q = words.index_select(0, w).view(torch.bool).nonzero().view(-1)
    pos = w.index_select(0, q >> 3).mul_(8).add_(q & 7)
    if n8 < n:
        pos = torch.cat([pos, mask[n8:].nonzero().view(-1) + n8])
    return pos


def _round_down(t: float, leaf_dtype: torch.dtype, dtype: torch.dtype) -> float:
    """The largest ``leaf_dtype`` value ``<= t`` (``t >= 0`` a value of the wider ``dtype``).

    For ``x`` of ``leaf_dtype``, ``|x| > t`` (compared exactly) iff ``|x| > round_down(t)``
    compared in ``leaf_dtype``, where that value is exact.
    """
    v = torch.tensor(t, dtype=dtype).to(leaf_dtype)
    if v.to(dtype).item() > t:  # rounded up: step down one representable value (v > t >= 0)
        v = (v.view(_INT_OF[leaf_dtype]) - 1).view(leaf_dtype)
    return v.item()


_SIGN_CLEAR = {torch.int16: 0x7FFF, torch.int32: 0x7FFFFFFF, torch.int64: 0x7FFFFFFFFFFFFFFF}


def column_rows(fraction: float) -> int:
    """Rows of the column view for an expected candidate fraction (1: scan directly).

    The column pass costs two read passes plus work on ``n / rows`` column
    maxima; gathering and scanning the hit columns costs about ``rows *
    fraction * n`` random reads. ``sqrt(COLUMN_BALANCE / fraction)`` balances
    the two; above ``COLUMN_MAX_FRACTION`` the direct scan is cheaper (both
    constants measured, see ``docs/topk.md``).
    """
    if fraction >= COLUMN_MAX_FRACTION:
        return 1
    rows = math.sqrt(COLUMN_BALANCE / max(fraction, 1e-12))
    return int(min(max(2 ** round(math.log2(rows)), 4), MAX_ROWS))


def _merge_sorted(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge (indices, values) pairs, each sorted by distinct indices, into one sorted pair."""
    parts = [p for p in parts if p[0].numel()]
    if len(parts) == 1:
        return parts[0]
    if len(parts) == 2:  # two binary searches instead of a sort: O(m log m) but cheap
        (ia, va), (ib, vb) = parts
        pos_a = torch.searchsorted(ib, ia).add_(torch.arange(ia.numel(), device=ia.device))
        pos_b = torch.searchsorted(ia, ib).add_(torch.arange(ib.numel(), device=ib.device))
        idx = torch.empty(ia.numel() + ib.numel(), dtype=ia.dtype, device=ia.device)
        vals = torch.empty(idx.numel(), dtype=va.dtype, device=va.device)
        idx.index_copy_(0, pos_a, ia).index_copy_(0, pos_b, ib)
        vals.index_copy_(0, pos_a, va).index_copy_(0, pos_b, vb)
        return idx, vals
    idx = torch.cat([p[0] for p in parts])
    order = torch.argsort(idx)
    return idx.index_select(0, order), torch.cat([p[1] for p in parts]).index_select(0, order)


class _Scanner:
    """Gathers the coordinates with ``|x| > t`` (and NaN) from the leaves, in flat order.

    Two ways to look at the data, both exact:

    * Direct (any candidate fraction): ``torch.nn.functional.hardshrink``
      with the threshold keeps exactly the values with ``|x| > t`` and NaN,
      zeroing the rest, in one vectorised pass into a reused buffer of
      ``SEGMENT`` elements (small leaves are packed into it together). The
      buffer is then read as int64 words (2 to 8 values each): ``nonzero``
      over the words finds the few words holding a candidate, and only those
      are kept. All segments are expanded together at the end.
    * Columns (small candidate fractions): large leaves are cut into blocks of
      ``COLUMN_BLOCK`` elements viewed as ``(rows, size // rows)`` matrices. A
      column's largest magnitude comes from ``amax(0)`` and ``amin(0)`` (two
      read-only passes; NaN propagates). One test over all blocks' columns
      finds the columns that reach above ``t``; only those are gathered and
      tested element by element.

    Extra memory: a buffer of ``SEGMENT`` elements, the column maxima
    (``n / rows`` values, ``rows >= 4``), and the candidates.
    """

    def __init__(self, t: float, dtype: torch.dtype, device: torch.device, fraction: float) -> None:
        self.t, self.dtype, self.device, self.fraction = t, dtype, device, fraction
        self.rows = column_rows(fraction)
        self.limits: dict[torch.dtype, float] = {}
        self.buffers: dict[torch.dtype, torch.Tensor] = {}
        self.words: dict[torch.dtype, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self.blocks: list[tuple[torch.Tensor, int]] = []
        self.colhits: list[torch.Tensor] = []
        self.dense: list[tuple[torch.Tensor, torch.Tensor]] = []

    def _limit(self, leaf_dtype: torch.dtype) -> float:
        """The threshold rounded down into ``leaf_dtype`` (exact there: see :func:`_round_down`)."""
        if leaf_dtype not in self.limits:
            self.limits[leaf_dtype] = _round_down(self.t, leaf_dtype, self.dtype)
        return self.limits[leaf_dtype]

    def _buffer(self, leaf_dtype: torch.dtype) -> torch.Tensor:
        if leaf_dtype not in self.buffers:
            self.buffers[leaf_dtype] = torch.empty(SEGMENT, dtype=leaf_dtype, device=self.device)
        return self.buffers[leaf_dtype]

    def direct(self, seg: torch.Tensor, start: int) -> None:
        """Scan a 1-d segment (split into pieces of at most ``SEGMENT``)."""
        if seg.numel() > SEGMENT:
            for s in range(0, seg.numel(), SEGMENT):
                self.direct(seg[s : s + SEGMENT], start + s)
            return
        m = seg.numel()
        per = 8 // seg.element_size()
        padded = -(-m // per) * per
        buf = self._buffer(seg.dtype)
        torch.ops.aten.hardshrink.out(seg, self._limit(seg.dtype), out=buf[:m])
        if self.fraction > WORDS_MAX_FRACTION:  # dense candidates: words would mostly be hits
            nz = buf[:m].nonzero().view(-1)
            if nz.numel():
                self.dense.append((nz.add(start), buf.index_select(0, nz).to(self.dtype)))
            return
        if padded > m:
            buf[m:padded].zero_()
        w = buf[:padded].view(torch.int64).nonzero().view(-1)
        if w.numel():
            words = buf[:padded].view(-1, per).index_select(0, w)  # copies: the buffer is reused
            self.words.setdefault(seg.dtype, []).append((words, w.mul_(per).add_(start)))

    def _packed(self, pending: list[torch.Tensor], start: int) -> None:
        size = sum(f.numel() for f in pending)
        buf = torch.cat(pending, out=self._buffer(pending[0].dtype)[:size]) if len(pending) > 1 else pending[0]
        # hardshrink below reads ``buf`` before writing the same buffer element-wise: safe
        self.direct(buf, start)

    def columns(self, block: torch.Tensor, start: int) -> None:
        """Column maxima of a large block (see the class docstring); its tail is scanned directly."""
        rows = self.rows
        cols = block.numel() // rows
        mat = block[: rows * cols].view(rows, cols)
        # Two stages: ATen's dim-0 reductions are fastest over few rows. Row ``a * (rows // 8) + b``
        # of ``mat`` is block ``b`` of row ``a`` of ``first``.
        stage1 = min(rows, 8)
        first = mat.view(stage1, -1)
        hi, lo = first.amax(0), first.amin(0)
        if rows > stage1:
            hi, lo = hi.view(rows // stage1, cols).amax(0), lo.view(rows // stage1, cols).amin(0)
        # a column is hit when its largest magnitude is above t (or NaN): kept as flags, 1 byte a column
        self.colhits.append(torch.le(torch.maximum(hi, lo.neg_()), self._limit(block.dtype)).logical_not_())
        self.blocks.append((mat, start))
        if rows * cols < block.numel():
            self.direct(block[rows * cols :], start + rows * cols)

    def _expand_words(self, leaf_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        parts = self.words.pop(leaf_dtype)
        words = torch.cat([p[0] for p in parts]) if len(parts) > 1 else parts[0][0]
        base = torch.cat([p[1] for p in parts]) if len(parts) > 1 else parts[0][1]
        per = words.shape[1]
        flat = words.view(-1)
        q = flat.nonzero().view(-1)
        idx = base.index_select(0, q // per).add_(q % per)
        return idx, flat.index_select(0, q).to(self.dtype)

    def _expand_columns(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Candidates of the column blocks, one sorted (indices, values) pair per leaf dtype."""
        rows = self.rows
        hit = torch.cat(self.colhits) if len(self.colhits) > 1 else self.colhits[0]
        self.colhits = []
        hit_cols = nonzero_1d(hit, 1.0 - (1.0 - self.fraction) ** rows)
        del hit
        col_offsets = [0]
        for mat, _ in self.blocks:
            col_offsets.append(col_offsets[-1] + mat.shape[1])
        bounds = torch.searchsorted(hit_cols, torch.tensor(col_offsets, device=self.device)).tolist()
        groups: dict[torch.dtype, list] = {}
        for (mat, start), off, lo, hi in zip(self.blocks, col_offsets, bounds, bounds[1:]):
            if hi > lo:
                cols = hit_cols[lo:hi] - off
                groups.setdefault(mat.dtype, []).append((mat.index_select(1, cols).view(-1), cols, start, mat.shape[1]))
        out = []
        for leaf_dtype, blocks in groups.items():
            subs = torch.cat([b[0] for b in blocks])
            # hardshrink keeps the candidates' values (|x| > t, NaN) and zeros the rest, in place
            subs = torch.ops.aten.hardshrink.out(subs, self._limit(leaf_dtype), out=subs)
            q = subs.nonzero().view(-1)
            if not q.numel():
                continue
            # per-candidate lookups of its block: (elements before it, hit columns, columns, start)
            hits = [b[1].numel() for b in blocks]
            elem_off = torch.tensor([0] + [rows * h for h in hits], device=self.device).cumsum(0)
            b = torch.searchsorted(elem_off, q, right=True) - 1
            table = torch.tensor([[h, c, s] for (_, _, s, c), h in zip(blocks, hits)], device=self.device)
            h_b, cols_b, start_b = table.index_select(0, b).unbind(1)
            local = q - elem_off.index_select(0, b)
            r = torch.div(local, h_b, rounding_mode="floor")
            col_base = torch.tensor([0] + hits, device=self.device).cumsum(0).index_select(0, b)
            col = torch.cat([blk[1] for blk in blocks]).index_select(0, col_base + local - r * h_b)
            out.append((start_b + r * cols_b + col, subs.index_select(0, q).to(self.dtype)))
        return out

    def run(self, flats: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        pending: list[torch.Tensor] = []
        pending_start = pending_size = 0
        offset = 0
        use_columns = self.rows > 1
        for f in flats:
            n = f.numel()
            big = n >= SEGMENT // 4 or (use_columns and n >= self.rows * MIN_COLUMNS)
            if n and (not big) and pending and (pending[0].dtype != f.dtype or pending_size + n > SEGMENT):
                self._packed(pending, pending_start)
                pending, pending_size = [], 0
            if big:
                if pending:
                    self._packed(pending, pending_start)
                    pending, pending_size = [], 0
                for s in range(0, n, COLUMN_BLOCK if use_columns else SEGMENT):
                    block = f[s : s + (COLUMN_BLOCK if use_columns else SEGMENT)]
                    if use_columns and block.numel() >= self.rows * MIN_COLUMNS:
                        self.columns(block, offset + s)
                    else:
                        self.direct(block, offset + s)
            elif n:
                if not pending:
                    pending_start = offset
                pending.append(f)
                pending_size += n
            offset += n
        if pending:
            self._packed(pending, pending_start)
        parts = [self._expand_words(d) for d in list(self.words)]
        if self.dense:  # in flat order, and never mixed with words or columns (both need a small fraction)
            parts.append((torch.cat([p[0] for p in self.dense]), torch.cat([p[1] for p in self.dense])))
        if self.blocks:
            parts += self._expand_columns()
        if not any(p[0].numel() for p in parts):
            empty = torch.zeros(0, dtype=torch.int64, device=self.device)
            return empty, torch.zeros(0, dtype=self.dtype, device=self.device)
        return _merge_sorted(parts)


def scan_above(
    flats: Sequence[torch.Tensor], t: float, dtype: torch.dtype, fraction: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sorted flat indices and values (in ``dtype``) of every coordinate with ``|x| > t`` (``t >= 0``) or NaN.

    Eager only; ``fraction`` is the expected share of such coordinates (it picks the scan strategy).
    """
    return _Scanner(t, dtype, flats[0].device, fraction).run(flats)


def _kth_largest(mags: torch.Tensor, k: int, t_hi: float | None) -> torch.Tensor:
    """The k-th largest of ``mags`` (0-d tensor). ``t_hi``: a value expected to have fewer than k above it."""
    m = mags.numel()
    if t_hi is not None and m > BAND_MIN:
        above = mags > t_hi
        a = int(torch.count_nonzero(above))
        if a < k:  # the k-th largest is the (k - a)-th largest of the rest: a much smaller selection
            rest = mags.index_select(0, nonzero_1d(above.logical_not_(), 1.0))
            return torch.kthvalue(rest, rest.numel() - (k - a) + 1).values
    return torch.kthvalue(mags, m - k + 1).values


def select_exact(flats: Sequence[torch.Tensor], k: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Sorted flat indices and values (in ``dtype``) of the exact top ``k``, without concatenating.

    Eager only (reads sizes and a threshold on the host). Same result as
    :func:`select_static`, for any input; the sample only decides the speed.

    Args:
        flats: The leaves, each 1-d and contiguous, in flat order, on one device.
        k: ``1 <= k <= total size``.
        dtype: The common dtype (magnitudes are compared in it; values are returned in it).
    """
    n = sum(f.numel() for f in flats)
    if n < EXACT_MIN_NUMEL or k == n:
        return select_static(flats, k, dtype)
    sample = systematic_sample(flats, sample_stride(n, SAMPLE_SIZE), dtype)
    s = sample.numel()
    p = k / n
    mean, sd = s * p, math.sqrt(s * p * (1.0 - p))
    r_lo = max(1, math.floor(mean + MARGIN * sd) + 2)  # rank (from the top) of the lower end of the bracket
    if r_lo > s:  # k is close to n: the bracket cannot exclude much
        return select_static(flats, k, dtype)
    r_hi = math.floor(mean - MARGIN * sd) - 1
    top = torch.topk(sample, r_lo).values  # sorted, largest first
    t_lo = top[r_lo - 1].item()
    if t_lo == math.inf:  # nothing ranks strictly above an infinite magnitude (NaN ranks as inf)
        return select_static(flats, k, dtype)
    t_hi = top[r_hi - 1].item() if 1 <= r_hi < r_lo else None
    idx, vals = _Scanner(t_lo, dtype, flats[0].device, r_lo / s).run(flats)
    m = idx.numel()
    if m < k:  # the sample overestimated the k-th magnitude: exact fallback
        return select_static(flats, k, dtype)
    if m == k:
        return idx, vals
    mags = _magnitudes_(vals.clone())
    t = _kth_largest(mags, k, t_hi)
    above, at = mags > t, mags == t
    if int(torch.count_nonzero(above)) + int(torch.count_nonzero(at)) == k:
        keep = above | at
    else:
        keep = _tie_mask(mags, above, at, k)
    sel = nonzero_1d(keep, 1.0)
    return idx.index_select(0, sel), vals.index_select(0, sel)


# --------------------------------------------------------------------------- approximate thresholds


def sample_threshold(
    flats: Sequence[torch.Tensor], k: int | torch.Tensor, dtype: torch.dtype, *, hits: int = 64
) -> torch.Tensor:
    """A 0-d threshold ``t`` with about ``k`` magnitudes above it, from a systematic sample.

    ``t`` is the sample magnitude with ``r = round(k * s / n)`` sample
    magnitudes above it, so the count above ``t`` is about ``k`` with a
    binomial relative spread of about ``1 / sqrt(r)``. For an int ``k`` the
    sample size ``s`` is ``hits * n / k`` clamped to ``[2**16, 2**18]`` (and to
    ``n``), so ``r >= hits`` once ``k / n >= hits / 2**18``; for a tensor ``k``
    it is ``2**16``. Static shapes, no host reads. Returns ``-1`` when ``k >= n``
    (everything is above).
    """
    n = sum(f.numel() for f in flats)
    if isinstance(k, torch.Tensor):
        sample = systematic_sample(flats, sample_stride(n, 1 << 16), dtype)
        s = sample.numel()
        k = k.to(sample.device)
        r = torch.round(k.to(torch.float64) * (s / n)).to(torch.int64).clamp(0, s - 1).reshape(1)
        t = torch.sort(sample, descending=True).values.gather(0, r).reshape(())
        return torch.where(k >= n, torch.full_like(t, -1.0), t)
    if k >= n:
        return torch.full((), -1.0, dtype=dtype, device=flats[0].device)
    target = min(max(hits * n // max(k, 1), 1 << 16), 1 << 18)
    sample = systematic_sample(flats, sample_stride(n, target), dtype)
    s = sample.numel()
    r = min(round(k * s / n), s - 1)
    if r < 4096:
        return torch.topk(sample, r + 1, sorted=False).values.min()  # the (r + 1)-th largest
    return torch.kthvalue(sample, s - r).values


def gaussian_threshold_flat(
    flats: Sequence[torch.Tensor], density: float | torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """The zero-mean Gaussian threshold for ``density`` (see :func:`functopk.gaussian_threshold`)."""
    n = sum(f.numel() for f in flats)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    norms = torch._foreach_norm(list(flats), 2, dtype=acc)
    sumsq = torch.stack(norms).to(torch.float64).square().sum()
    rms = torch.sqrt(sumsq / n)
    density = torch.as_tensor(density, dtype=torch.float64, device=rms.device).clamp(0.0, 1.0)
    z = torch.special.ndtri(1.0 - density / 2.0)
    return (rms * z).to(dtype)

