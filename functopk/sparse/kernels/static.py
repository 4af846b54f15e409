"""The static-shape exact kernel: a boolean top-k mask by ``torch.topk`` (int ``k``) or radix select (tensor ``k``).

Static shapes and no host reads, so it compiles with ``fullgraph=True``; it is
what ``"torch"`` runs everywhere and ``"exact"`` runs when compiled, off CPU, or
for inputs that require grad. It concatenates the magnitudes (several
``n``-sized buffers).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from functopk.sparse.kernels.base import INT_OF, magnitudes_, nonzero_1d

__all__ = ["mask_static", "radix_kth_key", "select_static", "tie_mask", "topk_static"]

_MAGNITUDE_BITS = {torch.float16: 15, torch.bfloat16: 15, torch.float32: 31, torch.float64: 63}


def tie_mask(above: torch.Tensor, at: torch.Tensor, k: int | torch.Tensor) -> torch.Tensor:
    """``above`` plus the first ``k - #above`` entries of ``at`` in index order.

    Example:
        >>> import torch
        >>> tie_mask(torch.tensor([True, False, False, False]), torch.tensor([False, True, True, True]), 3)
        tensor([ True,  True,  True, False])
    """
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

    Example:
        >>> import torch
        >>> radix_kth_key(torch.tensor([5, 900, 17, 900, 3], dtype=torch.int32), torch.tensor(3), 31)
        tensor(17)
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
    keys = mags.view(INT_OF[mags.dtype])
    return keys.to(torch.int32) if keys.dtype == torch.int16 else keys


def mask_static(mags: torch.Tensor, k: int | torch.Tensor) -> torch.Tensor:
    """Boolean mask of the top ``k`` of ``mags`` (NaN-free magnitudes); ties: lower index wins.

    Static shapes and no host reads, so it compiles with ``fullgraph=True``.
    An int ``k`` uses ``torch.topk``; a 0-d integer tensor ``k`` (clamped to
    ``[1, n]``) uses :func:`radix_kth_key`.

    Example:
        >>> import torch
        >>> mags = torch.tensor([1.0, 3.0, 3.0, 0.5])
        >>> mask_static(mags, 2), mask_static(mags, torch.tensor(1))
        (tensor([False,  True,  True, False]), tensor([False,  True, False, False]))
    """
    if isinstance(k, torch.Tensor):
        k = k.to(device=mags.device, dtype=torch.int64).clamp(1, mags.numel())
        keys = _keys(mags)
        t = radix_kth_key(keys, k, _MAGNITUDE_BITS[mags.dtype])
        return tie_mask(keys > t, keys == t, k)
    return topk_static(mags, k)[0]


def topk_static(mags: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The top ``k`` of ``mags`` (NaN-free magnitudes) as a boolean mask and its indices in ascending order.

    ``torch.topk``'s own indices, except that among the values equal to the
    k-th largest, ``t``, it may pick any: those picks are replaced by the
    lowest-index ties (``nonzero_static`` over ``mags == t``). Besides
    ``torch.topk`` that reads ``mags`` once more and sorts ``2 k`` indices,
    where :func:`tie_mask` runs several passes over all ``n`` (an int64
    cumulative sum among them). Static shapes, no host reads.

    Example:
        >>> import torch
        >>> topk_static(torch.tensor([1.0, 3.0, 2.0, 3.0, 3.0]), 2)
        (tensor([False,  True, False,  True, False]), tensor([1, 3]))
    """
    n = mags.numel()
    vals, idx = torch.topk(mags, k, sorted=False)
    t = vals.min()
    above = vals > t
    sure = torch.where(above, idx, n)  # every value above t is among topk's k; n sorts last
    room = k - above.sum()  # how many values equal to t are in
    ties = torch.nonzero_static(mags == t, size=k, fill_value=n).view(-1)  # the first k ties, ascending
    ties = torch.where(torch.arange(k, device=mags.device) < room, ties, n)
    chosen = torch.sort(torch.cat([sure, ties])).values[:k]  # exactly k entries are below n
    return torch.zeros(n, dtype=torch.bool, device=mags.device).index_fill_(0, chosen, True), chosen


def select_static(flats: Sequence[torch.Tensor], k: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Sorted flat indices and values (in ``dtype``) of the exact top ``k``, via :func:`mask_static`.

    Materialises the concatenation. ``nonzero`` makes it eager-only; it is the
    fallback of :func:`functopk.sparse.kernels.exact.select_exact` and its path
    for tiny trees.

    Example:
        >>> import torch
        >>> select_static([torch.tensor([0.5, -4.0]), torch.tensor([2.0])], 2, torch.float32)
        (tensor([1, 2]), tensor([-4.,  2.]))
    """
    flat = torch.cat([f.to(dtype) for f in flats])
    mask = mask_static(magnitudes_(flat.clone()), k)
    idx = nonzero_1d(mask, k / mask.numel())
    return idx, flat.index_select(0, idx)
