"""The running exact top-k of coordinates folded in one leaf at a time: :class:`RunningTopK`.

What :class:`~functopk.sparse.streaming.StreamingTopK` folds each gradient
into: ``O(k)`` candidates (value, flat index) and a floor below which nothing
can still enter. Why it is exact is explained in :mod:`functopk.sparse.streaming`.
"""

from __future__ import annotations

import torch

from functopk.sparse.config import DEFAULT_CONFIG, KernelConfig
from functopk.sparse.kernels.base import INT_OF, magnitudes_, nonzero_1d
from functopk.sparse.kernels.exact import select_exact
from functopk.sparse.kernels.scan import scan_above
from functopk.sparse.kernels.static import select_static

__all__ = ["RunningTopK"]


def _top_of(idx: torch.Tensor, vals: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact top ``k`` of candidates in any order (ties: lower flat index); as they are if ``<= k``.

    The order is not restored: only the ties at the ``k``-th magnitude are
    sorted by index (usually a handful), so a merge costs a selection, not a sort.
    """
    if idx.numel() <= k:
        return idx, vals
    mags = magnitudes_(vals.clone())
    kth = torch.kthvalue(mags, mags.numel() - k + 1).values
    above = nonzero_1d(mags > kth, k / mags.numel())
    ties = nonzero_1d(mags == kth)
    room = k - above.numel()
    if ties.numel() > room:  # the ties with the lowest flat indices
        ties = ties.index_select(0, torch.sort(idx.index_select(0, ties)).indices[:room])
    keep = torch.cat([above, ties])
    return idx.index_select(0, keep), vals.index_select(0, keep)


class RunningTopK:
    """The top ``k`` of the coordinates folded so far: ``O(k)`` candidates, and a floor.

    Each :meth:`add` keeps a leaf's own top ``k`` as pending candidates; once
    there are ``k`` pending (or as soon as the first ``k`` exist), one exact
    selection merges them into the running top ``k``. From then on the
    ``k``-th magnitude bounds what can still enter: a later coordinate needs
    ``|x| >= `` it (equal ones may win a tie by a lower index), so a leaf is
    scanned for those (:func:`~functopk.sparse.kernels.scan.scan_above`)
    instead of being selected from in full. Holds at most ``3k`` candidates.

    Example:
        >>> import torch
        >>> run = RunningTopK(2, torch.float32, 5)
        >>> run.add(torch.tensor([3.0, -1.0]), 3)
        >>> run.add(torch.tensor([0.5, -4.0, 3.0]), 0)
        >>> run.top(2)
        (tensor([1, 2]), tensor([-4.,  3.]))
    """

    def __init__(
        self,
        k: int,
        dtype: torch.dtype,
        numel: int,
        config: KernelConfig = DEFAULT_CONFIG,
        device: torch.device | str = "cpu",
    ) -> None:
        self.k, self.dtype, self.config = k, dtype, config
        self.density = k / numel
        self.fraction = self.density  # the share of the last leaf scanned above the floor: picks the scan strategy
        self.idx = torch.empty(0, dtype=torch.int64, device=device)  # the running top k, in no particular order
        self.vals = torch.empty(0, dtype=dtype, device=device)
        self.pending: list[tuple[torch.Tensor, torch.Tensor]] = []  # leaves' candidates not merged yet
        self.pending_count = 0
        self.floor: float | None = None  # the largest value below the k-th magnitude, once k are merged

    def add(self, flat: torch.Tensor, offset: int) -> None:
        """Fold in the 1-d gradient ``flat`` of the leaf whose flat indices start at ``offset``."""
        if self.floor is not None:  # only coordinates at or above the k-th magnitude can still enter
            if flat.device.type == "cpu":
                idx, vals = scan_above([flat], self.floor, self.dtype, self.fraction, self.config)
                self.fraction = max(self.density, idx.numel() / flat.numel())
            else:
                idx = (~(flat.to(self.dtype).abs() <= self.floor)).nonzero().view(-1)
                vals = flat.index_select(0, idx).to(self.dtype)
            idx, vals = _top_of(idx, vals, self.k)
        elif flat.numel() <= self.k:  # the whole leaf is a candidate
            idx, vals = torch.arange(flat.numel(), device=flat.device), flat.to(self.dtype)
        elif flat.device.type == "cpu":
            idx, vals = select_exact([flat], self.k, self.dtype, self.config)
        else:
            idx, vals = select_static([flat], self.k, self.dtype)
        self.pending.append((idx + offset, vals))
        self.pending_count += idx.numel()
        if self.pending_count >= self.k or (self.floor is None and self.idx.numel() + self.pending_count >= self.k):
            self.merge()

    def merge(self) -> None:
        """Select the top ``k`` of the running and the pending candidates; raise the floor."""
        if not self.pending:
            return
        idx = torch.cat([self.idx, *(i for i, _ in self.pending)])
        vals = torch.cat([self.vals, *(v for _, v in self.pending)])
        self.idx, self.vals = _top_of(idx, vals, self.k)
        self.pending, self.pending_count = [], 0
        if self.idx.numel() == self.k:
            kth = magnitudes_(self.vals.clone()).min()
            if kth > 0:  # one representable value below it (inf: the largest finite value)
                self.floor = (kth.view(INT_OF[self.dtype]) - 1).view(self.dtype).item()

    def top(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The top ``k <= self.k`` of everything added: ascending flat indices and values."""
        self.merge()
        idx, vals = _top_of(self.idx, self.vals, k)
        order = torch.argsort(idx)  # leaves finish in any order: back to flat order, once
        return idx.index_select(0, order), vals.index_select(0, order)

    @property
    def nbytes(self) -> int:
        """Bytes of the candidates held (running and pending)."""
        tensors = [self.idx, self.vals, *(t for pair in self.pending for t in pair)]
        return sum(t.numel() * t.element_size() for t in tensors)
