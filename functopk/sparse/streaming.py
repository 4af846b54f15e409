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

from functopk._checks import check_k_or_density, check_leaves, describe, one_device, path_str
from functopk.sparse.config import DEFAULT_CONFIG, KernelConfig
from functopk.sparse.k import k_on_host, resolve_k
from functopk.sparse.kernels.base import SUPPORTED_DTYPES, common_dtype
from functopk.sparse.running import RunningTopK
from functopk.sparse.updates import SparseUpdates, check_ascending_indices
from functopk.tree.layout import FlatLayout
from functopk.tree.maths import PyTree

__all__ = ["StreamingTopK"]


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
        self._gathering: tuple[torch.Tensor, list[tuple[int, int, int]]] | None = None
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
        self._values: torch.Tensor | None = None  # a gathering step's values, in the order of its indices
        self._folded: dict[int, torch.dtype] = {}  # leaf position -> its gradient's dtype

    def _is_open(self) -> bool:
        return self._run is not None or self._values is not None

    def _start(self) -> None:
        """Open a step: the running ``k`` is the one for all of ``params``, at least the final one."""
        self._clear()
        if self._gathering is not None:
            self._values = torch.zeros(self._gathering[0].shape, dtype=self._dtype, device=self._gathering[0].device)
            return
        k = k_on_host(resolve_k(self._k, self._density, self._numel, name="params"), self._numel)
        self._run = RunningTopK(k, self._dtype, self._numel, self._config, self._leaves[0].device)

    def _hook(self, i: int) -> Any:
        def hook(param: torch.Tensor) -> None:
            if self._paused or param.grad is None:
                return
            if not self._is_open():
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
        self._folded[i] = grad.dtype
        if self._values is not None and self._gathering is not None:
            idx, bounds = self._gathering
            off, lo, hi = bounds[i]
            if hi > lo:
                self._values[lo:hi] = grad.detach().reshape(-1).index_select(0, idx[lo:hi] - off).to(self._dtype)
        elif grad.numel():
            assert self._run is not None
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
                    if not self._is_open():
                        self._start()
                    self._fold(i, x.grad)
                    x.grad = None
            return self._finish() if self._gathering is None else self._gathered()
        finally:
            self._clear()
            self._gathering = None

    def gather(self, indices: torch.Tensor) -> None:
        """Make the next step gather the gradient at ``indices`` instead of selecting its top ``k``.

        For an optimizer that keeps its coordinate set for several steps
        (:func:`~functopk.sparse.sparse_optimizer`): the next backward copies each
        gradient's values at those flat indices (in the flat order of ``params``)
        and frees it, and :meth:`result` returns them as a
        :class:`~functopk.SparseUpdates` over all of ``params`` (zero where a
        parameter had no gradient), then goes back to selecting. Reads a few
        integers on the host (the indices' bounds per leaf).

        Args:
            indices: 1-d int64 (or int32) strictly ascending flat indices in ``[0, n)``, on the parameters' device.

        Raises:
            RuntimeError: The step's backward has already begun.
            TypeError: ``indices`` is not an integer tensor.
            ValueError: ``indices`` is not 1-d, not strictly ascending, out of range, or on another device.

        Example:
            >>> import torch, functopk as ft
            >>> w = torch.zeros(4, requires_grad=True)
            >>> stream = ft.sparse.StreamingTopK({"w": w}, k=2)
            >>> stream.gather(torch.tensor([0, 3]))
            >>> (w * torch.tensor([1.0, 5.0, -4.0, 2.0])).sum().backward()
            >>> stream.result()
            SparseUpdates(indices=tensor([0, 3]), values=tensor([1., 2.]), numel=4)
        """
        if self._is_open():
            raise RuntimeError("StreamingTopK.gather() must come before the step's backward, not during it")
        if not isinstance(indices, torch.Tensor) or indices.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"indices must be an int64 or int32 tensor, got {describe(indices)}")
        if indices.dim() != 1 or indices.device != self._leaves[0].device:
            raise ValueError(
                f"indices must be 1-d on {self._leaves[0].device} (the parameters' device), got shape "
                f"{tuple(indices.shape)} on {indices.device}"
            )
        idx = indices.long()
        check_ascending_indices(idx, self._numel, "indices")
        self._gathering = (idx, FlatLayout.from_tree(self._leaves).bounds(idx, name="indices"))

    def _gathered(self) -> SparseUpdates:
        """A gathering step's result: the gradient at its indices, over all of ``params``."""
        assert self._gathering is not None
        if self._values is None:  # no gradient arrived: zeros
            self._start()
        assert self._values is not None
        self._selected_from = self._treedef.unflatten(list(self._leaves))
        arrived = [self._folded[i] for i in sorted(self._folded)] or [self._dtype]
        dtype = functools.reduce(torch.promote_types, arrived)
        return SparseUpdates(self._gathering[0], self._values.to(dtype), self._numel, tuple(self._sizes))

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
