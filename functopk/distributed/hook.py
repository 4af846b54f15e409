"""``topk_hook``: a DDP communication hook with top-k sparse exchange and per-bucket error feedback.

Each bucket, in the order DDP calls the hook (the same on every rank):

* Step I (:meth:`TopKHookState._begin`): once, check the registration and
  that every rank is configured alike; commit the previous iteration's
  memory unless a value in it was non-finite.
* Step II (:meth:`TopKHookState._plan`): decide dense or compressed, fetch
  the bucket's memory, and count the bytes.
* Step III (:mod:`functopk.distributed.bucket`): add the residual, select,
  exchange and average, on this thread or (``overlap=True``) on the state's
  worker.

The first iteration after ``load_state_dict`` may instead reduce within the
saved buckets (:class:`functopk.distributed.resume.Regroup`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from functopk._checks import describe
from functopk.distributed.agree import check_agreement
from functopk.distributed.bucket import dense_bucket, sparse_bucket
from functopk.distributed.config import HookConfig
from functopk.distributed.names import model_info, registered_find_unused
from functopk.distributed.offload import Offloader
from functopk.distributed.residuals import ResidualStore
from functopk.distributed.resume import Layout, Regroup
from functopk.distributed.saved import FORMAT, VERSION, check_saved
from functopk.distributed.stats import HookStats
from functopk.distributed.tree import tree_wire_bytes
from functopk.distributed.wire import check_group_arg, resolve_group, wire_bytes

__all__ = ["HookStats", "TopKHookState", "topk_hook"]

Launch = Callable[[], "torch.futures.Future[torch.Tensor]"]


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
            Required with such a model, as the DDP model itself: the hook's
            first call raises ``ValueError`` if the state is registered on one
            but was built without it (or with the module it wraps).
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
        momentum: Momentum correction with momentum factor masking (Lin et al.
            2018, Deep Gradient Compression), in ``[0, 1)``; 0 (the default)
            turns it off. The hook keeps a local velocity ``u = momentum * u +
            grad`` per bucket and accumulates *it* in the residual, so a
            coordinate sent after waiting carries the momentum it would have
            had; where a value was sent, both are cleared. The hook then sends
            a momentum update: use an optimizer **without** momentum (e.g.
            ``SGD(momentum=0)``). Dense iterations (warm-up, buckets too small
            to compress) send ``u`` itself, i.e. plain momentum SGD. Costs one
            more pass and two more bucket-sized buffers per bucket. On the
            example's task it closes top-k's accuracy gap to dense momentum SGD
            (``docs/distributed.md``).
        exchange: ``"allgather"`` (one all-gather of every rank's ``k`` pairs:
            ``(P - 1) k`` pairs on the wire per rank, overlapped with the
            backward pass) or ``"tree"`` (gTop-k's tree, as
            ``distributed_topk(exchange="tree")``: ``log2(P) k`` pairs per rank
            in ``log2 P`` rounds of pairwise swaps, each keeping the top ``k``
            of the pair's sum; what a merge drops of a rank's pairs stays in
            that rank's residual; run synchronously, without overlap, see
            :mod:`functopk.distributed.hook_tree`). The tree always re-selects
            (``reselect`` is not consulted).
        overlap: Run each bucket's work (residual, selection, starting the
            exchange) on a worker thread of this state, so that the backward
            pass goes on computing the next layers meanwhile; the hook returns
            at once with a future. Buckets keep their order (one worker), and
            the iteration's last bucket runs on the calling thread after the
            others have started, before DDP's own collectives. Same results,
            bit for bit. It pays where a core is free for the worker (a rank
            with fewer compute threads than cores); see ``docs/distributed.md``.

    Attributes:
        config: The arguments above but ``process_group``, ``model`` and
            ``grad_scaler``, checked, as a frozen
            :class:`~functopk.distributed.config.HookConfig` (every rank compares
            them at the first call, so they cannot change afterwards); each is
            also readable as an attribute of its own name.
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
        TopKHookState(density=0.01, warmup_iters=5, reselect=False, momentum=0.0, iter=0)
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
        momentum: float = 0.0,
        exchange: str = "allgather",
        overlap: bool = False,
    ) -> None:
        check_group_arg(process_group, "process_group")
        self.process_group: dist.ProcessGroup | None = process_group
        self.config = HookConfig(
            density=density, warmup_iters=warmup_iters, reselect=reselect, selection=selection, momentum=momentum,
            exchange=exchange, overlap=overlap,
        )  # fmt: skip
        self._names, self._shapes, self.find_unused_parameters = model_info(model)
        if grad_scaler is not None and not isinstance(getattr(grad_scaler, "_enabled", None), bool):
            raise TypeError(f"grad_scaler must be a torch.amp.GradScaler or None, got {describe(grad_scaler)}")
        self._store = ResidualStore(self.config.momentum, grad_scaler, self._names)  # the buckets' memory
        # DDP rebuilds its buckets after a process's first iteration, unless it finds unused parameters (and
        # has no static graph)
        rebuilds = not self.find_unused_parameters or bool(getattr(model, "static_graph", True))
        self._layout = Layout(rebuilds)  # the buckets' parameters, for checkpoints (see resume.py)
        self._regroup: Regroup | None = None  # the first iteration after load_state_dict (see resume.py)
        self._saved_layout: tuple[tuple[str, ...], ...] | None = None
        self._offload = Offloader()
        self.iter: int = 0
        self.last_step: HookStats = HookStats()
        self.total: HookStats = HookStats()
        self._step: HookStats = HookStats()  # the running iteration's, so far
        self._agreed = False  # the other ranks' configuration has been checked
        # Given the DDP model, its find_unused_parameters is known; else the first call looks for it (see _begin)
        self._registration_checked = isinstance(model, DistributedDataParallel)

    def __repr__(self) -> str:
        tree = ", exchange='tree'" if self.exchange == "tree" else ""
        return (f"TopKHookState(density={self.density}, warmup_iters={self.warmup_iters}, "
                f"reselect={self.reselect}, momentum={self.momentum}{tree}, iter={self.iter})")  # fmt: skip

    # The configuration (frozen: the ranks compare it once), by its argument names.
    density = property(lambda self: self.config.density)
    warmup_iters = property(lambda self: self.config.warmup_iters)
    reselect = property(lambda self: self.config.reselect)
    selection = property(lambda self: self.config.selection)
    momentum = property(lambda self: self.config.momentum)
    exchange = property(lambda self: self.config.exchange)
    overlap = property(lambda self: self.config.overlap)

    @property
    def residuals(self) -> dict[tuple[Any, ...], torch.Tensor]:
        return self._store.residuals()

    @property
    def skipped_iters(self) -> int:
        return self._store.skipped_iters()

    @property
    def threshold_fallbacks(self) -> int:
        return self._store.threshold_fallbacks

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        """This rank's state as a plain dict (``torch.save`` / ``torch.load(weights_only=True)`` round-trip it).

        Residuals (and, with ``momentum``, velocities under ``"velocities"``) are
        keyed by parameter name (from ``model=``) and shaped like the
        parameters, in gradient units (divided by the loss scale they were kept
        at), so they load into any bucketing. ``"layout"`` lists the parameter
        names of each bucket of the last iteration, in order (``None`` after a
        process's first iteration, before DDP has rebuilt its buckets):
        :meth:`load_state_dict` uses it to select within the same buckets. They
        differ from rank to rank: save one file per rank (see
        ``docs/distributed.md``).

        Raises:
            ValueError: residuals exist but the state was built without ``model=``.
        """
        out = {
            "format": FORMAT, "version": VERSION,
            "density": self.density, "warmup_iters": self.warmup_iters, "reselect": self.reselect,
            "momentum": self.momentum, "exchange": self.exchange, "iter": self.iter,
            "skipped_iters": self.skipped_iters,
            "last_step": self.last_step._asdict(), "total": self.total._asdict(),
            "residuals": self._store.by_name("residual"),
            "layout": self._layout.names(self._names),
        }  # fmt: skip
        if self.momentum:
            out["velocities"] = self._store.by_name("velocity")
        return out

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore a :meth:`state_dict` (this rank's own): iteration count, statistics, residuals.

        The configuration (``density``, ``warmup_iters``, ``reselect``,
        ``momentum``, ``exchange``) is this state's own, not the saved one.
        Residuals (and velocities) are matched to parameters by name and placed
        into whatever buckets DDP builds next, bit for bit. Without saved
        velocities, a state with ``momentum`` starts them at zero. If the first
        iteration after loading finds DDP's buckets different from the saved
        ``"layout"`` (a new process starts with DDP's initial buckets), the hook
        reduces within the saved buckets instead, so that a resumed run takes
        the same steps as an uninterrupted one, bit for bit (that one iteration
        does not overlap communication with the backward pass).

        The whole dict is checked (every key, type and shape) before anything
        changes: a dict that fails leaves the state as it was.

        Raises:
            TypeError: a value of the wrong type (the message names its key),
                e.g. a ``"layout"`` that is not a list of lists of names.
            ValueError: not a ``topk_hook`` state dict; a key missing or
                unknown; residuals but no ``model=``; names unknown to the
                model, or shapes that differ from its parameters'; saved
                velocities but ``momentum=0`` (they would be lost).
        """
        saved = check_saved(state_dict, self._shapes, self.momentum)  # everything, before anything changes
        self.iter, self.last_step, self.total = saved.iter, saved.last_step, saved.total
        self._step, self._agreed = HookStats(), False
        self._store.load(saved.residuals, saved.velocities, saved.skipped_iters)
        pid_of = {name: pid for pid, name in self._names.items()}
        layout = saved.layout
        ids = None if layout is None else tuple(tuple(pid_of[n] for n in group) for group in layout)
        self._saved_layout = layout
        self._regroup = None if ids is None else Regroup(ids, self._layout, self._end_regroup)
        self._layout.load(ids)

    def _end_regroup(self) -> None:
        self._regroup = None

    # ------------------------------------------------------------------ the hook's steps

    def _begin(self, group: dist.ProcessGroup, rank: int, world: int, buf: torch.Tensor) -> None:
        """Check the configuration against DDP's and the other ranks' (once), and commit the previous iteration."""
        if not self._registration_checked:  # before any collective: every rank raises here alike
            if not self.find_unused_parameters and registered_find_unused(self):
                raise ValueError(
                    "topk_hook: this TopKHookState is registered on a DDP model built with "
                    "find_unused_parameters=True, but the state was built without that model (model=None or the "
                    "module DDP wraps), so it cannot hold back the residual of a parameter that a rank did not "
                    "use, and DDP would drop the gradient mass sent for it. Build the state with "
                    "TopKHookState(..., model=ddp_model)."
                )
            self._registration_checked = True
        if not self._agreed:
            check_agreement("topk_hook", {
                "density": self.density, "warmup_iters": self.warmup_iters, "reselect": self.reselect,
                "momentum": self.momentum, "exchange": self.exchange, "the iteration (state.iter)": self.iter,
                "the size of the first bucket": buf.numel(), "the gradient dtype": str(buf.dtype),
                "the loaded bucket layout": self._saved_layout,
            }, group, rank, world, buf.device)  # fmt: skip
            self._agreed = True
        self._store.settle()

    def _plan(self, bucket: Any) -> Launch:
        """Steps I and II for one bucket, on the calling thread; returns step III, ready to launch."""
        # Step I: the group; the one-time checks; the previous iteration's memory committed (or not).
        group, rank, world = resolve_group(self.process_group, "topk_hook")
        buf = bucket.buffer()
        self._begin(group, rank, world, buf)
        # Step II: dense or compressed; the bucket's memory and byte counts; the rest goes to bucket.py.
        store, n, vbytes = self._store, buf.numel(), buf.element_size()
        k = self.config.bucket_k(n)
        sent = wire_bytes(k, n, buf.dtype)
        if self.iter < self.warmup_iters or sent >= n * vbytes:  # dense: warm-up, or k pairs no smaller
            # After warm-up (or with a velocity to protect), a dense bucket still reports Inf/NaN.
            check = self.iter >= self.warmup_iters or bool(self.momentum)
            store.expect_flag(check)
            key, mem = store.memory(bucket, buf) if self.momentum else (None, None)
            self._record(bucket, HookStats(n * vbytes, n * vbytes, n * vbytes, n, n), key)
            return partial(dense_bucket, store, mem, buf, check, group, world)
        key, mem = store.memory(bucket, buf)
        store.expect_flag()
        if self.exchange == "tree":
            stats = HookStats(*tree_wire_bytes(k, n, buf.dtype, world, rank), n * vbytes, k, n)
        else:
            stats = HookStats(sent, sent * world, n * vbytes, k, n)
        self._record(bucket, stats, key)
        return partial(sparse_bucket, store, self.config, self.find_unused_parameters, mem, buf, k,
                       (group, rank, world))  # fmt: skip

    def _record(self, bucket: Any, stats: HookStats, key: tuple[Any, ...] | None) -> None:
        """Count the bucket; after the iteration's last one, close the iteration."""
        self._step = self._step + stats
        self._layout.add(key[0] if key is not None else tuple(map(id, bucket.parameters())))
        if bucket.is_last():
            self._layout.end()
            self.last_step, self.total = self._step, self.total + self._step
            self._step = HookStats()
            self._store.end_iteration()
            self.iter += 1


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
    ``warmup_iters``, ``reselect``, ``exchange``, iteration count and first bucket (one
    small collective) and raises ``ValueError`` naming the field otherwise;
    it also raises ``ValueError`` if the state is registered on a DDP model
    built with ``find_unused_parameters=True`` but was built without
    ``model=`` (the gradient mass of unused parameters would be lost).
    An iteration in which any rank's gradients are non-finite leaves every
    residual as it was (the averaged buckets still carry the Inf/NaN, so a
    ``GradScaler`` skips the step as with plain DDP); ``state.skipped_iters``
    counts such iterations.

    The collective is started asynchronously, so DDP overlaps it with the rest
    of the backward pass as for plain allreduce. If it fails (a peer died or
    timed out), the future fails with a ``RuntimeError`` that says so, and
    DDP raises it from ``backward()``.

    With ``TopKHookState(..., exchange="tree")`` each compressed bucket goes
    through gTop-k's tree instead (``log2 P`` rounds of pairwise swaps, as
    ``distributed_topk(exchange="tree")``): ``log2(P) k`` pairs sent and
    received per rank instead of the all-gather's ``k`` sent and ``P k``
    received, and a result that keeps the top ``k`` of each merge rather
    than of the exact sum (what a merge drops of this rank's pairs stays in
    its residual). The rounds depend on each other and run inside the hook
    call, which returns a completed future: the tree does not overlap with
    the backward pass (see :mod:`functopk.distributed.hook_tree` for why).

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
    regroup = state._regroup
    if regroup is not None and (deferred := regroup.arrive(bucket, partial(topk_hook, state))) is not None:
        return deferred  # the first iteration after load_state_dict, buckets unlike the saved ones (resume.py)
    launch = state._plan(bucket)
    if state.overlap:
        return state._offload.run(launch, inline=bucket.is_last())
    return launch()


# DDP's register_comm_hook compares the annotations with the real objects, and this
# module's annotations are strings (``from __future__ import annotations``).
topk_hook.__annotations__.update({"bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor]})
