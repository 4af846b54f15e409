"""Which elements of strided tensors share memory, read from their strides alone (never their values).

:func:`check_writable` refuses an in-place write where one element would be
written twice: a tensor whose elements alias each other
(:func:`overlaps_itself`, an ``expand``-ed view) or two tensors that share an
element (:func:`share_an_element`; interleaved views of one buffer that share
none, ``base[::2]`` and ``base[1::2]``, pass).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Sequence
from itertools import compress

import torch

__all__ = ["check_writable", "overlaps_itself", "share_an_element", "span"]


def span(t: torch.Tensor) -> int:
    """Elements from ``t``'s first to its last reachable element, inclusive (0 when empty)."""
    return sum((sz - 1) * st for sz, st in zip(t.shape, t.stride())) + 1 if t.numel() else 0


def overlaps_itself(t: torch.Tensor) -> bool:
    """True when two elements of ``t`` share memory (an ``expand``-ed or ``as_strided`` view)."""
    if t.is_contiguous() or t.numel() <= 1:
        return False
    dims = sorted((st, sz) for sz, st in zip(t.shape, t.stride()) if sz > 1)
    if dims[0][0] == 0:
        return True
    reach = 0
    for stride, size in dims:  # enough for no overlap: each stride jumps past all smaller dims
        if stride <= reach:
            break
        reach += (size - 1) * stride
    else:
        return False
    # a rare exotic layout: count the distinct element offsets exactly
    offsets = torch.as_strided(torch.arange(span(t)), t.shape, t.stride())
    return offsets.unique().numel() != t.numel()


_SEARCH_BUDGET = 10_000
"""Steps :func:`share_an_element` may take before it calls two views overlapping (never a false "disjoint")."""


