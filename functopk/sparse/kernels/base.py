"""What every kernel shares: supported dtypes, magnitudes, a fast 1-d ``nonzero``, exact narrow thresholds."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from functopk._checks import FLOAT_DTYPES

__all__ = [
    "INT_OF",
    "SUPPORTED_DTYPES",
    "common_dtype",
    "flat_magnitudes",
    "magnitudes_",
    "nonzero_1d",
    "round_down",
]

SUPPORTED_DTYPES = FLOAT_DTYPES
"""The dtypes the kernels select from."""

INT_OF = {
    torch.float16: torch.int16,
    torch.bfloat16: torch.int16,
    torch.float32: torch.int32,
    torch.float64: torch.int64,
}
"""The integer dtype of each float dtype's width (to read bit patterns)."""


def common_dtype(leaves: Sequence[torch.Tensor]) -> torch.dtype:
    """The promoted dtype of ``leaves`` (in which magnitudes are compared).

    Example:
        >>> import torch
        >>> common_dtype([torch.ones(1, dtype=torch.float16), torch.ones(1, dtype=torch.bfloat16)])
        torch.float32
    """
    dtype = leaves[0].dtype
    for leaf in leaves[1:]:
        dtype = torch.promote_types(dtype, leaf.dtype)
    return dtype


def magnitudes_(x: torch.Tensor) -> torch.Tensor:
    """In place: ``|x|`` with NaN mapped to ``+inf``; returns ``x``."""
    return torch.nan_to_num_(x.abs_(), nan=math.inf, posinf=math.inf)


def flat_magnitudes(flats: Sequence[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """``|x|`` of every coordinate in flat order, in ``dtype``, NaN mapped to ``+inf`` (a new tensor).

    Example:
        >>> import torch
        >>> flat_magnitudes([torch.tensor([-2.0, float("nan")]), torch.tensor([1.0])], torch.float32)
        tensor([2., inf, 1.])
    """
    return magnitudes_(torch.cat([f.to(dtype) for f in flats]))


def nonzero_1d(mask: torch.Tensor, density: float = 0.0) -> torch.Tensor:
    """``mask.nonzero()`` of a contiguous 1-d bool tensor, as 1-d int64, in ascending order.

    ATen's CPU ``nonzero`` costs about a nanosecond per element plus tens of
    nanoseconds per hit (branch mispredictions). For sparse masks (expected
    ``density`` of hits below 2%) the mask is first viewed as int64 words of 8
    flags: ``nonzero`` over the words finds the few words with a hit in an
    eighth of the elements, and only those are expanded.

    Example:
        >>> import torch
        >>> mask = torch.zeros(5000, dtype=torch.bool)
        >>> mask[[3, 4000]] = True
        >>> nonzero_1d(mask)
        tensor([   3, 4000])
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


def round_down(t: float, leaf_dtype: torch.dtype, dtype: torch.dtype) -> float:
    """The largest ``leaf_dtype`` value ``<= t`` (``t >= 0`` a value of the wider ``dtype``).

    For ``x`` of ``leaf_dtype``, ``|x| > t`` (compared exactly) iff ``|x| > round_down(t)``
    compared in ``leaf_dtype``, where that value is exact. A NaN ``t`` stays NaN.

    Example:
        >>> import torch
        >>> round_down(1.0006, torch.float16, torch.float64)    # float16 neighbours: 1.0 and 1.0009765625
        1.0
    """
    v = torch.tensor(t, dtype=dtype).to(leaf_dtype)
    if v.to(dtype).item() > t:  # rounded up: step down one representable value (v > t >= 0)
        v = (v.view(INT_OF[leaf_dtype]) - 1).view(leaf_dtype)
    return v.item()
