"""An elementwise step added into the parameters batch by batch: slices of at most a cache's worth of elements.

``add_(params, inputs, body)`` does ``p += body(scratch, ps, *xs)`` over the
parameters, where ``body`` is the step's maths on lists of leaves (the same
function the whole-tensor step runs, e.g. an optimizer's formula with the
in-place writer of :mod:`functopk.tree.writer`): it may write its state leaves in
place, takes its temporaries from ``scratch`` (a :class:`Scratch`: the
:mod:`functopk.tree.foreach` functions, writing into rows reused from batch to
batch) and returns the updates. Instead of a whole update tree (on CPU, a fresh
parameter-sized tree costs first-touch page faults each step), ``body`` runs on
*batches* of at most :data:`CHUNK` elements: small leaves whole, several to a
batch, large ones cut into slices; each batch's updates are added into its
parameters at once, while they are still in cache. Per step: no parameter-sized
tree, a few scratch rows of at most ``CHUNK`` elements reused by every batch
(fresh temporaries per batch would cost page faults of their own) and kept for
the next call over the same parameters, and each tensor read and written once,
as a fused kernel would.

The numbers are those of the same kernels on whole tensors, bit for bit: CPU
elementwise kernels (``add`` with ``alpha``, ``mul``, ``div``, ``sqrt``, ``lerp``,
``addcmul``, ``maximum``) give each element the same value wherever it sits in
the range they run over (``tests/tree/test_chunked.py`` checks the ones the
steps use). ``body`` must not depend on which leaves share a batch: anything
computed over all leaves (a scalar's dtype) is computed before. A large leaf
that is not contiguous, or whose inputs are not, runs whole, in a batch of its own.

Example:
    >>> import torch
    >>> from functopk.tree import chunked
    >>> params, buf = [torch.ones(5)], [torch.arange(5.0)]
    >>> chunked.add_(params, [buf], lambda scratch, ps, bs: scratch.mul(bs, -0.5), chunk=2)
    >>> params[0]
    tensor([ 1.0000,  0.5000,  0.0000, -0.5000, -1.0000])
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = ["CHUNK", "Body", "Scratch", "add_", "applies"]

CHUNK = 1 << 20
"""Elements per batch: 4 MiB of float32 per temporary, which stays in a shared L3 cache. Measured on
ResNet-50's tree (2-core EPYC), 64 Ki-element slices cost more in per-kernel overhead (a kernel call and an
OpenMP region per slice) than they save; from 1 Mi elements a chunked SGD step matches torch's fused one."""

Leaves = Sequence[torch.Tensor]
Scalar = float | torch.Tensor
Body = Callable[..., list[torch.Tensor]]
"""``body(scratch, params, *inputs) -> updates``: elementwise maths on equal-shaped lists of leaves; may write
its state; its temporaries from ``scratch``."""


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def applies(params: Sequence[torch.Tensor]) -> bool:
    """Whether chunking pays and works: every parameter a plain tensor on the CPU.

    Elsewhere a foreach kernel per operation over all leaves beats a kernel per
    batch; tensor subclasses (an FSDP2 ``DTensor`` shard) take the whole-tensor
    path, whose kernels they dispatch.
    """
    return bool(params) and all(type(p) in _PLAIN and p.device.type == "cpu" for p in params)


