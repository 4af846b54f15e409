"""The systematic sample and the approximate thresholds (``method="approx"`` and ``"gaussian"``).

:func:`systematic_sample` also serves the eager exact kernel, whose bracket
comes from it. Both thresholds have static shapes and read nothing on the host.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from functopk.sparse.kernels.base import magnitudes_

__all__ = ["gaussian_threshold_flat", "sample_stride", "sample_threshold", "systematic_sample"]


def _next_prime(x: int) -> int:
    """The smallest prime ``>= x``, by trial division.

    Only comparisons and ``%`` (no ``math.isqrt``), so that under
    ``torch.compile`` with symbolic sizes it becomes guards, not a graph break.
    """
    x = max(2, x)
    while True:
        p = 2
        while p * p <= x and x % p != 0:
            p += 1
        if p * p > x:
            return x
        x += 1


def sample_stride(numel: int, target: int) -> int:
    """A prime stride giving about ``target`` samples out of ``numel`` (1: take everything).

    Example:
        >>> sample_stride(10**6, 1000), sample_stride(100, 1000)
        (1009, 1)
    """
    if numel <= target:
        return 1
    return _next_prime(numel // target)


def systematic_sample(flats: Sequence[torch.Tensor], stride: int, dtype: torch.dtype) -> torch.Tensor:
    """Magnitudes (in ``dtype``, NaN as ``+inf``) of the coordinates whose flat index is ``stride // 2`` mod ``stride``.

    A systematic sample of the virtual concatenation: one strided view per
    leaf and one ``torch.cat``, deterministic, static shapes. A prime stride
    avoids locking onto the periodic structure of conv kernels.

    Example:
        >>> import torch
        >>> systematic_sample([torch.arange(-5.0, 0.0), torch.arange(5.0)], 3, torch.float32)
        tensor([4., 1., 2.])
    """
    views, offset = [], 0
    phase = stride // 2
    for f in flats:
        # (phase - offset) mod stride, without % (unsupported on symbolic sizes by some backends)
        start = phase - offset + stride * ((offset - phase + stride - 1) // stride)
        if start < f.numel():
            views.append(f[start::stride])
        offset += f.numel()
    if not views:
        return torch.zeros(0, dtype=dtype, device=flats[0].device)
    return magnitudes_(torch.cat([v if v.dtype == dtype else v.to(dtype) for v in views]))


def sample_threshold(
    flats: Sequence[torch.Tensor], k: int | torch.Tensor, dtype: torch.dtype, *, hits: int = 64
) -> torch.Tensor:
    """A 0-d threshold ``t`` with about ``k`` magnitudes above it, from a systematic sample.

    ``t`` is the sample magnitude with ``r = round(k * s / n)`` sample
    magnitudes above it, so the count above ``t`` is about ``k`` with a
    binomial relative spread of about ``1 / sqrt(r)``. For an int ``k`` the
    sample size ``s`` is ``hits * n / k`` clamped to ``[2**16, 2**18]`` (and to
    ``n``), so ``r >= hits`` once ``k / n >= hits / 2**18``; for a tensor ``k``
    (an int64 count in ``[1, n]``) it is ``2**16``. Static shapes, no host reads.
    Returns ``-1`` when ``k >= n`` (everything is above).

    Example:
        >>> import torch
        >>> x = torch.arange(100.0)
        >>> t = sample_threshold([x], 10, torch.float32)
        >>> t, int((x > t).sum())
        (tensor(89.), 10)
    """
    n = sum(f.numel() for f in flats)
    if isinstance(k, torch.Tensor):
        sample = systematic_sample(flats, sample_stride(n, 1 << 16), dtype)
        s = sample.numel()
        k = k.to(sample.device)
        rank = torch.round(k.to(torch.float64) * (s / n)).to(torch.int64).clamp(0, s - 1).reshape(1)
        t = torch.sort(sample, descending=True).values.gather(0, rank).reshape(())
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
    """The zero-mean Gaussian threshold for ``density`` (see :func:`functopk.sparse.gaussian_threshold`).

    ``rms * Phi^-1(1 - density / 2)`` in ``dtype``. Non-finite input is not
    silent: a NaN or infinite coordinate makes the root mean square NaN or
    infinite, and such an estimate is replaced by the largest finite value of
    ``dtype``, above which exactly the non-finite coordinates (NaN, ``±inf``)
    lie; they rank first in every method, so those are what a threshold
    selection then keeps. A NaN ``density`` counts as 1 (keep everything non-zero).

    Example:
        >>> import torch
        >>> gaussian_threshold_flat([torch.tensor([1.0, -1.0])], 1.0, torch.float32)
        tensor(0.)
        >>> gaussian_threshold_flat([torch.tensor([1.0, float("inf")])], 0.5, torch.float32)
        tensor(3.4028e+38)
    """
    n = sum(f.numel() for f in flats)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    norms = torch._foreach_norm(list(flats), 2, dtype=acc)
    sumsq = torch.stack(norms).to(torch.float64).square().sum()
    rms = torch.sqrt(sumsq / n)
    if isinstance(density, torch.Tensor):
        density = density.to(device=rms.device, dtype=torch.float64)
    else:  # a fill kernel: as_tensor of a Python number copies from the host, which synchronises a GPU
        density = torch.full((), float(density), dtype=torch.float64, device=rms.device)
    density = torch.nan_to_num(density, nan=1.0).clamp(0.0, 1.0)
    z = torch.special.ndtri(1.0 - density / 2.0)
    big = torch.finfo(dtype).max
    return torch.nan_to_num((rms * z).to(dtype), nan=big, posinf=big)
