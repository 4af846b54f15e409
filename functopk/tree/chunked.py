"""An elementwise step added into the parameters chunk by chunk, through one cache-sized scratch buffer.

``add_(params, inputs, body)`` does ``p += body(scratch, p, *xs)`` for each
parameter ``p`` and its leaves ``xs`` of ``inputs``, where ``body`` is elementwise:
it may write its state leaves in place (a momentum buffer) and returns the
update, computed into the scratch rows it is given. Instead of a whole update
tree (on CPU, a fresh parameter-sized tree costs first-touch page faults each
step), ``body`` runs on slices of :data:`CHUNK` elements, whose scratch rows
stay in cache, and each slice's update is added into the parameter's slice at
once: per step one scratch buffer of ``rows * min(CHUNK, largest leaf)``
elements per dtype, and each tensor read and written once, as a fused kernel would.

The numbers are those of the same kernels on whole tensors, bit for bit: CPU
elementwise kernels (``add`` with ``alpha``, ``mul``, ``div``, ``sqrt``, ``lerp``,
``addcmul``, ``maximum``) give each element the same value wherever it sits in
the range they run over (``tests/tree/test_chunked.py`` checks the ones the
steps use). A leaf that is not contiguous, or whose inputs are not, runs whole,
with fresh scratch rows.

Example:
    >>> import torch
    >>> from functopk.tree import chunked
    >>> params, buf = [torch.ones(5)], [torch.arange(5.0)]
    >>> chunked.add_(params, [buf], lambda s, p, b: torch.mul(b, -0.5, out=s[0]), chunk=2)
    >>> params[0]
    tensor([ 1.0000,  0.5000,  0.0000, -0.5000, -1.0000])
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

__all__ = ["CHUNK", "Body", "add_", "applies"]

CHUNK = 1 << 20
"""Elements per slice: 4 MiB of float32 per scratch row, which stays in a shared L3 cache. Measured on
ResNet-50's tree (2-core EPYC), 64 Ki-element slices cost more in per-kernel overhead (a kernel call and an
OpenMP region per slice) than they save; from 1 Mi elements a chunked SGD step matches torch's fused one."""

Body = Callable[..., torch.Tensor]
"""``body(scratch_rows, p, *xs) -> update``: elementwise, on equal-shaped slices; may write its state slices."""


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def applies(params: Sequence[torch.Tensor]) -> bool:
    """Whether chunking pays and works: every parameter a plain tensor on the CPU.

    Elsewhere a foreach kernel per operation beats a kernel per slice; tensor
    subclasses (an FSDP2 ``DTensor`` shard) take the foreach path, whose
    kernels they dispatch, not slices with plain scratch rows.
    """
    return bool(params) and all(type(p) in _PLAIN and p.device.type == "cpu" for p in params)


def add_(
    params: Sequence[torch.Tensor],
    inputs: Sequence[Sequence[torch.Tensor]],
    body: Body,
    rows: int = 1,
    chunk: int | None = None,
) -> None:
    """``p += body(scratch, p, *xs)`` for each parameter, slice by slice (see the module). **Mutates** ``params``.

    Args:
        params: The tensors to add into (each with its own memory).
        inputs: Lists of leaves, each leaf shaped like its parameter.
        body: Computes a slice's update, into one of the ``rows`` scratch rows or in place.
        rows: Scratch rows ``body`` needs.
        chunk: Elements per slice (default :data:`CHUNK`).
    """
    chunk = CHUNK if chunk is None else chunk
    scratch: dict[torch.dtype, list[torch.Tensor]] = {}
    shaped: dict[tuple[torch.dtype, torch.Size], list[torch.Tensor]] = {}  # rows viewed as a leaf's shape
    for p, *xs in zip(params, *inputs):
        n = p.numel()
        if n <= chunk:  # (most leaves: the whole leaf is one slice, strided or not)
            s = shaped.get((p.dtype, p.shape))
            if s is None:
                s = shaped[p.dtype, p.shape] = [r[:n].view(p.shape) for r in _rows(scratch, p, params, rows, chunk)]
            p.add_(body(s, p, *xs))
        elif p.is_contiguous() and all(x.is_contiguous() for x in xs):
            flat_p, flat_xs, full = p.view(-1), [x.view(-1) for x in xs], _rows(scratch, p, params, rows, chunk)
            for start in range(0, n, chunk):
                stop = min(n, start + chunk)
                part = flat_p[start:stop]
                part.add_(body([r[: stop - start] for r in full], part, *(x[start:stop] for x in flat_xs)))
        else:
            p.add_(body([torch.empty_like(p) for _ in range(rows)], p, *xs))


def _rows(
    scratch: dict[torch.dtype, list[torch.Tensor]],
    p: torch.Tensor,
    params: Sequence[torch.Tensor],
    rows: int,
    chunk: int,
) -> list[torch.Tensor]:
    """The scratch rows for ``p``'s dtype: ``rows`` of ``min(chunk, largest leaf of that dtype)`` elements."""
    found = scratch.get(p.dtype)
    if found is None:
        most = max(q.numel() for q in params if q.dtype == p.dtype)
        found = scratch[p.dtype] = list(torch.empty((rows, min(chunk, most)), dtype=p.dtype, device=p.device))
    return found