class Scratch:
    """A batch's temporaries: :mod:`functopk.tree.foreach`'s fresh-output functions, computing into rows reused
    from batch to batch (each call of a function takes the next row; :meth:`start` begins a batch).

    Each function gives the numbers of its foreach namesake (the same kernel, one per leaf, with ``out=``;
    the result in the input's dtype). The rows, and their views shaped like each batch's members, are kept
    for the next call over the same parameters (:func:`add_` keeps the last one): no allocation per step.
    """

    def __init__(self, params: Sequence[torch.Tensor], chunk: int) -> None:
        self._size: dict[torch.dtype, int] = {}
        for p in params:  # a row holds a batch: at most chunk elements, at most every leaf of its dtype
            self._size[p.dtype] = min(chunk, self._size.get(p.dtype, 0) + p.numel())
        self._rows: dict[torch.dtype, list[torch.Tensor]] = {}
        self._batches: dict[int, tuple[Any, list[Any], bool, dict[int, list[torch.Tensor]]]] = {}
        self._batch, self._used = -1, 0
        self._issued: list[list[torch.Tensor]] = []  # (held: an id is not reused while the batch runs)

    def begin(self) -> None:
        """Begin a call: its batches are those of the last call over the same parameters, in the same order."""
        self._batch = -1

    def start(self, params: Sequence[torch.Tensor]) -> None:
        """Begin the next batch (of these parameters, or slices): every row is free again."""
        self._batch += 1
        members = tuple((p.dtype, p.shape) for p in params)
        if self._batches.get(self._batch, (None,))[0] != members:
            offsets: dict[torch.dtype, int] = {}
            at = []
            for p in params:
                off = offsets.get(p.dtype, 0)
                at.append((p.dtype, off, p.shape, p.device))
                offsets[p.dtype] = off + p.numel()
            self._batches[self._batch] = (members, at, all(n <= self._size[d] for d, n in offsets.items()), {})
        _, self._at, self._fits, self._views = self._batches[self._batch]
        self._used, self._issued = 0, []

    def owns(self, xs: Sequence[torch.Tensor]) -> bool:
        """Whether ``xs`` is a list of this batch's temporaries (one a function here returned, or wrote into)."""
        return any(xs is issued for issued in self._issued)

    def _take(self) -> list[torch.Tensor]:
        """A fresh-looking tensor per member of the batch, shaped like it, in the next row."""
        i, self._used = self._used, self._used + 1
        if not self._fits:  # a large strided leaf, whole: plain fresh tensors
            out = [torch.empty(shape, dtype=d, device=dev) for d, _, shape, dev in self._at]
        else:
            if i not in self._views:
                self._views[i] = [self._row(dtype, i, device)[off : off + shape.numel()].view(shape)
                                  for dtype, off, shape, device in self._at]  # fmt: skip
            out = list(self._views[i])
        self._issued.append(out)
        return out

    def _row(self, dtype: torch.dtype, i: int, device: torch.device) -> torch.Tensor:
        rows = self._rows.setdefault(dtype, [])
        while len(rows) <= i:
            rows.append(torch.empty(self._size[dtype], dtype=dtype, device=device))
        return rows[i]

    def _each(self, op: Callable[..., Any], lists: Sequence[Sequence[torch.Tensor]], *args: Any, **kw: Any) -> Any:
        """``op(*members, *args, out=row, **kw)`` for each member of the batch, into the next row."""
        outs = self._take()
        for members, out in zip(zip(*lists), outs):
            op(*members, *args, out=out, **kw)
        return outs

    def mul(self, xs: Leaves, scalar: Scalar) -> list[torch.Tensor]:
        return self._each(torch.mul, [xs], scalar)

    def add_scalar(self, xs: Leaves, scalar: Scalar) -> list[torch.Tensor]:
        return self._each(torch.add, [xs], scalar)

    def add_scaled(self, xs: Leaves, scalar: Scalar, ys: Leaves) -> list[torch.Tensor]:
        if isinstance(scalar, torch.Tensor):  # two kernels, as foreach.add_scaled
            return self._each(lambda x, y, out: torch.add(x, torch.mul(y, scalar, out=out), out=out), [xs, ys])
        return self._each(torch.add, [xs, ys], alpha=scalar)

    def addcmul(self, xs: Leaves, ys: Leaves, zs: Leaves, value: float = 1.0) -> list[torch.Tensor]:
        return self._each(torch.addcmul, [xs, ys, zs], value=value)

    def div(self, xs: Leaves, ys: Leaves) -> list[torch.Tensor]:
        return self._each(torch.div, [xs, ys])

    def neg(self, xs: Leaves) -> list[torch.Tensor]:
        return self._each(torch.neg, [xs])

    def abs(self, xs: Leaves) -> list[torch.Tensor]:  # noqa: A003 (foreach's name)
        return self._each(torch.abs, [xs])

    def sqrt(self, xs: Leaves) -> list[torch.Tensor]:
        return self._each(torch.sqrt, [xs])


_KEPT: dict[str, Any] = {}
"""The scratch of the last call of :func:`add_` and the parameters it was for."""


class _Batch:
    """Leaves (or slices of them) collected until they hold ``chunk`` elements, then stepped."""

    def __init__(self, body: Body, n_inputs: int, scratch: Scratch) -> None:
        self.body, self.size, self.scratch = body, 0, scratch
        self.params: list[torch.Tensor] = []
        self.inputs: list[list[torch.Tensor]] = [[] for _ in range(n_inputs)]

    def add(self, p: torch.Tensor, xs: Sequence[torch.Tensor]) -> None:
        self.params.append(p)
        for column, x in zip(self.inputs, xs):
            column.append(x)
        self.size += p.numel()

    def flush(self) -> None:
        if self.params:
            self.scratch.start(self.params)
            torch._foreach_add_(self.params, self.body(self.scratch, self.params, *self.inputs))
            self.params, self.inputs, self.size = [], [[] for _ in self.inputs], 0


def add_(
    params: Sequence[torch.Tensor], inputs: Sequence[Sequence[torch.Tensor]], body: Body, chunk: int | None = None
) -> None:
    """``p += body(scratch, ps, *xs)`` over the parameters, batch by batch (see the module). **Mutates** ``params``.

    Args:
        params: The tensors to add into (each with its own memory).
        inputs: Lists of leaves, each leaf shaped like its parameter.
        body: Computes a batch's updates (like the batch's parameters), its temporaries from its ``scratch``.
        chunk: Elements per batch (default :data:`CHUNK`).
    """
    chunk = CHUNK if chunk is None else chunk
    key = (chunk, tuple((p.data_ptr(), p.shape, p.dtype) for p in params))
    if _KEPT.get("key") != key:  # (the last call's scratch, for the same parameters)
        _KEPT.update(key=key, scratch=Scratch(params, chunk))
    scratch = _KEPT["scratch"]
    scratch.begin()
    batch = _Batch(body, len(inputs), scratch)
    for i, p in enumerate(params):
        xs = [x[i] for x in inputs]
        n = p.numel()
        if n > chunk and p.is_contiguous() and all(x.is_contiguous() for x in xs):
            batch.flush()
            flat_p, flat_xs = p.view(-1), [x.view(-1) for x in xs]
            for start in range(0, n, chunk):
                batch.add(flat_p[start : start + chunk], [x[start : start + chunk] for x in flat_xs])
                batch.flush()
            continue
        if batch.size + n > chunk:
            batch.flush()
        batch.add(p, xs)
    batch.flush()