def share_an_element(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors whose memory ranges overlap share an element (strides only, no value read).

    Exact for two views of one storage with one element size: is there an
    index of ``a`` and one of ``b`` at the same offset, i.e. integers ``c_s`` in
    a range per stride ``s`` with ``sum(c_s * s) = offset(b) - offset(a)``? A
    depth-first search from the largest stride, pruned by what the smaller
    strides can still reach, answers it (``base[::2]`` and ``base[1::2]``:
    no). Anything else (other storages, element sizes, a search past its
    budget) counts as sharing.

    Example:
        >>> base = torch.zeros(8)
        >>> share_an_element(base[::2], base[1::2]), share_an_element(base[::2], base[::3])
        (False, True)
    """
    try:
        same = a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # a tensor subclass without a storage of its own
        return True
    if not same or a.element_size() != b.element_size():
        return True
    bounds: dict[int, list[int]] = {}  # stride -> [lowest, highest] coefficient
    for t, sign in ((a, 1), (b, -1)):
        for size, stride in zip(t.shape, t.stride()):
            if size > 1 and stride:
                low, high = sorted((0, sign * (size - 1)))
                coef = bounds.setdefault(abs(stride), [0, 0])
                sgn = 1 if stride > 0 else -1
                coef[0] += min(low * sgn, high * sgn)
                coef[1] += max(low * sgn, high * sgn)
    target = int(b.storage_offset()) - int(a.storage_offset())
    strides = sorted(bounds, reverse=True)
    if not strides:
        return target == 0
    if target % math.gcd(*strides):
        return False
    # reach[k]: the lowest and highest sums the strides after the k-th can still add
    reach = [(0, 0)] * (len(strides) + 1)
    for k in range(len(strides) - 1, -1, -1):
        s, (lo, hi) = strides[k], bounds[strides[k]]
        reach[k] = (reach[k + 1][0] + lo * s, reach[k + 1][1] + hi * s)
    seen: set[tuple[int, int]] = set()
    stack = [(0, target)]
    while stack:
        k, rest = stack.pop()
        if k == len(strides):
            if rest == 0:
                return True
            continue
        if (k, rest) in seen:
            continue
        seen.add((k, rest))
        if len(seen) > _SEARCH_BUDGET:
            return True
        s, (lo, hi) = strides[k], bounds[strides[k]]
        below_lo, below_hi = reach[k + 1]
        first, last = max(lo, -((below_hi - rest) // s)), min(hi, (rest - below_lo) // s)
        if last - first > _SEARCH_BUDGET:
            return True
        stack.extend((k + 1, rest - c * s) for c in range(first, last + 1))
    return False


_TENSOR = torch.Tensor
_is_inference, _is_contiguous, _data_ptr, _nbytes = (
    _TENSOR.is_inference, _TENSOR.is_contiguous, _TENSOR.data_ptr, _TENSOR.nbytes.__get__,  # type: ignore[attr-defined]
)  # (read through map: one C-level pass per attribute, no Python frame per leaf)


def check_writable(leaves: Sequence[torch.Tensor], name: str, where: Callable[[int], str]) -> None:
    """``ValueError`` naming the first leaf that an in-place write would corrupt or that refuses one.

    Rejects inference tensors (outside ``torch.inference_mode``), leaves whose
    elements share memory (``torch.zeros(3).expand(2, 3)``: one add would land
    several times) and leaves that share an element with another (the same
    tensor twice; interleaved views of one buffer that share none, such as
    ``base[::2]`` and ``base[1::2]``, pass). Reads strides only, never values.
    ``where(i)`` formats leaf ``i``'s path; it is called only for a message, so
    the checks cost a few attribute reads a leaf: when no two leaves' byte ranges
    meet (the usual case), one sort of their addresses shows it, whatever their
    devices; ranges that meet are looked at element by element, device by device.
    """
    n = len(leaves)
    inference = n
    if not torch.is_inference_mode_enabled() and any(map(_is_inference, leaves)):
        inference = next(i for i, leaf in enumerate(leaves) if leaf.is_inference())
    contiguous = list(map(_is_contiguous, leaves))
    sizes = list(map(_nbytes, leaves))  # the bytes each spans, once its own strides are looked at below
    for i in compress(range(n), map(operator.not_, contiguous)):
        if i >= inference:
            break
        if overlaps_itself(leaves[i]):
            raise ValueError(
                f"{name} leaf at {where(i)} has elements that share memory (shape {tuple(leaves[i].shape)}, strides "
                f"{leaves[i].stride()}, e.g. made by expand), so an in-place add would write some of them several "
                "times; give it its own storage (.clone()) first"
            )
        sizes[i] = span(leaves[i]) * leaves[i].element_size()
    if inference < n:
        raise ValueError(
            f"{name} leaf at {where(inference)} is an inference tensor (made under torch.inference_mode) and cannot "
            "be written in place; clone it outside inference mode first"
        )
    starts = list(map(_data_ptr, leaves))
    reach = -1  # the furthest end so far: a range starting there meets none before it
    for i in sorted(compress(range(n), sizes), key=starts.__getitem__):  # (empty leaves hold no memory)
        if starts[i] < reach:
            _check_shared(leaves, starts, sizes, name, where)
            return
        end = starts[i] + sizes[i]
        if end > reach:
            reach = end


def _check_shared(
    leaves: Sequence[torch.Tensor], starts: list[int], sizes: list[int], name: str, where: Callable[[int], str]
) -> None:
    """``ValueError`` naming two leaves that share an element: the byte ranges that meet on one device, then
    their elements (:func:`share_an_element`)."""
    by_device: dict[torch.device, list[tuple[int, int, int]]] = {}  # (start, end, leaf) of the bytes each spans
    for i, (start, size) in enumerate(zip(starts, sizes)):
        if size:
            by_device.setdefault(leaves[i].device, []).append((start, start + size, i))
    for ranges in by_device.values():
        ranges.sort()
        open_ranges: list[tuple[int, int, int]] = []  # those whose memory reaches past the current start
        for b in ranges:
            open_ranges = [a for a in open_ranges if b[0] < a[1]]
            for a in open_ranges:
                if share_an_element(leaves[a[2]], leaves[b[2]]):
                    raise ValueError(
                        f"{name} leaves at {where(a[2])} and {where(b[2])} share memory, so an in-place add would "
                        "write some elements twice; each leaf needs its own memory (the same tensor twice?)"
                    )
            open_ranges.append(b)
