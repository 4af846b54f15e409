"""The Triton kernels of the exact global top-k (``@triton.jit``; launched by :mod:`~.triton_select`).

Imported only where Triton is installed: on a CUDA device, or on CPU tensors
under ``TRITON_INTERPRET=1`` (set before ``triton`` is first imported). The
algorithm, step by step, is in :mod:`~functopk.sparse.kernels.triton_select`
and ``docs/topk.md``; here each kernel says what it reads and writes.

Terms shared by the kernels:

* key: the order-preserving integer of ``|x|`` in the common dtype
  (:func:`~functopk.sparse.kernels.triton_reads.key_of`); ties between equal
  keys go to the lower flat index.
* a program owns ``SUB`` tiles of ``TILE`` consecutive flat indices of one
  leaf (per the leaf table; ``FLAT``: of the one flat buffer) when it reads
  the leaves (:func:`~functopk.sparse.kernels.triton_reads.leaf_tile`, in
  flat order also for a strided leaf), or tiles of the candidates (in flat
  order) when it reads those. The launches of steps 3 and 4 have the same
  programs, so what program ``q`` counted in one is what the next finds at
  ``q``: a prefix sum over ``q < p`` places program ``p``'s output in flat
  order, whatever order the programs ran in.
* ``state`` (int64): ``[0]`` the threshold key, ``[1]`` the number of
  candidates (keys above the threshold), ``[2]`` the number of ties (keys at
  it), then per radix pass ``j`` the slot ``j`` at ``[SLOT + 2 j]``:
  ``(prefix, need)``, the top ``8 j`` bits of the k-th largest key and its rank
  among the keys with those bits. Slot 0 is ``(0, k)``.
* mode: "normal" when the candidates fit their buffer and are at least ``k``
  (the radix passes and the emit read the candidates); "tied" when they fit,
  are fewer than ``k`` and the ties make up the rest (the threshold is the
  k-th largest key: no radix pass; the emit takes the first ties in flat order
  from the leaves, the candidates from their buffer); otherwise "fallback"
  (the radix passes and the emit read the leaves): the same result every way.
* every count is a sum (``atomic_add`` of counts, or a program's own slot); a
  position never depends on the order in which atomics landed.
"""

from __future__ import annotations

import triton
import triton.language as tl

from functopk.sparse.kernels.triton_reads import leaf_tile, sample_keys

__all__ = ["bracket_kernel", "compact_kernel", "digit_kernel", "emit_kernel", "order_kernel"]

NB = tl.constexpr(256)  # bins per radix digit (8 bits)
SLOT = tl.constexpr(4)  # state words before the radix slots (triton_select._STATE_HEAD)


@triton.jit
def _tile(src, table, n, n_leaves, p, s, from_leaves, ordered, start, end, ckey, cidx, cval, FLAT: tl.constexpr,
          KEY64: tl.constexpr, TILE: tl.constexpr, SUB: tl.constexpr):
    """Tile ``s`` of program ``p``: of the leaves (``from_leaves``), or of the candidates in flat order,
    positions ``start + s * TILE`` onwards, below ``end``."""
    if from_leaves:
        key, idx, val, mask = leaf_tile(src, table, n, n_leaves, p, s, ordered, FLAT, KEY64,
                                         cval.dtype.element_ty, TILE, SUB)
    else:
        offs = start + s * TILE + tl.arange(0, TILE)
        mask = offs < end
        key = tl.load(ckey + offs, mask=mask, other=0)
        idx = tl.load(cidx + offs, mask=mask, other=0)
        val = tl.load(cval + offs, mask=mask, other=0.0)
    return key, idx, val, mask


@triton.jit
def _k(k_ptr, k_int, k_dev):
    """``k``: read from ``k_ptr`` (a 0-d tensor) when ``k_dev``, else ``k_int`` (then ``k_ptr`` is any int64 word)."""
    return tl.where(k_dev != 0, tl.load(k_ptr).to(tl.int64), k_int.to(tl.int64))


