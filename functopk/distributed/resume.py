"""Bit-for-bit resumption of ``topk_hook`` when DDP's buckets in a new process differ from the saved ones.

``topk_hook`` selects the top ``k`` *per bucket*, so the groups of parameters
that DDP puts into one bucket are part of the arithmetic. They are not stable
across a restart: with ``find_unused_parameters=False`` (the default) DDP
starts every process with a single bucket of all parameters (in definition
order) and, after the process's first iteration, rebuilds its buckets from the
order in which gradients became ready (``bucket_cap_mb`` applies from then on).
An uninterrupted run has long rebuilt when a restarted one takes its first
step with the initial bucket.

So the state remembers the layout (:class:`Layout`: which parameters each
bucket held, in order) and saves it with the checkpoint. In the first
iteration after ``load_state_dict``, :class:`Regroup` compares DDP's buckets
with the saved ones as they arrive. While they match, the hook runs as usual.
From the first that differs, it *defers*: each arriving bucket gets a future
that is not completed yet (DDP waits for the futures only at the end of
backward), and when the iteration's last bucket arrives, the gradients are
gathered by parameter into the saved buckets, each is reduced exactly as the
hook would have reduced it, and the averages are scattered back into DDP's
buffers before the futures are completed. Only that one iteration pays for it
(no overlap with backward, one copy of the gradients each way); every other
iteration is untouched.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import torch

from functopk._checks import describe
from functopk.distributed.futures import readable

__all__: list[str] = []

Ids = tuple[int, ...]  # the id()s of one bucket's parameters, in the bucket's order


class Layout:
    """The buckets of the iterations the hook has seen: each one's parameters (their ids), in order.

    ``last`` is the layout of the last finished iteration, or ``None`` where
    it does not tell what the next iteration will use: after a process's first
    iteration DDP rebuilds its buckets (unless it is known not to), and the
    rebuilt ones are not known yet. A layout loaded from a checkpoint is what
    the first iteration after it uses (:class:`Regroup` sees to it), so it is
    known then.
    """

    __slots__ = ("running", "last", "iters", "rebuilds", "loaded")

    def __init__(self, rebuilds: bool) -> None:
        self.running: list[Ids] = []
        self.last: tuple[Ids, ...] | None = None
        self.iters = 0  # iterations seen by this state in this process
        self.rebuilds = rebuilds  # does DDP rebuild its buckets after the process's first iteration?
        self.loaded = False  # the first iteration uses a layout loaded from a checkpoint

    def load(self, last: tuple[Ids, ...] | None) -> None:
        """A checkpoint's layout (``None``: unknown) is what the next iteration uses (see :class:`Regroup`)."""
        self.last, self.loaded, self.running = last, last is not None, []

    def add(self, ids: Ids) -> None:
        self.running.append(ids)

    def end(self) -> None:
        """The iteration's last bucket has passed."""
        self.iters += 1
        known = self.iters > 1 or self.loaded or not self.rebuilds
        self.last = tuple(self.running) if known else None
        self.running = []

    def names(self, names: Mapping[int, str]) -> list[list[str]] | None:
        """``last`` by parameter name, for a checkpoint (``None`` if unknown or a parameter has no name)."""
        if self.last is None or any(pid not in names for ids in self.last for pid in ids):
            return None
        return [[names[pid] for pid in ids] for ids in self.last]


def check_layout(layout: Any, params: Mapping[str, Any]) -> tuple[tuple[str, ...], ...] | None:
    """A saved layout (``state_dict["layout"]``) checked against the model's parameter names (``params``' keys).

    Raises:
        TypeError: not a list of lists of parameter names.
        ValueError: names unknown to the model (or no ``model=``), or a name in two buckets.
    """
    if layout is None:
        return None
    if not _sequence(layout) or not all(_sequence(g) and all(isinstance(n, str) for n in g) for g in layout):
        raise TypeError(f"state_dict['layout'] must be a list of lists of parameter names or None, "
                        f"got {describe(layout)}")  # fmt: skip
    flat = [n for g in layout for n in g]
    unknown = sorted(set(flat) - set(params))
    if unknown or len(set(flat)) != len(flat):
        raise ValueError(f"TopKHookState.load_state_dict: the saved bucket layout names parameters that the "
                         f"model (model=) does not have {unknown[:5]}, or a parameter twice")  # fmt: skip
    return tuple(tuple(g) for g in layout)


def _sequence(x: Any) -> bool:
    return isinstance(x, Sequence) and not isinstance(x, str)


