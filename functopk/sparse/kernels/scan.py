"""The candidate scan: every coordinate with ``|x| > t`` (or NaN), in flat order, without concatenating the leaves.

The heart of the eager exact kernel (:mod:`functopk.sparse.kernels.exact`), also
used to gather the coordinates above an approximate threshold. Eager only: it
reads sizes on the host and produces data-dependent shapes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from functopk.sparse.config import DEFAULT_CONFIG, KernelConfig
from functopk.sparse.kernels import native
from functopk.sparse.kernels.base import nonzero_1d, round_down

__all__ = ["Abandoned", "Scanner", "column_rows", "merge_sorted", "scan_above"]


class Abandoned(Exception):
    """Raised inside a :class:`Scanner` when it finds more candidates than its ``limit`` allows."""


def column_rows(fraction: float, config: KernelConfig = DEFAULT_CONFIG) -> int:
    """Rows of the column view for an expected candidate fraction (1: scan directly).

    The column pass costs two read passes plus work on ``n / rows`` column
    maxima; gathering and scanning the hit columns costs about ``rows *
    fraction * n`` random reads. ``sqrt(column_balance / fraction)`` balances
    the two; above ``column_max_fraction`` the direct scan is cheaper (both
    constants measured, see ``docs/topk.md``).

    Example:
        >>> column_rows(1e-4), column_rows(0.01)
        (64, 1)
    """
    if fraction >= config.column_max_fraction:
        return 1
    rows = math.sqrt(config.column_balance / max(fraction, 1e-12))
    return int(min(max(2 ** round(math.log2(rows)), 4), config.max_rows))


def merge_sorted(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge (indices, values) pairs, each sorted by distinct indices, into one sorted pair.

    Example:
        >>> import torch
        >>> merge_sorted([(torch.tensor([0, 5]), torch.tensor([1.0, 2.0])), (torch.tensor([3]), torch.tensor([9.0]))])
        (tensor([0, 3, 5]), tensor([1., 9., 2.]))
    """
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


