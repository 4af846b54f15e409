"""``topk_hook``: a DDP communication hook with top-k sparse exchange and per-bucket error feedback."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import partial
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from functopk._checks import check_bool, check_density, check_int, describe
from functopk.distributed.agree import check_agreement
from functopk.distributed.exchange import (
    _check_group_arg,
    _comm_error,
    _nonfinite,
    _receive,
    _resolve_group,
    _send,
    _wire_bytes,
)
from functopk.distributed.memory import BucketMemory, assemble, bucket_slots, commit, used_mask
from functopk.distributed.resume import Layout, Regroup, check_layout
from functopk.distributed.threshold import threshold_select
from functopk.sparse.api import k_from_density

__all__ = ["HookStats", "TopKHookState", "topk_hook"]

FORMAT = "functopk.topk_hook"


class HookStats(NamedTuple):
    """Communication counts of :func:`topk_hook`, for one rank.

    Attributes:
        bytes_sent: Bytes this rank handed to collectives: ``k * (index + value
            bytes)`` per compressed bucket, ``n * value bytes`` per dense one.
        bytes_gathered: Bytes of the collectives' results on this rank: ``P``
            times the above for compressed buckets, ``n * value bytes`` for dense.
        bytes_dense: What plain allreduce would have handed over: ``n * value bytes`` per bucket.
        coords_sent: Coordinates sent (``k`` per compressed bucket, ``n`` per dense one).
        coords: All coordinates of the buckets.

    Adding two ``HookStats`` adds them field by field.

    Example:
        >>> from functopk.distributed import HookStats
        >>> step = HookStats(bytes_sent=8, coords_sent=1, coords=100)
        >>> step + step
        HookStats(bytes_sent=16, bytes_gathered=0, bytes_dense=0, coords_sent=2, coords=200)
    """

    bytes_sent: int = 0
    bytes_gathered: int = 0
    bytes_dense: int = 0
    coords_sent: int = 0
    coords: int = 0

    def __add__(self, other: HookStats) -> HookStats:  # type: ignore[override]
        return HookStats(*(a + b for a, b in zip(self, other)))


class TopKHookState:
    """State of :func:`topk_hook`: configuration, per-bucket residuals, statistics.

    Args:
        process_group: The group to reduce over (default: the world).
        density: Fraction of each bucket's coordinates sent per step, in ``(0, 1]``;
            ``k = functopk.sparse.k_from_density(density, bucket size)``. A bucket for
            which ``k`` pairs would be no smaller than the dense bucket is
            allreduced densely.
        warmup_iters: Iterations of plain (dense, averaged) allreduce before
            compressing. DDP rebuilds its buckets after the first iteration;
            the residuals follow the parameters into the new buckets, but dense
            warm-up also helps accuracy early in training.
        reselect: gTop-k re-selection of each bucket's summed top ``k`` (see
            :func:`distributed_topk`).
        model: The DDP model (or the module it wraps). Gives the parameter names
            that :meth:`state_dict` and :meth:`load_state_dict` key residuals by
            (read once; no reference to the model is kept), and, from a DDP model
            built with ``find_unused_parameters=True``, turns on holding back the
            residual of parameters whose local gradient is all zero (DDP drops
            the averaged values of parameters no rank used; see ``docs/distributed.md``).
        grad_scaler: The ``torch.amp.GradScaler`` of the training loop, if any.
            Residuals hold *scaled* gradients; with the scaler known, each one is
            rescaled (exactly: scales are powers of two) when the loss scale
            changes, instead of being replayed at the old scale.
        selection: ``"exact"`` (rank the whole bucket every step) or
            ``"threshold"`` (reuse each bucket's previous ``k``-th magnitude to
            gather candidates, then rank only them; the whole bucket is ranked
            when there are fewer than ``k`` or far too many). Both select the
            same coordinates, bit for bit; only the speed differs (see
            ``docs/distributed.md`` and :mod:`functopk.distributed.threshold`).

    Attributes:
        iter: Iterations seen (counted when the last bucket of an iteration passes).
        residuals: Error-feedback memory per bucket (a ``dict`` built on access),
            keyed by the bucket's parameters (their identities, in order), size,
            dtype and device. When DDP rebuilds its buckets, each new bucket's
            residual is assembled from the old ones parameter by parameter; entries
            of buckets not seen in an iteration are then dropped at its end.
        threshold_fallbacks: With ``selection="threshold"``, the buckets (summed
            over iterations) whose previous threshold did not hold, so that the
            whole bucket was ranked (every bucket's first compressed step counts).
        skipped_iters: Compressed iterations whose residual update was skipped
            because some rank's gradients were non-finite (reading it syncs).
        find_unused_parameters: Whether all-zero local gradients keep their residual.
        last_step: :class:`HookStats` of the last finished iteration.
        total: :class:`HookStats` summed over all iterations.

    Example:
        >>> from functopk.distributed import TopKHookState
        >>> TopKHookState(density=0.01, warmup_iters=5)
        TopKHookState(density=0.01, warmup_iters=5, reselect=False, iter=0)
    """

    def __init__(
        self,
        process_group: dist.ProcessGroup | None = None,
        *,
        density: float = 0.01,
        warmup_iters: int = 10,
        reselect: bool = False,
        model: torch.nn.Module | None = None,
        grad_scaler: Any = None,
        selection: str = "exact",
    ) -> None:
        _check_group_arg(process_group, "process_group")
        self.process_group: dist.ProcessGroup | None = process_group
        self.density: float = float(check_density(density, allow_tensor=False))
        self.warmup_iters: int = check_int(warmup_iters, "warmup_iters", minimum=0)
        self.reselect: bool = check_bool(reselect, "reselect")
        self._names, self._numels, self.find_unused_parameters = _model_info(model)
        # DDP rebuilds its buckets after a process's first iteration, unless it finds unused parameters (and
        # has no static graph)
        rebuilds = not self.find_unused_parameters or bool(getattr(model, "static_graph", True))
        self._layout = Layout(rebuilds)  # the buckets' parameters, for checkpoints (see resume.py)
        self._regroup: Regroup | None = None  # the first iteration after load_state_dict (see resume.py)
        self._saved_layout: tuple[tuple[str, ...], ...] | None = None
        if grad_scaler is not None and not isinstance(getattr(grad_scaler, "_enabled", None), bool):
            raise TypeError(f"grad_scaler must be a torch.amp.GradScaler or None, got {describe(grad_scaler)}")
        self._scaler = grad_scaler
        if not isinstance(selection, str):
            raise TypeError(f"selection must be a str ('exact' or 'threshold'), got {describe(selection)}")
        if selection not in ("exact", "threshold"):
            raise ValueError(f"selection must be 'exact' or 'threshold', got {describe(selection)}")
        self.selection: str = selection
        self.threshold_fallbacks: int = 0
        self.iter: int = 0
        self.last_step: HookStats = HookStats()
        self.total: HookStats = HookStats()
        self._step: HookStats = HookStats()
        self._seen: set[tuple[Any, ...]] = set()
        self._buckets: dict[tuple[Any, ...], BucketMemory] = {}
        self._loaded: dict[str, torch.Tensor] = {}  # residuals from a checkpoint not yet placed in a bucket
        self._flags: list[torch.Tensor] = []  # per bucket of the running iteration (after warm-up): non-finite?
        self._expect = 0  # how many flags the running iteration's buckets will append
        self._commit_due = False
        self._agreed = False
        self._skipped: torch.Tensor | None = None
        self._skipped_before = 0
        self._scale_now: torch.Tensor | None = None  # the loss scale of the running iteration
        self._unit: torch.Tensor | float | None = None  # the loss scale the residuals are in (None: unscaled)

    def __repr__(self) -> str:
        return (f"TopKHookState(density={self.density}, warmup_iters={self.warmup_iters}, "
                f"reselect={self.reselect}, iter={self.iter})")  # fmt: skip

    @property
    def residuals(self) -> dict[tuple[Any, ...], torch.Tensor]:
        self._settle()
        return {key: mem.residual for key, mem in self._buckets.items()}

    @property
    def skipped_iters(self) -> int:
        self._settle()
        return self._skipped_before + (0 if self._skipped is None else int(self._skipped))

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        """This rank's state as a plain dict (``torch.save`` / ``torch.load(weights_only=True)`` round-trip it).

        Residuals are keyed by parameter name (from ``model=``) and shaped like
        the parameters, in gradient units (divided by the loss scale they were
        kept at), so they load into any bucketing. ``"layout"`` lists the
        parameter names of each bucket of the last iteration, in order (``None``
        after a process's first iteration, before DDP has rebuilt its buckets):
        :meth:`load_state_dict` uses it to select within the same buckets.
        Residuals differ from rank to rank: save one file per rank (see
        ``docs/distributed.md``).

        Raises:
            ValueError: residuals exist but the state was built without ``model=``.
        """
        self._settle()
        residuals = {name: t.clone() for name, t in self._loaded.items()}
        for mem in self._buckets.values():
            if mem.slots is None:
                raise ValueError("TopKHookState.state_dict: a bucket's parameters do not tile its buffer, so its "
                                 "residual cannot be saved by parameter")  # fmt: skip
            for s, piece in zip(mem.slots, mem.pieces(mem.residual)):
                if s.pid not in self._names:
                    raise ValueError("TopKHookState.state_dict needs the parameters' names: build the state with "
                                     "TopKHookState(..., model=ddp_model)")  # fmt: skip
                piece = piece.view(s.shape)
                residuals[self._names[s.pid]] = piece.clone() if self._unit is None else piece / self._unit
        return {
            "format": FORMAT, "version": 2,
            "density": self.density, "warmup_iters": self.warmup_iters, "reselect": self.reselect,
            "iter": self.iter, "skipped_iters": self.skipped_iters,
            "last_step": self.last_step._asdict(), "total": self.total._asdict(),
            "residuals": residuals, "layout": self._layout.names(self._names),
        }  # fmt: skip

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore a :meth:`state_dict` (this rank's own): iteration count, statistics, residuals.

        The configuration (``density``, ``warmup_iters``, ``reselect``) is this
        state's own, not the saved one. Residuals are matched to parameters by
        name and placed into whatever buckets DDP builds next, bit for bit. If
        the first iteration after loading finds DDP's buckets different from the
        saved ``"layout"`` (a new process starts with DDP's initial buckets), the
        hook reduces within the saved buckets instead, so that a resumed run
        takes the same steps as an uninterrupted one, bit for bit (that one
        iteration does not overlap communication with the backward pass).

        Raises:
            TypeError: a ``"layout"`` that is not a list of lists of names.
            ValueError: not a ``topk_hook`` state dict; residuals but no ``model=``;
                names unknown to the model, or sizes that differ from its parameters'.
        """
        if not isinstance(state_dict, Mapping) or state_dict.get("format") != FORMAT:
            raise ValueError(f"state_dict is not a TopKHookState.state_dict() (format {FORMAT!r}), "
                             f"got {describe(state_dict)}")  # fmt: skip
        residuals = dict(state_dict["residuals"])
        if residuals and not self._numels:
            raise ValueError("TopKHookState.load_state_dict needs the parameters' names to place the saved "
                             "residuals: build the state with TopKHookState(..., model=ddp_model)")  # fmt: skip
        unknown = sorted(set(residuals) - set(self._numels))
        resized = sorted(n for n, t in residuals.items() if n in self._numels and t.numel() != self._numels[n])
        if unknown or resized:
            raise ValueError(f"TopKHookState.load_state_dict: residuals that match no parameter of the model "
                             f"{_listed(unknown)}, or whose size differs from it {_listed(resized)}")  # fmt: skip
        saved = check_layout(state_dict.get("layout"), self._numels)
        self.iter = check_int(state_dict["iter"], "state_dict['iter']", minimum=0)
        self.last_step, self.total = HookStats(**state_dict["last_step"]), HookStats(**state_dict["total"])
        self._skipped_before, self._skipped = int(state_dict["skipped_iters"]), None
        self._buckets, self._flags, self._expect, self._seen, self._step = {}, [], 0, set(), HookStats()
        self._commit_due, self._agreed, self._scale_now = False, False, None
        self._unit = None if self._scaler is None else 1.0
        self._loaded = {name: t.detach().clone() for name, t in residuals.items()}
        by_name = {name: pid for pid, name in self._names.items()}
        ids = None if saved is None else tuple(tuple(by_name[n] for n in group) for group in saved)
        self._saved_layout, self._regroup = saved, None if ids is None else Regroup(ids)
        self._layout.last, self._layout.loaded, self._layout.running = ids, ids is not None, []

    # ------------------------------------------------------------------ the hook's steps

    def _begin(self, group: dist.ProcessGroup, rank: int, world: int, buf: torch.Tensor) -> None:
        """Check the configuration against the other ranks (once), and commit the previous iteration."""
        if not self._agreed:
            check_agreement("topk_hook", {
                "density": self.density, "warmup_iters": self.warmup_iters, "reselect": self.reselect,
                "the iteration (state.iter)": self.iter, "the size of the first bucket": buf.numel(),
                "the gradient dtype": str(buf.dtype), "the loaded bucket layout": self._saved_layout,
            }, group, rank, world, buf.device)  # fmt: skip
            self._agreed = True
        self._settle()

    def _settle(self) -> None:
        """Commit the finished iteration: each bucket's candidate residual, unless a value was non-finite."""
        if not self._commit_due:
            return
        pending = [mem for mem in self._buckets.values() if mem.pending]
        flags, expected, scale = self._flags, self._expect, self._scale_now
        self._commit_due, self._flags, self._expect, self._scale_now = False, [], 0, None
        if not pending:
            return
        if len(flags) < expected:  # an exchange never finished: keep the old residuals
            bad = torch.ones((), dtype=torch.bool, device=pending[0].residual.device)
        else:
            bad = torch.stack(flags).any()
        commit(pending, bad)
        self._skipped = bad.long() if self._skipped is None else self._skipped + bad
        if scale is not None:
            self._unit = scale if self._unit is None else torch.where(bad, self._unit, scale)

    def _memory(self, bucket: Any, buf: torch.Tensor) -> tuple[tuple[Any, ...], BucketMemory]:
        """The bucket's memory; a new one is assembled from the old buckets' and the loaded residuals."""
        key = (tuple(id(p) for p in bucket.parameters()), buf.numel(), buf.dtype, buf.device)
        mem = self._buckets.get(key)
        if mem is None:
            slots = bucket_slots(bucket, buf.numel())
            residual = torch.zeros_like(buf)
            if slots is not None:
                assemble(residual, slots, self._buckets.values(), self._names, self._loaded, self._unit)
            mem = self._buckets[key] = BucketMemory(residual, slots)
        return key, mem

    def _accumulate(self, mem: BucketMemory, buf: torch.Tensor) -> torch.Tensor:
        """``mem.scratch = buf + residual`` (the residual brought to the current loss scale): the candidate."""
        mem.pending = True
        scale = None if self._scaler is None else getattr(self._scaler, "_scale", None)
        if scale is not None:
            if self._scale_now is None:
                self._scale_now = scale.detach().clone()  # GradScaler.update changes _scale in place
            if self._unit is not None:
                return torch.addcmul(buf, mem.residual, self._scale_now / self._unit, out=mem.scratch)
        return torch.add(buf, mem.residual, out=mem.scratch)

    def _record(self, bucket: Any, stats: HookStats, key: tuple[Any, ...] | None) -> None:
        self._step = self._step + stats
        if key is not None:
            self._seen.add(key)
        self._layout.add(key[0] if key is not None else tuple(map(id, bucket.parameters())))
        if bucket.is_last():
            self._layout.end()
            self.last_step, self.total = self._step, self.total + self._step
            self._step = HookStats()
            if self.iter >= self.warmup_iters:
                for stale in set(self._buckets) - self._seen:
                    del self._buckets[stale]
            self._seen = set()
            self._commit_due = True
            self.iter += 1


def _model_info(model: Any) -> tuple[dict[int, str], dict[str, int], bool]:
    """``({id(param): name}, {name: numel}, find_unused_parameters)`` of the trainable parameters of ``model``."""
    if model is None:
        return {}, {}, False
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module (the DDP model or the module it wraps) or None, "
                        f"got {describe(model)}")  # fmt: skip
    find_unused = False
    if isinstance(model, DistributedDataParallel):
        find_unused, model = bool(model.find_unused_parameters), model.module
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    return {id(p): name for name, p in named}, {name: p.numel() for name, p in named}, find_unused


def _listed(names: list[str], limit: int = 5) -> str:
    if not names:
        return "(none)"
    return ", ".join(repr(n) for n in names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")


def topk_hook(state: TopKHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: average gradients with top-k sparse exchange and error feedback.

    Register with ``ddp_model.register_comm_hook(TopKHookState(...), topk_hook)``.
    For each bucket (DDP's flat gradient buffer, about 25 MB by default), after
    ``state.warmup_iters`` dense iterations: add the bucket's residual, send its
    ``k`` largest-magnitude entries (selection is per bucket, not over the whole
    model), keep the rest as the residual, and complete the returned future
    with the mean over ranks written into the bucket buffer. All ranks get
    bit-identical buckets.

    The first call checks that every rank has the same ``density``,
    ``warmup_iters``, ``reselect``, iteration count and first bucket (one
    small collective) and raises ``ValueError`` naming the field otherwise.
    An iteration in which any rank's gradients are non-finite leaves every
    residual as it was (the averaged buckets still carry the Inf/NaN, so a
    ``GradScaler`` skips the step as with plain DDP); ``state.skipped_iters``
    counts such iterations.

    The collective is started asynchronously, so DDP overlaps it with the rest
    of the backward pass as for plain allreduce. If it fails (a peer died or
    timed out), the future fails with a ``RuntimeError`` that says so, and
    DDP raises it from ``backward()``.

    Args:
        state: The hook's :class:`TopKHookState`.
        bucket: The gradient bucket DDP passes in.

    Returns:
        A future of the averaged dense bucket (the bucket buffer itself).

    Example:
        >>> import torch, torch.distributed as dist
        >>> from torch.nn.parallel import DistributedDataParallel as DDP
        >>> from functopk.distributed import TopKHookState, topk_hook
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # torchrun does this
        >>> model = DDP(torch.nn.Linear(100, 1))
        >>> state = TopKHookState(density=0.1, warmup_iters=1, model=model)
        >>> model.register_comm_hook(state, topk_hook)
        >>> for _ in range(3):
        ...     model(torch.randn(4, 100)).sum().backward()
        >>> state.last_step.coords_sent, state.last_step.coords, state.last_step.bytes_sent
        (10, 101, 80)
        >>> sorted(state.state_dict()["residuals"])  # one file per rank: torch.save(state.state_dict(), ...)
        ['bias', 'weight']
        >>> del model  # DDP holds the process group: release it first
        >>> dist.destroy_process_group()
    """
    if state._regroup is not None and (deferred := state._regroup.arrive(state, bucket, topk_hook)) is not None:
        return deferred  # the first iteration after load_state_dict, buckets unlike the saved ones (resume.py)
    group, rank, world = _resolve_group(state.process_group, "topk_hook")
    buf = bucket.buffer()
    state._begin(group, rank, world, buf)
    n, vbytes = buf.numel(), buf.element_size()
    k = k_from_density(state.density, n)
    assert isinstance(k, int)  # a Python density gives a Python count
    sent = _wire_bytes(k, n, buf.dtype)
    if state.iter < state.warmup_iters or sent >= n * vbytes:
        # After warm-up, a bucket too small to compress still reports Inf/NaN, for the other buckets' residuals.
        check = state.iter >= state.warmup_iters
        state._expect += check
        state._record(bucket, HookStats(n * vbytes, n * vbytes, n * vbytes, n, n), None)
        buf.div_(world)  # divide first, as DDP's default hook does
        work = dist.all_reduce(buf, group=group, async_op=True)

        def dense_done() -> torch.Tensor:
            if check:
                state._flags.append(~torch.isfinite(buf).all())
            return buf

        return work.get_future().then(_finisher(group, "the dense allreduce of topk_hook", dense_done))

    key, mem = state._memory(bucket, buf)
    state._expect += 1
    acc = state._accumulate(mem, buf)  # grads + residual: after _send, this iteration's candidate residual
    keep = used_mask(mem, buf) if state.find_unused_parameters else None
    state._record(bucket, HookStats(sent, sent * world, n * vbytes, k, n), key)
    what = "the sparse all-gather of topk_hook"
    # With unused parameters, select among parameters with a non-zero gradient only; the others keep their residual.
    eligible = acc if keep is None else torch.where(keep, acc, 0)
    select = None if state.selection == "exact" else partial(_threshold_select, state, mem)
    idx, vals, work, gathered = _send(eligible, k, group, world, what, async_op=True, select=select)
    if keep is not None:
        torch.where(keep, eligible, acc, out=acc)

    def finish() -> torch.Tensor:
        state._flags.append(_nonfinite(gathered, world, k, n, buf.dtype))
        return _receive(buf.zero_(), gathered, (idx, vals), acc, world, state.reselect)

    return work.get_future().then(_finisher(group, what, finish))


def _threshold_select(state: TopKHookState, mem: BucketMemory, flat: torch.Tensor, k: int):
    """``selection="threshold"``: the exact top ``k`` through the bucket's previous threshold."""
    idx, vals, mem.threshold, fell_back = threshold_select(flat, k, mem.threshold)
    state.threshold_fallbacks += fell_back
    return idx, vals


# DDP's register_comm_hook compares the annotations with the real objects, and this
# module's annotations are strings (``from __future__ import annotations``).
topk_hook.__annotations__.update({"bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor]})


def _finisher(
    group: dist.ProcessGroup, what: str, fn: Callable[[], torch.Tensor]
) -> Callable[[torch.futures.Future[Any]], torch.Tensor]:
    """A ``Future.then`` callback: re-raise a failed collective clearly, else return ``fn()``."""

    def callback(fut: torch.futures.Future[Any]) -> torch.Tensor:
        try:
            fut.wait()
        except Exception as exc:  # the backend's error type varies (RuntimeError, DistBackendError, ...)
            raise _comm_error(what, group, exc) from exc
        return fn()

    return callback