class _Arrival(NamedTuple):
    buf: torch.Tensor
    params: list[torch.Tensor]
    fut: torch.futures.Future[torch.Tensor]


class _Group:
    """A stand-in for ``dist.GradBucket``: what ``topk_hook`` reads of a bucket."""

    def __init__(self, buf: torch.Tensor, params: list[torch.Tensor], last: bool) -> None:
        self._buf, self._params, self._last = buf, params, last

    def buffer(self) -> torch.Tensor:
        return self._buf

    def parameters(self) -> list[torch.Tensor]:
        return self._params

    def is_last(self) -> bool:
        return self._last


Hook = Callable[[Any], torch.futures.Future[torch.Tensor]]  # the hook bound to its state: bucket -> future


class Regroup:
    """The first iteration after ``load_state_dict``: reduce within the saved buckets, whatever DDP's are.

    Args:
        groups: The saved layout (parameter ids per bucket, in order).
        layout: The state's :class:`Layout`; marked as not loaded if the saved
            buckets turn out not to hold the arriving parameters.
        release: Called once this iteration needs no more regrouping (its owner then drops it), before the
            hook runs on the saved buckets.
    """

    def __init__(self, groups: tuple[Ids, ...], layout: Layout, release: Callable[[], None]) -> None:
        self.groups = groups
        self.layout = layout
        self.release = release
        self.start: int | None = None  # index of the first bucket that differed from the saved one
        self.arrived: list[_Arrival] = []

    def arrive(self, bucket: Any, hook: Hook) -> torch.futures.Future[torch.Tensor] | None:
        """``None``: let the hook reduce ``bucket`` as usual; else the (deferred) future to return for it."""
        params = bucket.parameters()
        if self.start is None:
            i = bucket.index()
            if i < len(self.groups) and tuple(map(id, params)) == self.groups[i]:
                if bucket.is_last():
                    self.release()
                return None
            self.start = i
        buf = bucket.buffer()
        fut: torch.futures.Future[torch.Tensor] = torch.futures.Future(devices=[buf.device] if buf.is_cuda else None)
        self.arrived.append(_Arrival(buf, params, fut))
        if not bucket.is_last():
            return readable(fut)  # _fail may fail fut with set_exception: DDP must see an error, not a value
        self.release()
        try:
            return self._reduce(hook)
        except BaseException as exc:
            self._fail(exc)
            raise

    def _reduce(self, hook: Hook) -> torch.futures.Future[torch.Tensor]:
        """Run the hook on the saved buckets (gathered from the arrived ones) and scatter the results back."""
        assert self.start is not None
        arrived, groups = self.arrived, self.groups[self.start :]
        pieces: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id -> (its slice of an arrived buffer, param)
        tiled = True
        for a in arrived:
            offset = 0
            for p in a.params:
                pieces[id(p)] = (a.buf[offset : offset + p.numel()], p)
                offset += p.numel()
            tiled = tiled and offset == a.buf.numel()
        same = (tiled and sorted(pid for ids in groups for pid in ids) == sorted(pieces)
                and len({(a.buf.dtype, a.buf.device) for a in arrived}) == 1)  # fmt: skip
        if same:
            stand_ins = [_Group(torch.cat([pieces[pid][0] for pid in ids]), [pieces[pid][1] for pid in ids], False)
                         for ids in groups]  # fmt: skip
        else:  # not the saved parameters (another model?): reduce DDP's buckets as they are, only later
            self.layout.loaded = False
            stand_ins = [_Group(a.buf, a.params, False) for a in arrived]
        stand_ins[-1]._last = True
        futs = [hook(g) for g in stand_ins]

        def done(all_done: torch.futures.Future[Any]) -> torch.Tensor:
            try:
                all_done.wait()  # raises the first failure (the others may still run)
                results = [f.wait() for f in futs]  # all complete now; wait() syncs CUDA streams
                for g, result in zip(stand_ins, results) if same else ():
                    offset = 0
                    for p in g.parameters():
                        pieces[id(p)][0].copy_(result[offset : offset + p.numel()])
                        offset += p.numel()
            except BaseException as exc:
                self._fail(exc)
                raise
            for a in arrived[:-1]:
                a.fut.set_result(a.buf)
            return arrived[-1].buf

        return torch.futures.collect_all(futs).then(done)

    def _fail(self, exc: BaseException) -> None:
        """Fail the deferred futures (DDP would otherwise wait for them forever)."""
        for a in self.arrived[:-1]:
            if not a.fut.done():
                a.fut.set_exception(exc)  # type: ignore[arg-type]  # torch types it as the result