@triton.jit
def _mode(state, k_ptr, k_int, k_dev, cap):
    """(k, candidates, fallback?, tied?): fallback when the candidates overflowed their buffer or fewer than
    ``k`` coordinates reached the threshold; tied when fewer than ``k`` are above it and the ties make up
    the rest (the threshold is then the k-th largest key)."""
    k = _k(k_ptr, k_int, k_dev)
    m = tl.load(state + 1)
    fallback = (m > cap) | (m + tl.load(state + 2) < k)
    return k, m, fallback, (m < k) & (fallback == 0)


@triton.jit
def _busy(p, s, from_leaves, start, end, n_programs, TILE: tl.constexpr):
    """Whether tile ``s`` of program ``p`` holds anything (the launches cover every mode's programs)."""
    return tl.where(from_leaves, p < n_programs, start + s * TILE < end)


@triton.jit
def _rank_key(keys, rank, KEY64: tl.constexpr):
    """The ``rank``-th largest of ``keys`` (non-negative; -1 marks no key): a radix select, 8 bits a pass."""
    bits: tl.constexpr = 64 if KEY64 else 32
    prefix = rank * 0
    need = rank
    for i in tl.static_range(bits // 8):
        shift = bits - 8 * (i + 1)
        high = shift + 8 if shift + 8 < bits else bits - 1
        live = (keys >= 0) & ((keys >> high) == prefix)
        d, need = _pick(tl.histogram(((keys >> shift) & 0xFF).to(tl.int32), NB, mask=live), need)
        prefix = prefix * NB + d
    return prefix


@triton.jit(do_not_specialize=["k_int", "k_dev", "n", "n_leaves"])
def bracket_kernel(src, table, state, hist, k_ptr, k_int, k_dev, n, n_leaves, margin, L: tl.constexpr,
                   FLAT: tl.constexpr, KEY64: tl.constexpr, SAMPLE: tl.constexpr):
    """Step 1 (one program): zero the counters; the candidate threshold from a systematic sample.

    Writes ``state[0]``: a key expected to have a little more than ``k`` coordinates at or above it (the
    sample's rank ``mean + margin * sd + 2`` from the top), 0 (every coordinate) when the sample cannot
    exclude anything, or the exact k-th largest key when the sample is the whole tree. Only the speed
    depends on it: too few coordinates at or above it, or too many above it, send the later kernels to
    the fallback.
    """
    k = _k(k_ptr, k_int, k_dev)
    tl.store(hist + tl.arange(0, L * NB), tl.zeros([L * NB], tl.int32))
    count = tl.minimum(n, SAMPLE)
    stride = tl.maximum(n // SAMPLE, 1)
    keys = sample_keys(src, table, n_leaves, stride, count, FLAT, KEY64, SAMPLE)
    p = k.to(tl.float64) / n
    mean = count * p
    rank = (mean + margin * tl.sqrt(mean * (1.0 - p)) + 2.0).to(tl.int64)  # truncation floors: positive
    rank = tl.where(count == n, k, tl.maximum(rank, 1))
    t = _rank_key(keys, tl.minimum(rank, count), KEY64)
    tl.store(state, tl.where(rank > count, 0, t))
    tl.store(state + 1, 0)
    tl.store(state + 2, 0)
    tl.store(state + SLOT, 0)
    tl.store(state + SLOT + 1, k)


@triton.jit(do_not_specialize=["n", "n_leaves", "cap"])
def compact_kernel(src, table, state, rec_base, rec_cnt, totals, tie_totals, skey, sidx, sval, n, n_leaves, cap,
                   FLAT: tl.constexpr, KEY64: tl.constexpr, TILE: tl.constexpr, SUB: tl.constexpr):
    """Step 2 (the one full read): every coordinate whose key is above ``state[0]`` becomes a candidate.

    Per tile, the candidates are packed in flat order (a cumulative sum of the keep flags) into
    ``skey``, ``sidx`` and ``sval`` (key, flat index, value in the common dtype) at a base that one
    ``atomic_add`` on the candidate count ``state[1]`` reserves. Which tile gets which base depends on
    the order of the atomics, so each tile's base and count are recorded (``rec_base``, ``rec_cnt``)
    and each program's total (``totals``): :func:`order_kernel` then lays them out in flat order.
    Candidates beyond ``cap`` are counted but not written (the later kernels then fall back). The
    coordinates at the threshold are counted, per program (``tie_totals``) and in all (``state[2]``).
    """
    p = tl.program_id(0)
    threshold = tl.load(state)
    total = 0
    tied = p * 0  # (a tensor: counted in the loop)
    for s in range(SUB):
        key, idx, val, mask = leaf_tile(src, table, n, n_leaves, p, s, 1, FLAT, KEY64,
                                         sval.dtype.element_ty, TILE, SUB)
        keep = mask & (key > threshold)
        tied += tl.sum((mask & (key == threshold)).to(tl.int32), 0)
        count = tl.sum(keep.to(tl.int32), 0)
        base = tl.atomic_add(state + 1, count.to(tl.int64), mask=count > 0, sem="relaxed")
        base = tl.where(count > 0, base, 0)
        pos = base + (tl.cumsum(keep.to(tl.int32), 0) - 1).to(tl.int64)
        ok = keep & (pos < cap)
        tl.store(skey + pos, key, mask=ok)
        tl.store(sidx + pos, idx, mask=ok)
        tl.store(sval + pos, val, mask=ok)
        tl.store(rec_base + p * SUB + s, base)
        tl.store(rec_cnt + p * SUB + s, count)
        total += count
    tl.store(totals + p, total)
    tl.store(tie_totals + p, tied)
    tl.atomic_add(state + 2, tied.to(tl.int64), mask=tied > 0, sem="relaxed")


@triton.jit
def _sum_before(values, p, QB: tl.constexpr):
    """``values[0] + ... + values[p - 1]`` (int64; a ``while`` loop: Triton 3.6's interpreter cannot bound a
    ``for`` loop by a runtime value)."""
    acc = tl.zeros([QB], tl.int64)
    q0 = p * 0
    while q0 < p:
        q = q0 + tl.arange(0, QB)
        acc += tl.load(values + q, mask=q < p, other=0).to(tl.int64)
        q0 += QB
    return tl.sum(acc, 0)


@triton.jit(do_not_specialize=["k_int", "k_dev", "cap"])
def order_kernel(state, rec_base, rec_cnt, totals, skey, sidx, sval, ckey, cidx, cval, k_ptr, k_int, k_dev, cap,
                 TILE: tl.constexpr, SUB: tl.constexpr):
    """Step 2b: the candidates copied into ``ckey``, ``cidx``, ``cval`` in flat order (normal mode only).

    Program ``p`` starts after the candidates of the programs before it (a sum of ``totals``) and copies
    its tiles' candidates in tile order: the layout depends on the data only, never on the atomics.
    """
    p = tl.program_id(0)
    k, m, fallback, tied = _mode(state, k_ptr, k_int, k_dev, cap)
    if fallback == 0:
        out = _sum_before(totals, p, 512)
        for s in range(SUB):
            count = tl.load(rec_cnt + p * SUB + s)
            if count > 0:
                base = tl.load(rec_base + p * SUB + s)
                j = tl.arange(0, TILE)
                ok = j < count
                tl.store(ckey + out + j, tl.load(skey + base + j, mask=ok), mask=ok)
                tl.store(cidx + out + j, tl.load(sidx + base + j, mask=ok), mask=ok)
                tl.store(cval + out + j, tl.load(sval + base + j, mask=ok), mask=ok)
                out += count


@triton.jit
def _pick(h, need):
    """The digit holding the ``need``-th largest key of a 256-bin histogram ``h``, and its rank among that digit's.

    The largest digit ``d`` with at least ``need`` keys at or above it holds it; the keys above ``d``
    are subtracted from ``need``.
    """
    h = h.to(tl.int64)
    at_least = tl.sum(h, 0) - tl.cumsum(h, 0) + h
    d = tl.sum((at_least >= need).to(tl.int32), 0) - 1
    return d, need - tl.sum(tl.where(tl.arange(0, NB) > d, h, 0), 0)


@triton.jit
def _find(state, hist, j):
    """``(prefix, need)`` of slot ``j``: digit ``j`` of the k-th largest key, from slot ``j - 1`` and histogram ``j``.

    ``need`` is the rank of the k-th largest key among the keys whose digits 1 to ``j`` equal the prefix.
    """
    prefix = tl.load(state + SLOT + 2 * (j - 1))  # slot j - 1
    d, need = _pick(tl.load(hist + (j - 1) * NB + tl.arange(0, NB)), tl.load(state + SLOT + 2 * j - 1))
    return prefix * NB + d, need


@triton.jit
def _prefix_of(state, hist, j):
    """Slot ``j - 1`` for radix pass ``j`` (1-based): computed from pass ``j - 1``'s histogram, and stored by
    program 0 for the next pass (pass ``j - 1`` has finished: its histogram is complete)."""
    if j == 1:
        prefix = tl.load(state + SLOT)
        need = tl.load(state + SLOT + 1)
    else:
        prefix, need = _find(state, hist, j - 1)
        if tl.program_id(0) == 0:
            tl.store(state + SLOT + 2 * (j - 1), prefix)
            tl.store(state + SLOT + 2 * (j - 1) + 1, need)
    return prefix, need


@triton.jit(do_not_specialize=["k_int", "k_dev", "n", "n_leaves", "n_programs", "cap", "j"])
def digit_kernel(src, table, state, hist, ckey, cidx, cval, above_rows, digit_rows, k_ptr, k_int, k_dev, n,
                 n_leaves, n_programs, cap, j, FLAT: tl.constexpr, KEY64: tl.constexpr,
                 L: tl.constexpr, TILE: tl.constexpr, SUB: tl.constexpr):
    """Step 3, radix pass ``j`` (of ``L``, 8 bits each from the top): the histogram of digit ``j``.

    Over the keys whose digits 1 to ``j - 1`` equal the prefix of slot ``j - 1`` (the candidates in
    normal mode, every coordinate in fallback, none when tied), each program counts digit ``j`` (``tl.histogram``) and
    adds its counts to ``hist`` row ``j - 1`` with ``atomic_add``. The last pass also writes, per
    program, its keys above the prefix (``above_rows``) and, for every last digit ``d``, its keys with
    the prefix and a last digit of at least ``d`` (``digit_rows``): what the emit kernel needs to place
    each program's output.
    """
    p = tl.program_id(0)
    k, m, fallback, tied = _mode(state, k_ptr, k_int, k_dev, cap)
    prefix, need = _prefix_of(state, hist, j)
    start = p.to(tl.int64) * TILE  # normal mode: tile p of the candidates
    end = tl.where(tied, start, tl.minimum(m, start + TILE))
    bits: tl.constexpr = 64 if KEY64 else 32
    shift = bits - 8 * j
    high = tl.minimum(shift + 8, bits - 1)  # the bits above digit j (pass 1: only the sign bit, always 0)
    local = tl.zeros([NB], tl.int32)
    above = 0
    for s in range(SUB):
        if _busy(p, s, fallback, start, end, n_programs, TILE):  # (only the last pass needs the flat order)
            key, idx, val, mask = _tile(src, table, n, n_leaves, p, s, fallback, j == L, start, end, ckey, cidx,
                                        cval, FLAT, KEY64, TILE, SUB)
            top = key >> high
            live = mask & (top == prefix)
            local += tl.histogram(((key >> shift) & 0xFF).to(tl.int32), NB, mask=live)
            above += tl.sum((mask & (top > prefix)).to(tl.int32), 0)
    tl.atomic_add(hist + (j - 1) * NB + tl.arange(0, NB), local, mask=local > 0, sem="relaxed")
    if j == L:
        tl.store(above_rows + p, above)
        tl.store(digit_rows + p * NB + tl.arange(0, NB), tl.sum(local, 0) - tl.cumsum(local, 0) + local)


@triton.jit
def _before(above_rows, digit_rows, p, d, QB: tl.constexpr):
    """Keys above the k-th largest and keys tied with it (last digit ``d``) in the programs before ``p``.

    """
    above = tl.zeros([QB], tl.int64)
    ties = tl.zeros([QB], tl.int64)
    q0 = p * 0
    while q0 < p:
        q = q0 + tl.arange(0, QB)
        ok = q < p
        at_d = tl.load(digit_rows + q * NB + d, mask=ok, other=0).to(tl.int64)
        past_d = tl.load(digit_rows + q * NB + d + 1, mask=ok & (d + 1 < NB), other=0).to(tl.int64)
        above += tl.load(above_rows + q, mask=ok, other=0).to(tl.int64) + past_d
        ties += at_d - past_d
        q0 += QB
    return tl.sum(above, 0), tl.sum(ties, 0)


@triton.jit
def _emit_source(state, hist, above_rows, digit_rows, totals, tie_totals, p, k, m, fallback, tied, n_programs,
                 L: tl.constexpr, TILE: tl.constexpr):
    """What program ``p`` of the emit reads and keeps: ``(t, need, above_before, ties_before, from_leaves,
    start, end)``: the k-th largest key, the ties at it to keep, the keys above it and the ties at it in
    flat order before the program's, and its tiles (the leaves', or candidates ``start`` to ``end``)."""
    if tied:  # the threshold is the k-th largest key: every candidate, and its first k - m ties
        t = tl.load(state)
        need = k - m
        q = tl.minimum(p, n_programs)
        above_before = _sum_before(totals, q, 512)
        ties_before = _sum_before(tie_totals, q, 512)
        from_leaves = (p < n_programs) & (ties_before < need)  # ties to keep: read them from the leaves
        start = above_before  # else this program's candidates (order_kernel put them there)
        end = above_before + tl.load(totals + p, mask=p < n_programs, other=0).to(tl.int64)
    else:
        t, need = _find(state, hist, L)
        above_before, ties_before = _before(above_rows, digit_rows, p, (t & 0xFF).to(tl.int32), 512)
        from_leaves = fallback
        start = p.to(tl.int64) * TILE  # normal mode: tile p of the candidates
        end = tl.minimum(m, start + TILE)
    return t, need, above_before, ties_before, from_leaves, start, end


@triton.jit(do_not_specialize=["k_int", "k_dev", "write", "n", "n_leaves", "n_programs", "cap"])
def emit_kernel(src, table, state, hist, ckey, cidx, cval, above_rows, digit_rows, k_ptr, k_int, k_dev, totals,
                tie_totals, out_idx, out_val, out_mask, out_dense, write, n, n_leaves, n_programs, cap,
                FLAT: tl.constexpr, KEY64: tl.constexpr, L: tl.constexpr, TILE: tl.constexpr, SUB: tl.constexpr):
    """Step 4: with the k-th largest key ``t`` known, keep every key above it and the first ``need`` ties.

    Each program learns how many keys above ``t`` and ties at ``t`` come before it in flat order (a sum
    over the programs before it: of the last radix pass's rows, or when tied of the compact counts),
    then walks its tiles in flat order: a tie is kept while fewer than ``need`` ties precede it, and
    every kept coordinate's rank is the number of kept ones before it. When tied, only the programs
    whose leaves hold kept ties read their leaves; the others copy their candidates, all kept. Outputs,
    by ``write``: 0, the sorted flat indices and values (exactly ``k``, each at its rank); 1, a flat
    mask; 2, the values scattered into a zeroed flat buffer.
    """
    p = tl.program_id(0)
    k, m, fallback, tied = _mode(state, k_ptr, k_int, k_dev, cap)
    t, need, above_before, ties_before, from_leaves, start, end = _emit_source(
        state, hist, above_rows, digit_rows, totals, tie_totals, p, k, m, fallback, tied, n_programs, L, TILE)
    for s in range(SUB):
        if _busy(p, s, from_leaves, start, end, n_programs, TILE):
            key, idx, val, mask = _tile(src, table, n, n_leaves, p, s, from_leaves, 1, start, end, ckey, cidx, cval,
                                        FLAT, KEY64, TILE, SUB)
            above = (mask & (key > t)).to(tl.int32)
            tie = (mask & (key == t)).to(tl.int32)
            ties_ex = ties_before + (tl.cumsum(tie, 0) - tie).to(tl.int64)
            keep = (above > 0) | ((tie > 0) & (ties_ex < need))
            if write == 0:
                pos = above_before + (tl.cumsum(above, 0) - above).to(tl.int64) + tl.minimum(ties_ex, need)
                tl.store(out_idx + pos, idx, mask=keep)
                tl.store(out_val + pos, val, mask=keep)
            if write == 1:
                tl.store(out_mask + idx, tl.full([TILE], 1, tl.uint8), mask=keep)
            if write == 2:
                tl.store(out_dense + idx, val, mask=keep)
            above_before += tl.sum(above, 0).to(tl.int64)
            ties_before += tl.sum(tie, 0).to(tl.int64)
