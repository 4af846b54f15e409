"""Threshold-reuse top-k selection for the DDP hook (Ok-Topk / DGC style), exact by construction.

References: Lin et al. (2018), Deep Gradient Compression (a threshold from a
sample, with a fallback); Li and Hoefler (2022), Ok-Topk (thresholds reused
across iterations). Unlike both, the result here is always the exact top ``k``.

The hook's exact selection reads and ranks a whole bucket every step. Gradient
magnitudes change slowly from step to step, so the previous step's ``k``-th
magnitude, times a slack below 1, is usually a threshold that keeps a little
more than ``k`` coordinates. :func:`threshold_select` uses it as a filter:

1. The candidates ``|x| > t`` (and NaN, which ranks as an infinite
   magnitude), in flat order, gathered by the exact kernel's scanner
   (:class:`functopk.sparse.kernels.scan.Scanner`): about one read pass. This
   replaces the exact kernel's own first stage (a systematic sample and a
   ``topk`` of it to bracket the ``k``-th magnitude). Sizes are read on the
   host (as the exact CPU kernel does anyway); on CUDA that is a sync per
   bucket.
2. If their count ``c`` is in ``[k, max_factor * k]``: the exact selection on the ``c``
   compacted candidates only.
3. Otherwise (first step, a jump of the gradient scale, a non-finite ``t``):
   the exact selection on the whole bucket (the *fallback*).

Either way ``t`` becomes ``slack`` times the new ``k``-th magnitude (a host
float). ``max_factor * k`` candidates at most: above that the scan is
abandoned early (the gradient scale dropped).

Why step 2 is exact: if at least ``k`` coordinates have ``|x| > t``, the
``k``-th largest magnitude ``v_k`` is ``> t``, so every coordinate of the exact
top ``k`` (``|x| >= v_k``) is a candidate. The candidates keep their flat order
(ascending indices), and the exact kernel's last stage
(:func:`functopk.sparse.kernels.exact.top_k_of_candidates`) breaks ties by the lower
index, so the candidates' top ``k`` is the bucket's top ``k``, tie for tie:
the same indices and the same value bits as the exact mode.
"""

from __future__ import annotations

import math

import torch

from functopk.distributed.wire import local_topk
from functopk.sparse.config import DEFAULT_CONFIG
from functopk.sparse.kernels.exact import top_k_of_candidates
from functopk.sparse.kernels.scan import Abandoned, Scanner

__all__: list[str] = []


def threshold_select(
    flat: torch.Tensor,
    k: int,
    threshold: float | None,
    *,
    slack: float = 0.97,
    max_factor: float = 4.0,
) -> tuple[torch.Tensor, torch.Tensor, float | None, bool]:
    """The exact top ``k`` of ``flat`` found among ``|flat| > threshold``: ``(idx, vals, new_threshold, fell_back)``.

    ``idx`` (ascending int64) and ``vals`` equal :func:`functopk.topk_indices`'s
    (NaN ranks as infinite, ties go to the lower index). ``threshold`` is the
    previous step's (a host float) or ``None`` (then the fallback runs);
    ``new_threshold`` is ``slack`` times the ``k``-th magnitude (``None`` if that
    is not finite and positive). ``fell_back`` tells whether the whole of
    ``flat`` was ranked by the exact kernel. ``flat`` is not modified.

    Example:
        >>> import torch
        >>> from functopk.distributed.threshold import threshold_select
        >>> x = torch.linspace(-1, 1, 100_001)
        >>> idx, vals, t, fell_back = threshold_select(x, 2000, None)  # no threshold yet: the exact kernel
        >>> idx.tolist()[:3], round(t, 4), fell_back
        ([0, 1, 2], 0.9506, True)
        >>> idx2, vals2, t, fell_back = threshold_select(x * 1.01, 2000, t)  # candidates |x| > t only
        >>> torch.equal(idx, idx2), fell_back
        (True, False)
    """
    n = flat.numel()
    flat = flat.detach()
    fell_back = True
    if threshold is not None and 0 < k < n and n >= DEFAULT_CONFIG.exact_min_numel:
        limit = max_factor * k
        scanner = Scanner(threshold, flat.dtype, flat.device, min(1.0, 2.0 * k / n), DEFAULT_CONFIG, limit)
        try:
            cidx, cvals = scanner.run([flat])  # |x| > threshold, and NaN: ascending flat order
        except Abandoned:  # far more candidates than expected (the gradient scale dropped)
            cidx = None
        if cidx is not None and k <= cidx.numel():  # else too few (the gradient scale jumped)
            fell_back = False
            if cidx.numel() == k:
                idx, vals = cidx, cvals
            else:
                idx, vals = top_k_of_candidates(cidx, cvals, k, threshold / slack, DEFAULT_CONFIG.band_min)
    if fell_back:
        idx, vals = local_topk(flat, k)
    return idx, vals, _next_threshold(vals, slack), fell_back


def _next_threshold(vals: torch.Tensor, slack: float) -> float | None:
    """``slack`` times the smallest selected magnitude (the ``k``-th); ``None`` unless finite and positive."""
    if vals.numel() == 0:
        return None
    mags = torch.nan_to_num(vals.abs(), nan=math.inf, posinf=math.inf)  # NaN ranks as infinite
    t = float(mags.amin()) * slack  # host read: the scanner takes a host threshold
    return t if math.isfinite(t) and t > 0 else None