class Scanner:
    """Gathers the coordinates with ``|x| > t`` (and NaN) from the leaves, in flat order.

    Two ways to look at the data, both exact:

    * Direct (any candidate fraction): ``torch.nn.functional.hardshrink``
      with the threshold keeps exactly the values with ``|x| > t`` and NaN,
      zeroing the rest, in one vectorised pass into a reused buffer of
      ``config.segment`` elements (small leaves are packed into it together).
      The buffer is then read as int64 words (2 to 8 values each): ``nonzero``
      over the words finds the few words holding a candidate, and only those
      are kept. All segments are expanded together at the end.
    * Columns (small candidate fractions): large leaves are cut into blocks of
      ``config.column_block`` elements viewed as ``(rows, size // rows)``
      matrices. A column's largest magnitude comes from ``amax(0)`` and
      ``amin(0)`` (two read-only passes; NaN propagates). One test over all
      blocks' columns finds the columns that reach above ``t``; only those are
      gathered and tested element by element.

    Extra memory: a buffer of ``config.segment`` elements, the column maxima
    (``n / rows`` values, ``rows >= 4``), and the candidates.

    With a ``limit``, the scanner counts candidates as it goes (hit words of
    the direct scan, hit columns, then the exact counts, all sizes it knows
    anyway) and raises :class:`Abandoned` as soon as that count exceeds the
    limit, so a misleading threshold never builds a huge candidate set.

    Example:
        >>> import torch
        >>> Scanner(1.5, torch.float32, torch.device("cpu"), 0.5).run([torch.tensor([1.0, -2.0]), torch.tensor([3.0])])
        (tensor([1, 2]), tensor([-2.,  3.]))
    """

    def __init__(
        self,
        t: float,
        dtype: torch.dtype,
        device: torch.device,
        fraction: float,
        config: KernelConfig = DEFAULT_CONFIG,
        limit: float = math.inf,
    ) -> None:
        self.t, self.dtype, self.device, self.fraction, self.config = t, dtype, device, fraction, config
        self.limit, self.found = limit, 0
        self.rows = column_rows(fraction, config)
        self.limits: dict[torch.dtype, float] = {}
        self.buffers: dict[torch.dtype, torch.Tensor] = {}
        self.words: dict[torch.dtype, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self.blocks: list[tuple[torch.Tensor, int]] = []
        self.colhits: list[torch.Tensor] = []
        self.dense: list[tuple[torch.Tensor, torch.Tensor]] = []

    def _count(self, hits: int) -> None:
        """Add ``hits`` (a lower bound on new candidates) to the running count; abandon above the limit."""
        self.found += hits
        if self.found > self.limit:
            raise Abandoned(f"more than {self.limit:.0f} candidates above {self.t}")

    def _limit(self, leaf_dtype: torch.dtype) -> float:
        """The threshold rounded down into ``leaf_dtype`` (exact there: see :func:`round_down`)."""
        if leaf_dtype not in self.limits:
            self.limits[leaf_dtype] = round_down(self.t, leaf_dtype, self.dtype)
        return self.limits[leaf_dtype]

    def _buffer(self, leaf_dtype: torch.dtype) -> torch.Tensor:
        if leaf_dtype not in self.buffers:
            self.buffers[leaf_dtype] = torch.empty(self.config.segment, dtype=leaf_dtype, device=self.device)
        return self.buffers[leaf_dtype]

    def direct(self, seg: torch.Tensor, start: int) -> None:
        """Scan a 1-d segment (split into pieces of at most ``config.segment``)."""
        segment = self.config.segment
        if seg.numel() > segment:
            for s in range(0, seg.numel(), segment):
                self.direct(seg[s : s + segment], start + s)
            return
        m = seg.numel()
        per = 8 // seg.element_size()  # values per int64 word
        padded = -(-m // per) * per  # m rounded up to whole words
        buf = self._buffer(seg.dtype)
        # Step I: candidates keep their value, every other coordinate becomes +0 (all bits 0)
        torch.ops.aten.hardshrink.out(seg, self._limit(seg.dtype), out=buf[:m])
        if self.fraction > self.config.words_max_fraction:  # dense candidates: words would mostly be hits
            # Step II, dense: the non-zero values are the candidates
            nz = buf[:m].nonzero().view(-1)
            self._count(nz.numel())
            if nz.numel():
                self.dense.append((nz.add(start), buf.index_select(0, nz).to(self.dtype)))
            return
        if padded > m:
            buf[m:padded].zero_()  # the last word's padding must read as "no candidate"
        # Step II, sparse: a word is hit when one of its values is a candidate (non-zero bits); few are
        hit_words = buf[:padded].view(torch.int64).nonzero().view(-1)
        self._count(hit_words.numel())
        if hit_words.numel():
            words = buf[:padded].view(-1, per).index_select(0, hit_words)  # copies: the buffer is reused
            # Step III: keep the hit words and the flat index of each one's first value (see _expand_words)
            self.words.setdefault(seg.dtype, []).append((words, hit_words.mul_(per).add_(start)))

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
        """The candidates inside the hit words of the direct scan: sorted (indices, values)."""
        parts = self.words.pop(leaf_dtype)
        words = torch.cat([p[0] for p in parts]) if len(parts) > 1 else parts[0][0]  # (hit words, per)
        first = torch.cat([p[1] for p in parts]) if len(parts) > 1 else parts[0][1]  # flat index of each word
        per = words.shape[1]
        flat = words.view(-1)
        pos = flat.nonzero().view(-1)  # candidates' positions among the hit words' values
        self._count(pos.numel() - words.shape[0])  # the exact count replaces the count of hit words
        # value ``pos`` is value ``pos % per`` of hit word ``pos // per`` (``per`` a power of 2: shifts)
        shift = per.bit_length() - 1
        idx = first.index_select(0, pos >> shift).add_(pos & (per - 1)) if shift else first.index_select(0, pos)
        return idx, flat.index_select(0, pos).to(self.dtype)

    def _expand_columns(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Candidates of the column blocks, one sorted (indices, values) pair per leaf dtype.

        Block ``mat`` views the leaf from flat index ``start`` as ``(rows, n_cols)``, so its element
        ``(row, col)`` is flat index ``start + row * n_cols + col``. Only its hit columns are read:
        gathered as a ``(rows, width)`` matrix, ``width`` its number of hit columns.
        """
        rows = self.rows
        # Step I: the hit columns of all blocks, numbered block after block, ascending
        hit = torch.cat(self.colhits) if len(self.colhits) > 1 else self.colhits[0]
        self.colhits = []
        # a column of ``rows`` coordinates is hit with probability about 1 - (1 - fraction) ** rows
        hit_cols = nonzero_1d(hit, 1.0 - (1.0 - self.fraction) ** rows)
        del hit
        self._count(hit_cols.numel())  # each hit column holds at least one candidate
        # Step II: per block, gather its hit columns (block i holds columns first_col[i] to first_col[i + 1] - 1)
        first_col = [0]
        for mat, _ in self.blocks:
            first_col.append(first_col[-1] + mat.shape[1])
        bounds = torch.searchsorted(hit_cols, torch.tensor(first_col, device=self.device)).tolist()
        groups: dict[torch.dtype, list] = {}
        for (mat, start), off, lo, hi in zip(self.blocks, first_col, bounds, bounds[1:]):
            if hi > lo:
                cols = hit_cols[lo:hi] - off  # the block's own column numbers
                # row-major: gathered element (row, j) lands at row * width + j
                groups.setdefault(mat.dtype, []).append((mat.index_select(1, cols).view(-1), cols, start, mat.shape[1]))
        out = []
        # Step III: per leaf dtype, keep the candidates among the gathered elements and find their flat indices
        for leaf_dtype, blocks in groups.items():
            gathered = torch.cat([b[0] for b in blocks])
            # hardshrink keeps the candidates' values (|x| > t, NaN) and zeros the rest, in place
            gathered = torch.ops.aten.hardshrink.out(gathered, self._limit(leaf_dtype), out=gathered)
            pos = gathered.nonzero().view(-1)  # candidates' positions in ``gathered``
            widths = [b[1].numel() for b in blocks]  # hit columns per block
            self._count(pos.numel() - sum(widths))  # the exact count replaces the count of hit columns
            if not pos.numel():
                continue
            # the blocks' gathers lie end to end in ``gathered``: find each candidate's block
            gather_start = torch.tensor([0] + [rows * w for w in widths], device=self.device).cumsum(0)
            block = torch.searchsorted(gather_start, pos, right=True) - 1
            # per candidate, from its block: the gather's width, the view's n_cols, and the flat start
            table = torch.tensor([[w, c, s] for (_, _, s, c), w in zip(blocks, widths)], device=self.device)
            width, n_cols, block_start = table.index_select(0, block).unbind(1)
            local = pos - gather_start.index_select(0, block)  # position in its block's gather
            row = torch.div(local, width, rounding_mode="floor")  # its row of the block's view
            # local - row * width is j, its place among the block's hit columns, whose numbers start at
            # first_hit in the blocks' ``cols`` laid end to end
            first_hit = torch.tensor([0] + widths, device=self.device).cumsum(0).index_select(0, block)
            col = torch.cat([blk[1] for blk in blocks]).index_select(0, first_hit + local - row * width)
            out.append((block_start + row * n_cols + col, gathered.index_select(0, pos).to(self.dtype)))
        return out

    def _scan(self, flats: Sequence[torch.Tensor]) -> None:
        """Feed every leaf to the direct scan (packing small ones) or to the column pass."""
        segment, block_size = self.config.segment, self.config.column_block
        pending: list[torch.Tensor] = []
        pending_start = pending_size = 0
        offset = 0
        use_columns = self.rows > 1
        for f in flats:
            n = f.numel()
            big = n >= segment // 4 or (use_columns and n >= self.rows * self.config.min_columns)
            if n and (not big) and pending and (pending[0].dtype != f.dtype or pending_size + n > segment):
                self._packed(pending, pending_start)
                pending, pending_size = [], 0
            if big:
                if pending:
                    self._packed(pending, pending_start)
                    pending, pending_size = [], 0
                step = block_size if use_columns else segment
                for s in range(0, n, step):
                    block = f[s : s + step]
                    if use_columns and block.numel() >= self.rows * self.config.min_columns:
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

    def _native(self, flats: Sequence[torch.Tensor], lib) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The compiled scan (:mod:`~functopk.sparse.kernels.native`): one sorted pair per leaf dtype.

        Each leaf dtype has an output (indices, values in the leaf dtype) sized
        for the expected candidates; a full output is kept as a chunk and a twice
        larger one continues the leaf. The output offered is never more than one
        past the limit, so an abandoned scan stops at its limit + 1.
        """
        sizes: dict[torch.dtype, int] = {}
        for f in flats:
            sizes[f.dtype] = sizes.get(f.dtype, 0) + f.numel()
        outs: dict[torch.dtype, list] = {}  # leaf dtype -> [full chunks, (indices, values), used, threshold bits]
        offset = 0
        for f in flats:
            n, read = f.numel(), 0
            if n and f.dtype not in outs:
                cap = min(sizes[f.dtype], int(1.25 * self.fraction * sizes[f.dtype]) + 4096)
                t_bits = native.threshold_bits(self._limit(f.dtype), f.dtype)
                outs[f.dtype] = [[], (torch.empty(cap, dtype=torch.int64), torch.empty(cap, dtype=f.dtype)), 0, t_bits]
            while read < n:
                out = outs[f.dtype]
                room = out[1][0].numel() - out[2]
                if room == 0:  # full: keep it, continue in a twice larger output
                    out[0].append(out[1])
                    cap = 2 * sum(c[0].numel() for c in out[0])
                    out[1], out[2] = (torch.empty(cap, dtype=torch.int64), torch.empty(cap, dtype=f.dtype)), 0
                    continue
                room = int(min(room, self.limit - self.found + 1))
                written, done = native.scan_leaf(lib, f[read:] if read else f, out[3], offset + read, out[1], out[2],
                                                 room)
                out[2] += written
                read += done
                self._count(written)
            offset += n
        parts = []
        for chunks, (idx, vals), used, _ in outs.values():
            chunks.append((idx[:used], vals[:used]))
            idx = torch.cat([c[0] for c in chunks]) if len(chunks) > 1 else chunks[0][0]
            vals = torch.cat([c[1] for c in chunks]) if len(chunks) > 1 else chunks[0][1]
            parts.append((idx, vals.to(self.dtype)))
        return parts

    def run(self, flats: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Sorted flat indices and values (in ``dtype``) of the candidates; :class:`Abandoned` above ``limit``."""
        lib = native.library() if self.config.native and self.device.type == "cpu" and self.t >= 0 else None
        if lib is not None:  # the compiled scan: the same candidates (``t >= 0`` is False for NaN)
            parts = self._native([f if f.is_contiguous() else f.contiguous() for f in flats], lib)
            return self._merged(parts)
        self._scan(flats)
        parts = [self._expand_words(d) for d in list(self.words)]
        if self.dense:  # in flat order, and never mixed with words or columns (both need a small fraction)
            parts.append((torch.cat([p[0] for p in self.dense]), torch.cat([p[1] for p in self.dense])))
        if self.blocks:
            parts += self._expand_columns()
        return self._merged(parts)

    def _merged(self, parts: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
        if not any(p[0].numel() for p in parts):
            empty = torch.zeros(0, dtype=torch.int64, device=self.device)
            return empty, torch.zeros(0, dtype=self.dtype, device=self.device)
        return merge_sorted(parts)


def scan_above(
    flats: Sequence[torch.Tensor], t: float, dtype: torch.dtype, fraction: float, config: KernelConfig = DEFAULT_CONFIG
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sorted flat indices and values (in ``dtype``) of every coordinate with ``|x| > t`` (``t >= 0``) or NaN.

    Eager only; ``fraction`` is the expected share of such coordinates (it picks the scan strategy).

    Example:
        >>> import torch
        >>> scan_above([torch.tensor([0.5, float("nan"), -3.0])], 1.0, torch.float32, 0.5)
        (tensor([1, 2]), tensor([nan, -3.]))
    """
    return Scanner(t, dtype, flats[0].device, fraction, config).run(flats)
