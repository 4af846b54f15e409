"""The exact global top-k of the gradients, selected while backward runs: :class:`StreamingTopK`.

A post-accumulate-grad hook on each parameter folds that parameter's gradient
into a running top-k of (value, flat index) over the whole tree as soon as
autograd finishes it, then frees the gradient (``p.grad = None``). At most one
parameter's gradient is alive at a time (plus what autograd itself holds), and
the stream keeps at most ``3k`` candidates, so peak gradient memory is the
largest parameter's gradient plus ``O(k)``, not ``n``.

Why it is exact: a parameter's own top ``k`` (same order: larger magnitude
first, then lower flat index; NaN as ``+inf``) contains every coordinate of that
parameter that belongs to the global top ``k``, and so does the set of its
coordinates at or above the ``k``-th magnitude of what was folded before; so
the top ``k`` of those candidates and the running ones is the top ``k`` of
everything folded so far. Candidates carry their flat indices, so the order
in which autograd finishes the parameters does not matter: ties at the
``k``-th magnitude go to the lower flat index (:class:`RunningTopK`). A
parameter is selected from by the existing exact kernels.

What it does not do: error feedback (its residual would be ``n``-sized, the
memory this saves), DDP (its hooks run on each rank's local gradient before
DDP averages it), ``GradScaler.unscale_`` (it cannot see freed gradients);
:class:`StreamingTopK`'s docstring says what to do instead.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch

from functopk._checks import check_k_or_density, check_leaves, one_device, path_str
from functopk.sparse.config import DEFAULT_CONFIG, KernelConfig
from functopk.sparse.k import k_on_host, resolve_k
from functopk.sparse.kernels.base import INT_OF, SUPPORTED_DTYPES, common_dtype, magnitudes_, nonzero_1d
from functopk.sparse.kernels.exact import select_exact
from functopk.sparse.kernels.scan import scan_above
from functopk.sparse.kernels.static import select_static
from functopk.sparse.updates import SparseUpdates
from functopk.tree.maths import PyTree

__all__ = ["RunningTopK", "StreamingTopK"]


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


class StreamingTopK:
    """The exact global top-k of a tree's gradients, selected during backward; each gradient freed once folded.

    Registers a :meth:`torch.Tensor.register_post_accumulate_grad_hook` on
    every parameter of ``params`` that requires grad. When autograd has
    accumulated a parameter's gradient, the hook folds it into a running
    top-``k`` over the whole tree and sets ``p.grad = None``. :meth:`result`
    then returns, bit for bit, what ``ft.topk_indices(grads, k)`` (or
    ``density=``) returns on the dense gradients ``grads =
    ft.tree.map(lambda p: p.grad, params)``: the flat order of ``params``
    (not the order in which autograd finishes them), ties to the lower flat
    index, NaN ranked as ``+inf`` with ``±inf``, values in the promoted dtype,
    exactly ``k`` coordinates. One exception to "bit for bit": the candidates are
    held in the promoted dtype of all of ``params``, so when a parameter of a wider
    dtype than every gradient that arrived has no gradient, a NaN value passes
    through that wider dtype and its payload bits may differ from a direct
    conversion (it is NaN either way, at the same index; finite and infinite
    values are exact). Peak gradient memory is the largest parameter's
    gradient plus ``O(k)``, instead of every gradient at once.

    A training step::

        loss.backward()                                   # gradients folded and freed
        sparse = stream.result()
        ft.apply_sparse_updates_(stream.selected_from, sparse, -lr)   # params, None where no gradient

    Rules:

    * **Parameters without a gradient** (unused in the loss, ``requires_grad=False``,
      ``None`` nodes) are skipped, as ``topk_indices`` skips ``None`` leaves:
      the flat indices count only the parameters that had a gradient, and
      ``k`` (or ``density``) is resolved against their size, in :meth:`result`;
      :attr:`selected_from` is the tree it applies to.
    * :meth:`result` **ends the step**: it also folds (and frees) any ``.grad``
      of the tree still set (left by backward passes under :meth:`paused`, or
      set by hand), returns the selection and empties the stream.
    * **Gradient accumulation**: run the micro-batches but the last under
      ``with stream.paused():`` (the hooks do nothing there, so ``.grad``
      accumulates as usual), then the last backward outside it: its hooks
      fold the accumulated gradients. Only the last micro-batch saves memory.
    * **A second backward before** :meth:`result` would fold a parameter twice:
      its hook raises ``RuntimeError`` (out of ``backward``) and the step's
      selection is discarded; zero the gradients and run the step again.
      ``torch.autograd.grad`` accumulates nothing and triggers no hook.
    * **GradScaler**: a power-of-two scale selects the same coordinates from
      the scaled gradients (unless they overflow), and the values are scaled:
      apply them with ``-lr / scaler.get_scale()``. ``scaler.unscale_`` and
      ``scaler.step`` cannot see freed gradients; since NaN and ``±inf`` rank
      first, the step's gradients are all finite if and only if
      ``torch.isfinite(sparse.values).all()``: skip the step otherwise, and set
      the scale yourself (``scaler.update(new_scale)``).
    * **Error feedback** is not done: its residual is one ``n``-sized buffer
      per parameter, the memory this saves; use ``ft.error_feedback`` on dense
      gradients for it.
    * **DDP** is not supported: the hooks run on each rank's local gradient,
      before DDP averages it, and DDP then writes the averaged gradients back
      into ``.grad``, so :meth:`result` raises ``RuntimeError``. Under
      ``no_sync`` nothing is averaged and the stream selects from the rank's own
      gradient, as without DDP. For data-parallel top-k use ``ft.distributed.topk_hook``.
    * A tensor ``k`` or ``density`` is read on the host when a step's first
      gradient arrives and again in :meth:`result`.
    * :meth:`remove` (or leaving a ``with StreamingTopK(...)`` block) removes the hooks.

    Args:
        params: A pytree of float tensors on one device (``dict(model.named_parameters())``),
            each a leaf of the autograd graph, each listed once.
        k: How many coordinates to keep (an int or a 0-d tensor; give exactly one of ``k`` and ``density``).
        density: The fraction of coordinates to keep, in ``(0, 1]`` (a number or a 0-d float tensor).
        config: The exact kernel's tuning constants (tests, benchmarks); ``None``: the defaults.

    Raises:
        TypeError: ``params`` is not a tree of supported float tensors (an iterator
            such as ``model.parameters()`` included), or ``k``/``density``/``config`` has the wrong type.
        ValueError: Not exactly one of ``k`` and ``density``, ``k`` above the number of
            coordinates, leaves on several devices, a tensor listed twice, or one that is not a leaf.

    Example:
        >>> import torch, functopk as ft
        >>> model = torch.nn.Linear(3, 2)
        >>> params = dict(model.named_parameters())
        >>> stream = ft.sparse.StreamingTopK(params, k=2)
        >>> model(torch.ones(1, 3)).square().sum().backward()
        >>> model.weight.grad is None                       # folded into the selection and freed
        True
        >>> sparse = stream.result()
        >>> sparse.indices.shape, sparse.numel
        (torch.Size([2]), 8)
        >>> _ = ft.apply_sparse_updates_(stream.selected_from, sparse, -0.1)
        >>> stream.remove()
    """

    def __init__(
        self, params: PyTree, k: Any = None, *, density: Any = None, config: KernelConfig | None = None
    ) -> None:
        self._k, self._density = check_k_or_density(k, density)
        if config is not None and not isinstance(config, KernelConfig):
            raise TypeError(f"config must be a functopk.sparse.KernelConfig or None, got {type(config).__name__}")
        self._config = DEFAULT_CONFIG if config is None else config
        leaves, treedef = check_leaves(params, "params", dtypes=SUPPORTED_DTYPES)
        one_device(leaves, "params")
        paths = [path_str(path) for path in treedef.paths()]
        self._check_leaves(leaves, paths)
        self._leaves, self._paths, self._treedef = leaves, paths, treedef
        self._selected_from: PyTree = None
        self._sizes = [x.numel() for x in leaves]
        self._offsets = [sum(self._sizes[:i]) for i in range(len(leaves))]  # in the flat order of params
        self._numel = sum(self._sizes)
        resolve_k(self._k, self._density, self._numel, name="params")  # k above n, or no coordinates at all
        self._dtype = common_dtype(leaves)
        self._paused = False
        self._clear()
        self._handles = [
            x.register_post_accumulate_grad_hook(self._hook(i)) for i, x in enumerate(leaves) if x.requires_grad
        ]

    @staticmethod
    def _check_leaves(leaves: list[torch.Tensor], paths: list[str]) -> None:
        """Each tensor once, each a leaf of the autograd graph (hooks can only go there)."""
        first: dict[int, int] = {}
        for i, x in enumerate(leaves):
            j = first.setdefault(id(x), i)
            if j != i:
                raise ValueError(
                    f"params lists one tensor twice, at {paths[j]} and {paths[i]}; a top-k would count its "
                    "gradient twice: list each parameter once"
                )
            if x.requires_grad and not x.is_leaf:
                raise ValueError(
                    f"params leaf at {paths[i]} is not a leaf of the autograd graph (it was computed from "
                    "other tensors), so autograd accumulates no .grad into it; pass the parameters themselves"
                )

    def _clear(self) -> None:
        """An empty step: no candidates, nothing folded."""
        self._run: RunningTopK | None = None
        self._folded: dict[int, torch.dtype] = {}  # leaf position -> its gradient's dtype

    def _start(self) -> None:
        """Open a step: the running ``k`` is the one for all of ``params``, at least the final one."""
        self._clear()
        k = k_on_host(resolve_k(self._k, self._density, self._numel, name="params"), self._numel)
        self._run = RunningTopK(k, self._dtype, self._numel, self._config, self._leaves[0].device)

    def _hook(self, i: int) -> Any:
        def hook(param: torch.Tensor) -> None:
            if self._paused or param.grad is None:
                return
            if self._run is None:
                self._start()
            elif i in self._folded:
                self._clear()
                raise self._twice(i)
            self._fold(i, param.grad)
            param.grad = None

        return hook

    def _twice(self, i: int) -> RuntimeError:
        """The error of a gradient that arrives for a leaf already folded in this step."""
        return RuntimeError(
            f"StreamingTopK: a second gradient of {self._paths[i]} before result() (a second backward, or DDP "
            "writing its averaged gradients back: DDP is not supported); it was already folded into this step's "
            "selection, which is now discarded: call result() after each backward, or run the earlier "
            "micro-batches under `with stream.paused():`"
        )

    def _fold(self, i: int, grad: torch.Tensor) -> None:
        """Fold leaf ``i``'s gradient into the running top ``k`` (the step is open)."""
        if grad.layout != torch.strided:
            raise TypeError(f"the gradient of {self._paths[i]} is {grad.layout}; StreamingTopK needs dense gradients")
        assert self._run is not None
        self._folded[i] = grad.dtype
        if grad.numel():
            self._run.add(grad.detach().reshape(-1), self._offsets[i])

    def result(self) -> SparseUpdates:
        """End the step: the selection as ``ft.topk_indices`` gives it on the step's dense gradients.

        Folds (and frees) any ``.grad`` of ``params`` still set first, then
        returns the top ``k`` as a :class:`~functopk.SparseUpdates` over the
        parameters that had a gradient, and empties the stream for the next step.

        Raises:
            ValueError: No parameter had a gradient, or ``k`` exceeds the coordinates of those that had one.

        Example:
            >>> import torch, functopk as ft
            >>> w = torch.tensor([1.0, -3.0, 2.0], requires_grad=True)
            >>> stream = ft.sparse.StreamingTopK({"w": w}, k=2)
            >>> (w * torch.tensor([1.0, 5.0, -4.0])).sum().backward()
            >>> stream.result()
            SparseUpdates(indices=tensor([1, 2]), values=tensor([ 5., -4.]), numel=3)
        """
        try:
            for i, x in enumerate(self._leaves):
                if i in self._folded and x.grad is not None:
                    raise self._twice(i)
                if x.grad is not None:
                    if self._run is None:
                        self._start()
                    self._fold(i, x.grad)
                    x.grad = None
            return self._finish()
        finally:
            self._clear()

    def _finish(self) -> SparseUpdates:
        """The running candidates cut to the final ``k``, indexed over the leaves that had a gradient."""
        present = sorted(self._folded)
        self._selected_from = self._treedef.unflatten(
            [x if i in self._folded else None for i, x in enumerate(self._leaves)]
        )
        sizes = tuple(self._sizes[i] for i in present)
        n = sum(sizes)
        k = k_on_host(resolve_k(self._k, self._density, n, name="the gradients"), n)
        assert self._run is not None  # opened by the first fold (k above was resolved: something was folded)
        idx, vals = self._run.top(k)
        if n < self._numel and idx.numel():  # shift each index by the leaves without a gradient before it
            starts = [self._offsets[i] for i in present]
            shifts = [start - sum(sizes[:j]) for j, start in enumerate(starts)]
            leaf = torch.searchsorted(torch.tensor(starts, device=idx.device), idx, right=True) - 1
            idx = idx - torch.tensor(shifts, device=idx.device)[leaf]
        dtype = functools.reduce(torch.promote_types, [self._folded[i] for i in present])  # of what arrived
        return SparseUpdates(idx, vals.to(dtype), n, sizes)

    @contextlib.contextmanager
    def paused(self) -> Iterator[StreamingTopK]:
        """A block whose backward passes keep their gradients in ``.grad`` (gradient accumulation).

        Example:
            >>> import torch, functopk as ft
            >>> w = torch.ones(3, requires_grad=True)
            >>> stream = ft.sparse.StreamingTopK([w], k=1)
            >>> with stream.paused():
            ...     (w * torch.tensor([1.0, 2.0, 0.0])).sum().backward()   # micro-batch 1: kept in w.grad
            >>> (w * torch.tensor([0.0, 0.0, 2.5])).sum().backward()       # the last one: folded
            >>> w.grad is None, stream.result()
            (True, SparseUpdates(indices=tensor([2]), values=tensor([2.5000]), numel=3))
        """
        before, self._paused = self._paused, True
        try:
            yield self
        finally:
            self._paused = before

    @property
    def selected_from(self) -> PyTree:
        """The tree the last :meth:`result` applies to: ``params``, ``None`` where a parameter had no gradient.

        Its flat indices count only the parameters that had a gradient (as
        ``ft.topk_indices`` counts the leaves of a gradient tree that are not
        ``None``), so apply it to this tree, not to ``params`` itself.

        Example:
            >>> import torch, functopk as ft
            >>> params = {"used": torch.zeros(2, requires_grad=True), "unused": torch.zeros(3, requires_grad=True)}
            >>> stream = ft.sparse.StreamingTopK(params, k=1)
            >>> (params["used"] * torch.tensor([1.0, -2.0])).sum().backward()
            >>> sparse = stream.result()
            >>> stream.selected_from["unused"] is None
            True
            >>> _ = ft.apply_sparse_updates_(stream.selected_from, sparse, -1.0)
            >>> params["used"]
            tensor([0., 2.], requires_grad=True)
        """
        return self._selected_from

    @property
    def nbytes(self) -> int:
        """Bytes the running selection holds now (its indices and values): ``O(k)``.

        Example:
            >>> import torch, functopk as ft
            >>> ft.sparse.StreamingTopK([torch.ones(4, requires_grad=True)], k=2).nbytes
            0
        """
        return 0 if self._run is None else self._run.nbytes

    def remove(self) -> None:
        """Remove the hooks: later backward passes leave ``.grad`` as autograd writes it.

        Example:
            >>> import torch, functopk as ft
            >>> w = torch.ones(2, requires_grad=True)
            >>> with ft.sparse.StreamingTopK([w], k=1):   # the hooks live for the block
            ...     pass
            >>> w.sum().backward(); w.grad
            tensor([1., 1.])
        """
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def __enter__(self) -> StreamingTopK:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()
