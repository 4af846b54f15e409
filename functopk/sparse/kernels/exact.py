"""The eager exact kernel: the exact top-k as sorted flat indices and values, without concatenating the leaves.

A systematic sample brackets the k-th magnitude; one scan over the leaves
(:class:`~functopk.sparse.kernels.scan.Scanner`) gathers the candidates above
the lower end of the bracket; an exact selection among the candidates finishes
the job. The sample only decides the speed, never the result: if it was
misleading the kernel falls back to the static kernel, both when the scan finds
too few candidates (fewer than ``k``) and, early, when it finds far more than
the bracket predicts (see :attr:`~functopk.sparse.KernelConfig.abandon_min`), so
a misleading sample costs at most about the static kernel. Data-dependent sizes
and host reads: eager mode only.
"""

from __future__ import annotations

import ctypes
import dataclasses
import math
from collections.abc import Sequence

import torch

from functopk.sparse.config import DEFAULT_CONFIG, KernelConfig
from functopk.sparse.kernels import native
from functopk.sparse.kernels.approx import sample_stride, systematic_sample
from functopk.sparse.kernels.base import INT_OF, magnitudes_, nonzero_1d
from functopk.sparse.kernels.scan import Abandoned, Scanner
from functopk.sparse.kernels.static import select_static, tie_mask

__all__ = ["ExactStats", "select_exact"]


@dataclasses.dataclass
class ExactStats:
    """What one call of :func:`select_exact` did (filled in when passed; for tests and benchmarks).

    Attributes:
        path: ``"static"`` (small tree, ``k`` close to ``n`` or an infinite
            bracket: the static kernel directly), ``"scan"`` (the sampled bracket
            held), ``"too-few"`` (fewer than ``k`` candidates: static fallback) or
            ``"abandoned"`` (far more candidates than the bracket predicts: the
            scan stopped early, static fallback).
        candidates: Candidates found by the scan (at least this many when abandoned; -1 without a scan).
        limit: The candidate count above which the scan is abandoned (0 without a scan).

    Example:
        >>> import torch
        >>> stats = ExactStats()
        >>> _ = select_exact([torch.randn(1000)], 5, torch.float32, stats=stats)
        >>> stats.path
        'static'
    """

    path: str = ""
    candidates: int = -1
    limit: float = 0.0


def _kth_largest(mags: torch.Tensor, k: int, t_hi: float | None, band_min: int) -> torch.Tensor:
    """The k-th largest of ``mags`` (0-d tensor). ``t_hi``: a value expected to have fewer than k above it."""
    m = mags.numel()
    if t_hi is not None and m > band_min:
        above = mags > t_hi
        a = int(torch.count_nonzero(above))
        if a < k:  # the k-th largest is the (k - a)-th largest of the rest: a much smaller selection
            rest = mags.index_select(0, nonzero_1d(above.logical_not_(), 1.0))
            return torch.kthvalue(rest, rest.numel() - (k - a) + 1).values
    return torch.kthvalue(mags, m - k + 1).values


