"""The hook's error-feedback memory: one residual per DDP bucket, re-assembled by parameter.

DDP's buckets are flat buffers holding several parameters' gradients back to
back. A bucket's residual is a buffer of the same layout. Two things make a
bucket-keyed residual fragile, and this module handles both:

* DDP rebuilds its buckets (after the first iteration, and in every new process
  after a restart), so a residual must be movable to a bucket with another
  parameter order. Each bucket records where each of its parameters lies
  (:class:`Slot`), and a new bucket is filled parameter by parameter from the
  buckets that held them before, or from a loaded checkpoint (by name).
* A step may have to be undone (non-finite gradients), so each bucket keeps
  the committed residual and, while an iteration runs, the candidate one
  (``scratch``); the iteration's verdict picks one of the two on device,
  without a host sync (:func:`commit`).

With momentum correction (``TopKHookState(momentum=...)``) a bucket also keeps
a velocity, handled the same way (committed ``velocity``, candidate
``vscratch``, re-assembled and saved by parameter).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, NamedTuple

import torch

__all__: list[str] = []


class Slot(NamedTuple):
    """Where one parameter lies in a bucket."""

    pid: int  # id() of the parameter (valid while the process runs)
    offset: int
    numel: int
    shape: torch.Size


class BucketMemory:
    """One bucket's residual and velocity (committed) and their candidates of the running iteration."""

    __slots__ = ("residual", "scratch", "velocity", "vscratch", "slots", "pending", "vpending", "threshold")

    def __init__(
        self, residual: torch.Tensor, slots: tuple[Slot, ...] | None, velocity: torch.Tensor | None = None
    ) -> None:
        self.residual = residual
        self.scratch = torch.empty_like(residual)
        self.velocity = velocity  # None without momentum correction
        self.vscratch = None if velocity is None else torch.empty_like(velocity)
        self.slots = slots  # None when the bucket's parameters do not tile its buffer (then no re-assembly)
        self.pending = False  # scratch holds an uncommitted candidate residual
        self.vpending = False  # vscratch holds an uncommitted candidate velocity
        self.threshold: float | None = None  # selection="threshold": slack times the last k-th magnitude

    def pieces(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Per-parameter views of a flat tensor laid out like this bucket."""
        assert self.slots is not None
        return [flat[s.offset : s.offset + s.numel] for s in self.slots]


def bucket_slots(bucket: Any, numel: int) -> tuple[Slot, ...] | None:
    """Each parameter's place in the bucket: DDP lays them out back to back, in ``parameters()`` order.

    ``None`` when their sizes do not add up to the buffer's (a bucket that is
    not laid out as DDP does): such a bucket keeps its residual but cannot be
    re-assembled or saved by parameter.
    """
    slots, offset = [], 0
    for p in bucket.parameters():
        slots.append(Slot(id(p), offset, p.numel(), p.shape))
        offset += p.numel()
    return tuple(slots) if offset == numel else None


def assemble(
    target: torch.Tensor,
    field: str,
    slots: tuple[Slot, ...],
    others: Iterable[BucketMemory],
    names: dict[int, str],
    loaded: dict[str, torch.Tensor],
    unit: torch.Tensor | float | None,
) -> None:
    """Fill a new bucket's zeroed ``target`` (its ``field``: residual or velocity) parameter by parameter.

    A parameter's slice comes from the bucket that held it before (DDP rebuilt
    its buckets), else from ``loaded`` by its name (a checkpoint, in gradient
    units: multiplied by ``unit``, the loss scale the memory is kept at; the
    entry is consumed), else stays zero. Values are copied bit for bit (loss
    scales are powers of two).
    """
    where: dict[int, tuple[torch.Tensor, Slot]] = {}
    for mem in others:
        source = getattr(mem, field)
        for s in mem.slots if source is not None and mem.slots is not None else ():
            where[s.pid] = (source, s)
    for s in slots:
        piece = target[s.offset : s.offset + s.numel]
        if s.pid in where:
            source, old = where[s.pid]
            piece.copy_(source[old.offset : old.offset + old.numel])
        elif names.get(s.pid) in loaded:
            piece.copy_(loaded.pop(names[s.pid]).reshape(-1))
            if unit is not None:
                piece.mul_(unit)


def commit(pending: list[BucketMemory], bad: torch.Tensor) -> None:
    """End of an iteration: each candidate becomes the residual (velocity) unless ``bad`` (a 0-d bool, on device).

    One ``torch.where`` per buffer, on integer views of the bits (the widest
    word that divides the buffer): bit for bit, NaN-proof, and on CPU about
    twice as fast as on the floats.
    """
    for mem in pending:
        for flag, kept, candidate in (("pending", mem.residual, mem.scratch), ("vpending", mem.velocity, mem.vscratch)):
            if getattr(mem, flag):
                assert kept is not None and candidate is not None
                torch.where(bad, _words(kept), _words(candidate), out=_words(kept))
                setattr(mem, flag, False)


def _words(t: torch.Tensor) -> torch.Tensor:
    """The bits of a contiguous 1-d buffer of our own (storage offset 0) as the widest integer words."""
    raw = t.view(torch.uint8)
    for dtype, size in ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2)):
        if raw.numel() % size == 0:
            return raw.view(dtype)
    return raw


def used_mask(mem: BucketMemory, buf: torch.Tensor) -> torch.Tensor | None:
    """Per coordinate: does it belong to a parameter with a non-zero gradient in ``buf``?

    DDP (``find_unused_parameters=True``) zero-fills the slices of parameters
    this rank did not use, and drops the averaged values of parameters that no
    rank used. Holding back every parameter whose local gradient is all zero
    covers both, and loses nothing: a used parameter with an all-zero gradient
    just keeps its residual one more step. NaN and Inf count as used.
    ``None`` for a bucket without slots.
    """
    if mem.slots is None:
        return None
    norms = torch._foreach_norm(mem.pieces(buf), ord=1)  # exact zero test: no squares to underflow
    used = torch.stack(norms) != 0
    return torch.cat([u.expand(s.numel) for u, s in zip(used, mem.slots)])


def mask_velocity(
    velocity: torch.Tensor, idx: torch.Tensor, residual: torch.Tensor | None, held: torch.Tensor | None
) -> None:
    """Zero ``velocity`` at the sent ``idx``: with gTop-k (``residual`` given) only where nothing was put
    back, and never at coordinates held back (``held`` False: unused parameters, which send nothing)."""
    if residual is None and held is None:
        velocity.index_fill_(0, idx, 0)
        return
    spent = torch.ones_like(idx, dtype=torch.bool) if held is None else held[idx]
    if residual is not None:
        spent &= residual[idx] == 0
    velocity.index_put_((idx,), torch.where(spent, 0.0, velocity[idx]))
