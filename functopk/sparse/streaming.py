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

The hooks are :class:`~functopk.sparse.hooks.GradientHooks` (weak, one stream
per parameter). Between selections the stream claims its supported layers'
weights (:mod:`functopk.sparse.layers`, :mod:`functopk.sparse.gathering`):
their gradient at the set arrives through a coordinate leaf's hook.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
import weakref
from collections.abc import Iterator
from typing import Any

import torch

from functopk._checks import check_bool, check_choice, check_k_or_density, check_leaves, one_device, path_str
from functopk.sparse import layers
from functopk.sparse.config import KernelConfig, config_or_default
from functopk.sparse.gathering import GatherPlan, checked_indices, stale
from functopk.sparse.hooks import GradientHooks
from functopk.sparse.k import k_on_host, resolve_k
from functopk.sparse.kernels.base import SUPPORTED_DTYPES, common_dtype
from functopk.sparse.layers import Claim
from functopk.sparse.running import RunningTopK
from functopk.sparse.updates import SparseUpdates, shift_indices
from functopk.tree.maths import PyTree

__all__ = ["StreamingTopK"]


def _nothing() -> None:
    """The release of a stream that does not claim layers."""


class StreamingTopK:
    """The exact global top-k of a tree's gradients, selected during backward; each gradient freed once folded.

    A post-accumulate-grad hook on every parameter of ``params`` that requires
    grad folds its gradient into a running top-``k`` over the whole tree and
    sets ``p.grad = None``. :meth:`result` then returns, bit for bit, what
    ``ft.topk_indices(grads, k)`` returns on the dense gradients: the flat order
    of ``params`` (optree's: a dict's keys sorted, not ``named_parameters()``
    order), ties to the lower flat index, NaN ranked as ``+inf``, exactly ``k``
    coordinates (a NaN passed through a wider dtype may change payload bits).
    Peak gradient memory is the largest parameter's gradient plus ``O(k)``.
    A step: ``loss.backward()``, ``sparse = stream.result()``,
    ``ft.apply_sparse_updates_(stream.selected_from, sparse, -lr)``.

    Parameters without a gradient are skipped (:attr:`selected_from`).
    :meth:`result` ends the step; a second backward before it raises
    ``RuntimeError``, unless ``grad_accumulation=True`` or the earlier ones ran
    under :meth:`paused`. After :meth:`gather` the step gathers at a fixed set,
    the weight gradients of ``nn.Linear``, ``Conv1D``, ``nn.Embedding`` and
    ``nn.Conv2d`` layers computed there only (``sampled=True``; equal within
    rounding). One stream per parameter; its hooks hold it weakly; :meth:`remove`
    or ``with`` removes them. ``docs/sparse_training.md`` says more (DDP and
    error feedback are not done).

    Args:
        params: A pytree of float tensors on one device (``dict(model.named_parameters())``),
            each a leaf of the autograd graph, each listed once.
        k: How many coordinates to keep (an int or a 0-d tensor, read on the host when a step
            starts; give exactly one of ``k`` and ``density``).
        density: The fraction of coordinates to keep, in ``(0, 1]`` (a number or a 0-d float tensor).
        score: ``"gradient"``: a step selects the top ``k`` of its gradient. ``"accumulated"``:
            of ``|g|`` summed over the steps since the last selecting step, this one
            included (steps after :meth:`gather` add to the sum, so they need every
            dense gradient: no sampled layers), as ``sparse_optimizer``'s
            ``score="accumulated"`` ranks them; the values returned are still the
            gradient's. The sum is one tensor per parameter (``n`` numbers).
        grad_accumulation: Several backward passes per step add up (see above).
        sampled: Between selections, compute the supported layers' weight gradients at the set only.
        config: The exact kernel's tuning constants (tests, benchmarks); ``None``: the defaults.

    Raises:
        TypeError: ``params`` is not a tree of supported float tensors (an iterator
            such as ``model.parameters()`` included), or an argument has the wrong type.
        ValueError: Not exactly one of ``k`` and ``density``, ``k`` above the number of
            coordinates, leaves on several devices or on the meta device, a tensor listed twice, one
            that is not a leaf, or one that another live stream has hooked.

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
        self,
        params: PyTree,
        k: Any = None,
        *,
        density: Any = None,
        score: str = "gradient",
        grad_accumulation: bool = False,
        sampled: bool = True,
        config: KernelConfig | None = None,
    ) -> None:
        self._k, self._density = check_k_or_density(k, density)
        self._accumulate = check_choice(score, "score", ("gradient", "accumulated")) == "accumulated"
        self._summing = check_bool(grad_accumulation, "grad_accumulation")
        self._sampled = check_bool(sampled, "sampled") and not self._accumulate  # the sums need dense gradients
        self._config = config_or_default(config)
        leaves, treedef = check_leaves(params, "params", dtypes=SUPPORTED_DTYPES)
        if one_device(leaves, "params").type == "meta":
            raise ValueError(
                "params are on the meta device: they have shapes but no values, and a top-k ranks values; "
                "materialize the model first (model.to_empty(device=...) and initialize it), then make the stream"
            )
        paths = [path_str(path) for path in treedef.paths()]
        self._leaves, self._paths, self._treedef = leaves, paths, treedef
        self._position = {id(x): i for i, x in enumerate(leaves)}
        self._selected_from: PyTree = None
        self._sizes = [x.numel() for x in leaves]
        self._offsets = [sum(self._sizes[:i]) for i in range(len(leaves))]  # in the flat order of params
        self._numel = sum(self._sizes)
        resolve_k(self._k, self._density, self._numel, name="params")  # k above n, or no coordinates at all
        self._dtype = common_dtype(leaves)
        self._paused = False
        self._plan: GatherPlan | None = None  # the set gather() names, kept while it stays the same
        self._gathering = False  # this step gathers at the plan's set (armed by gather(), ended by result())
        # score="accumulated": sum |g| per coordinate since the last selecting step (n-sized, one per leaf)
        self._scores = [x.new_zeros(x.shape) for x in leaves] if self._accumulate else None  # contiguous
        self._clear()
        self._removed = False
        # last, once everything is checked: weak hooks, one stream per parameter (ValueError naming it)
        self._hooks = GradientHooks(self, StreamingTopK._arrive, leaves, paths)
        self._release = weakref.finalize(self, layers.enable() if self._sampled else _nothing)

    def _clear(self) -> None:
        """An empty step: no candidates, nothing folded."""
        self._run: RunningTopK | None = None
        self._values: torch.Tensor | None = None  # a gathering step's values, in the order of its indices
        # slot -> its gradient's dtype; slot i: leaf i's own gradient, slot -1 - i: its sampled layers' (a claim's)
        self._folded: dict[int, torch.dtype] = {}
        self._scored = False  # a gathering step has added |g| into the accumulated sums (they cannot be taken back)

    def _is_open(self) -> bool:
        return self._run is not None or self._values is not None

    def _start(self) -> None:
        """Open a step: the running ``k`` is the one for all of ``params``, at least the final one."""
        self._clear()
        if self._gathering:
            assert self._plan is not None
            self._values = torch.zeros(self._plan.indices.shape, dtype=self._dtype, device=self._plan.indices.device)
            return
        k = k_on_host(resolve_k(self._k, self._density, self._numel, name="params"), self._numel)
        payload = self._dtype if self._accumulate else None  # rank by the score, carry the gradient
        self._run = RunningTopK(k, self._dtype, self._numel, self._config, self._leaves[0].device, payload)

    def _on_coordinates(self, i: int, leaf: torch.Tensor) -> None:
        """The hook of leaf ``i``'s coordinate leaf: the gradient of its sampled layers, at the set."""
        if self._paused or leaf.grad is None:
            return
        if not (self._gathering and self._plan is not None and self._plan.owns(i, leaf)):  # its set ended
            leaf.grad = None
            raise stale(self._paths[i])
        self._arrive(-1 - i, leaf)

    def _arrive(self, slot: int, tensor: torch.Tensor) -> None:
        """A slot's gradient arrived (leaf ``slot``'s hook, or a claim's): fold it into the step and free it."""
        if self._paused or tensor.grad is None or (self._summing and not self._gathering):
            return  # paused, or a selecting step of grad_accumulation: .grad accumulates until result()
        if not self._is_open():
            self._start()
        elif slot in self._folded and not self._summing:
            error = self._twice(slot)
            self._clear()
            raise error
        self._fold(slot, tensor.grad)
        tensor.grad = None

    def _twice(self, slot: int) -> RuntimeError:
        """The error of a gradient that arrives for a slot already folded in this step."""
        kept = " (its |g| stay in the accumulated sums: a gathering step adds them as they arrive)" * self._scored
        return RuntimeError(
            f"StreamingTopK: a second gradient of {self._paths[max(slot, -1 - slot)]} before result() (a second "
            "backward, or DDP writing its averaged gradients back: DDP is not supported); it was already folded into "
            f"this step's selection, which is now discarded{kept}: call result() after each backward, discard() (an "
            "optimizer's zero_grad()) to skip a batch, make the stream with grad_accumulation=True for several "
            "backward passes per step, or run the earlier micro-batches under `with stream.paused():`"
        )

    def _fold(self, slot: int, grad: torch.Tensor) -> None:
        """Fold a slot's gradient into the step (open): the running top ``k``, or its values at the set."""
        i = max(slot, -1 - slot)
        if grad.layout != torch.strided:
            raise TypeError(f"the gradient of {self._paths[i]} is {grad.layout}; StreamingTopK needs dense gradients")
        written = slot in self._folded or -1 - slot in self._folded  # this leaf's values already hold a gradient
        self._folded[slot] = grad.dtype
        flat = grad.detach().reshape(-1)
        if self._values is not None and self._plan is not None:
            if self._scores is not None:  # added now: keeping |g| until result() would take n more numbers
                self._scores[i].view(-1).add_(flat.abs())
                self._scored = True
            self._plan.write(self._values, i, flat, claimed=slot < 0, first=not written)
        elif grad.numel():
            assert self._run is not None
            if self._scores is None:
                self._run.add(flat, self._offsets[i])
            else:  # ranked by the sum with this step's |g|, never written: the sums restart at zero in result()
                score = flat.abs().add_(self._scores[i].view(-1))
                self._run.add(score, self._offsets[i], payload=flat.to(self._dtype))

    def _pending(self) -> list[tuple[int, torch.Tensor]]:
        """``(slot, tensor)`` for every tensor whose ``.grad`` a step may fold: the leaves and the coordinate leaves."""
        claimed = [] if self._plan is None else [(-1 - i, leaf) for i, leaf in self._plan.claim_leaves()]
        return [*enumerate(self._leaves), *claimed]

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
        self._check_live("result")
        try:
            for slot, x in self._pending():
                if x.grad is None or (slot < 0 and not self._gathering):
                    continue
                if slot in self._folded and not self._summing:
                    raise self._twice(slot)
                if not self._is_open():
                    self._start()
                self._fold(slot, x.grad)
                x.grad = None
            return self._gathered() if self._gathering else self._finish()
        finally:
            self._clear()
            self._gathering = False

    def gather(self, indices: torch.Tensor) -> None:
        """Make the next step gather the gradient at ``indices`` instead of selecting its top ``k``.

        For an optimizer that keeps its coordinate set for several steps: the
        next backward gathers each gradient at these flat indices (the supported
        layers compute theirs there only, ``sampled=True``), and :meth:`result`
        returns them over all of ``params`` (zero where a parameter had no
        gradient), then goes back to selecting. Reads the indices' bounds per
        leaf on the host when the set changes.

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
        self._check_live("gather")
        if self._is_open():
            raise RuntimeError("StreamingTopK.gather() must come before the step's backward, not during it")
        known = None if self._plan is None else self._plan.indices
        idx = checked_indices(indices, self._leaves[0].device, self._numel, known)
        if idx is not known:  # a new set
            self._plan = GatherPlan(idx, self._leaves)
        self._gathering = True

    def sampling_claim(self, weight: torch.Tensor) -> Claim | None:
        """What a supported layer using ``weight`` computes in this step: the claim at the gathered set, or ``None``.

        Asked by :mod:`functopk.sparse.layers` when such a layer runs with grad enabled.

        Example:
            >>> import torch, functopk as ft
            >>> w = torch.zeros(2, 3, requires_grad=True)
            >>> stream = ft.sparse.StreamingTopK([w], k=1)
            >>> stream.sampling_claim(w) is None               # a selecting step needs every coordinate
            True
            >>> stream.gather(torch.tensor([4]))
            >>> stream.sampling_claim(w).positions
            tensor([4])
        """
        i = self._position.get(id(weight))
        if not (self._sampled and self._gathering and self._plan is not None and i is not None):
            return None
        return self._plan.claim(i, weight, self, StreamingTopK._on_coordinates)

    def _gathered(self) -> SparseUpdates:
        """A gathering step's result: the gradient at its indices, over all of ``params``."""
        if self._values is None:  # no gradient arrived: zeros
            self._start()
        assert self._plan is not None and self._values is not None
        self._selected_from = self._treedef.unflatten(list(self._leaves))
        dtype = functools.reduce(torch.promote_types, [self._folded[i] for i in sorted(self._folded)] or [self._dtype])
        return SparseUpdates(self._plan.indices, self._values.to(dtype), self._numel, tuple(self._sizes))

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
        idx, vals, grads = self._run.top(k)
        if self._scores is not None:  # ranked by the accumulated score: the values are the gradient's; a new sum
            assert grads is not None
            vals = grads
            for x in self._scores:
                x.zero_()
        idx = shift_indices(idx, self._sizes, [i in self._folded for i in range(len(self._leaves))], to_all=False)
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

        Its flat indices count only the parameters that had a gradient: apply it to this tree.

        Example:
            >>> import torch, functopk as ft
            >>> params = {"used": torch.zeros(2, requires_grad=True), "unused": torch.zeros(3, requires_grad=True)}
            >>> stream = ft.sparse.StreamingTopK(params, k=1)
            >>> (params["used"] * torch.tensor([1.0, -2.0])).sum().backward()
            >>> sparse = stream.result()
            >>> _ = ft.apply_sparse_updates_(stream.selected_from, sparse, -1.0)
            >>> stream.selected_from["unused"] is None, params["used"]
            (True, tensor([0., 2.], requires_grad=True))
        """
        return self._selected_from

    @property
    def scores(self) -> list[torch.Tensor] | None:
        """With ``score="accumulated"``, the sums of ``|g|`` since the last selecting step; else ``None``.

        One per leaf of ``params`` (flat order), the stream's own: a checkpoint saves them, a resume ``copy_``-s them.

        Example:
            >>> import torch, functopk as ft
            >>> w = torch.zeros(3, requires_grad=True)
            >>> stream = ft.sparse.StreamingTopK([w], k=1, score="accumulated")
            >>> stream.gather(torch.tensor([0]))
            >>> (w * torch.tensor([1.0, -2.0, 0.5])).sum().backward()
            >>> _ = stream.result()
            >>> stream.scores
            [tensor([1.0000, 2.0000, 0.5000])]
        """
        return self._scores

    @property
    def started(self) -> bool:
        """Whether this step has a gradient: folded by a backward, or kept in ``.grad`` for :meth:`result`.

        Example:
            >>> import torch, functopk as ft
            >>> w = torch.ones(2, requires_grad=True)
            >>> stream = ft.sparse.StreamingTopK([w], k=1)
            >>> before = stream.started
            >>> w.sum().backward()
            >>> before, stream.started
            (False, True)
        """
        return self._is_open() or any(x.grad is not None for _, x in self._pending())

    @property
    def nbytes(self) -> int:
        """Bytes the running selection holds now (its indices and values): ``O(k)``.

        Example:
            >>> import torch, functopk as ft
            >>> ft.sparse.StreamingTopK([torch.ones(4, requires_grad=True)], k=2).nbytes
            0
        """
        return 0 if self._run is None else self._run.nbytes

    def discard(self) -> None:
        """End the step without a selection, as ``zero_grad()`` discards ``.grad``: to skip a batch.

        Drops what the step's backward folded and any ``.grad`` left (a paused
        backward's); a :meth:`gather` stays armed. With ``score="accumulated"``
        a gathering step's ``|g|`` were added as they arrived, and stay (a ``UserWarning``).

        Example:
            >>> import torch, functopk as ft
            >>> w = torch.zeros(3, requires_grad=True)
            >>> stream = ft.sparse.StreamingTopK([w], k=1)
            >>> (w * torch.tensor([9.0, 0.0, 0.0])).sum().backward()     # a batch to skip
            >>> stream.discard()
            >>> (w * torch.tensor([0.0, 1.0, 0.0])).sum().backward()
            >>> stream.result()
            SparseUpdates(indices=tensor([1]), values=tensor([1.]), numel=3)
        """
        if self._scored:
            warnings.warn(
                "StreamingTopK.discard(): this gathering step's |g| were already added to the accumulated sums "
                "(score='accumulated') as they arrived, and stay there: the next selection ranks by them",
                UserWarning,
                stacklevel=2,
            )
        self._clear()
        for _, x in self._pending():
            x.grad = None

    def _check_live(self, method: str) -> None:
        if self._removed:
            raise RuntimeError(f"StreamingTopK.{method}() after remove(): its hooks are gone; make a new stream")

    def remove(self) -> None:
        """Remove the hooks now: later backward passes leave ``.grad`` as autograd writes it.

        What the end of a ``with`` block does; again: nothing. An unfinished step is discarded, the
        parameters are free for another stream, and :meth:`result` and :meth:`gather` raise ``RuntimeError``.

        Example:
            >>> import torch, functopk as ft
            >>> w = torch.ones(2, requires_grad=True)
            >>> with ft.sparse.StreamingTopK([w], k=1):   # the hooks live for the block
            ...     pass
            >>> w.sum().backward(); w.grad
            tensor([1., 1.])
        """
        self._hooks.remove()
        self._release()  # the layers' global hooks, unless another user holds them
        self._clear()
        self._plan, self._gathering = None, False
        self._removed = True

    def __enter__(self) -> StreamingTopK:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()