def _top_k_native(lib: ctypes.CDLL, idx: torch.Tensor, vals: torch.Tensor, k: int, t_hi: float | None, band_min: int):
    """:func:`top_k_of_candidates` with the compiled scan doing the compares and the compaction.

    The candidates' magnitudes are compared as bit patterns (see
    :mod:`~functopk.sparse.kernels.native`; NaN lies above ``+inf`` there, as it
    ranks here). Every candidate is above the bracket's lower end ``>= 0``, so
    none has all magnitude bits 0, and "above 0" selects every candidate.
    Returns ``None`` when ties straddle the k-th magnitude (the ATen path then
    picks the first of them in flat order).
    """
    m, dtype = vals.numel(), vals.dtype

    def scan(lo: int, hi: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        out = torch.empty(m, dtype=torch.int64), torch.empty(m, dtype=dtype)
        written, _ = native.scan_leaf(lib, vals, lo, 0, out, upper_bits=hi)
        return out[0][:written], out[1][:written]

    if t_hi is not None and m > band_min and math.isfinite(t_hi):
        # the candidates at most t_hi: a few percent of them, and the k-th largest is among them if fewer
        # than k are above t_hi
        band = scan(0, native.threshold_bits(t_hi, dtype))[1]
        a = m - band.numel()
        mags = magnitudes_(band) if a < k else magnitudes_(vals.clone())
        t = torch.kthvalue(mags, mags.numel() - (k - a) + 1 if a < k else m - k + 1).values
    else:
        t = torch.kthvalue(magnitudes_(vals.clone()), m - k + 1).values
    # magnitudes >= t, i.e. bits above bits(t) - 1 (t > 0: it is a candidate's magnitude)
    pos, kept = scan(int(t.view(INT_OF[dtype]).item()) - 1)
    if pos.numel() != k:
        return None
    return idx.index_select(0, pos), kept


def top_k_of_candidates(
    idx: torch.Tensor, vals: torch.Tensor, k: int, t_hi: float | None, band_min: int, lib: ctypes.CDLL | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact top ``k`` among ``m > k`` sorted candidates (ties: first in flat order).

    ``lib``: the compiled scan (:func:`~functopk.sparse.kernels.native.library`), or ``None`` for ATen only.
    """
    if lib is not None and (out := _top_k_native(lib, idx, vals, k, t_hi, band_min)) is not None:
        return out
    mags = magnitudes_(vals.clone())
    t = _kth_largest(mags, k, t_hi, band_min)
    keep = mags >= t  # no NaN among the magnitudes: ``>=`` is ``above | at``
    if int(torch.count_nonzero(keep)) != k:  # ties at the k-th magnitude: the first ones in flat order
        keep = tie_mask(mags > t, mags == t, k)
    sel = nonzero_1d(keep, 1.0)
    return idx.index_select(0, sel), vals.index_select(0, sel)


def select_exact(
    flats: Sequence[torch.Tensor],
    k: int,
    dtype: torch.dtype,
    config: KernelConfig = DEFAULT_CONFIG,
    *,
    stats: ExactStats | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sorted flat indices and values (in ``dtype``) of the exact top ``k``, without concatenating.

    Eager only (reads sizes and a threshold on the host). Same result as
    :func:`~functopk.sparse.kernels.static.select_static`, for any input; the
    sample only decides the speed, and a misleading one costs at most about
    the static kernel (see the module docstring).

    Args:
        flats: The leaves, each 1-d and contiguous, in flat order, on one device.
        k: ``1 <= k <= total size``.
        dtype: The common dtype (magnitudes are compared in it; values are returned in it).
        config: The tuning constants.
        stats: Filled in with the path taken, when given.

    Example:
        >>> import torch
        >>> select_exact([torch.tensor([0.5, -4.0]), torch.tensor([2.0])], 2, torch.float32)
        (tensor([1, 2]), tensor([-4.,  2.]))
    """
    stats = ExactStats() if stats is None else stats
    stats.path = "static"
    n = sum(f.numel() for f in flats)
    if n < config.exact_min_numel or k == n:
        return select_static(flats, k, dtype)
    sample = systematic_sample(flats, sample_stride(n, config.sample_size), dtype)
    s = sample.numel()
    p = k / n
    mean, sd = s * p, math.sqrt(s * p * (1.0 - p))
    r_lo = max(1, math.floor(mean + config.margin * sd) + 2)  # rank (from the top) of the lower end of the bracket
    if r_lo > s:  # k is close to n: the bracket cannot exclude much
        return select_static(flats, k, dtype)
    r_hi = math.floor(mean - config.margin * sd) - 1
    top = torch.topk(sample, r_lo).values  # sorted, largest first
    t_lo = top[r_lo - 1].item()
    if t_lo == math.inf:  # nothing ranks strictly above an infinite magnitude (NaN ranks as inf)
        return select_static(flats, k, dtype)
    t_hi = top[r_hi - 1].item() if 1 <= r_hi < r_lo else None
    stats.limit = max(config.abandon_min, config.abandon_factor * n * r_lo / s)
    scanner = Scanner(t_lo, dtype, flats[0].device, r_lo / s, config, stats.limit)
    try:
        idx, vals = scanner.run(flats)
    except Abandoned:  # the sample underestimated the k-th magnitude by far: bounded fallback
        stats.path, stats.candidates = "abandoned", scanner.found
        return select_static(flats, k, dtype)
    stats.path, stats.candidates = "scan", idx.numel()
    if idx.numel() < k:  # the sample overestimated the k-th magnitude: exact fallback
        stats.path = "too-few"
        return select_static(flats, k, dtype)
    if idx.numel() == k:
        return idx, vals
    lib = native.library() if config.native and vals.device.type == "cpu" else None
    return top_k_of_candidates(idx, vals, k, t_hi, config.band_min, lib)
