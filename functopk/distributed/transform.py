"""``distributed_topk``: data-parallel averaging with top-k exchange, as a gradient transformation.

**Re-selection.** With ``reselect=True`` the summed vector is cut back to its
own top ``k`` (gTop-k, Shi et al. 2019, "A distributed synchronous SGD
algorithm with global top-k sparsification for low bandwidth networks"), so
the update is exactly ``k``-sparse across the group; each rank adds the values
it sent at the coordinates dropped there back into its residual, so no
gradient mass is lost. With ``exchange="allgather"`` the pairs still travel in
one all-gather: ``k`` pairs sent and ``P k`` received per rank.

**The tree.** ``exchange="tree"`` is gTop-k's communication as well (see
:mod:`functopk.distributed.tree`): ``log2 P`` rounds of pairwise swaps, each
re-selecting the top ``k`` of the pair's sum, so a rank sends and receives
``log2(P) * k`` pairs (``P`` not a power of two: one extra round for the
surplus ranks). It always re-selects (``reselect`` is not consulted) and keeps
a slightly different set than the all-gather's exact top ``k`` of the sum: a
coordinate dropped in an early round cannot come back with the mass of later
ones. What a merge drops from a rank's own pairs goes back into that rank's
residual, so no mass is lost either.

**The residual** lives inside this transformation rather than in a wrapping
``error_feedback``: what must be subtracted from ``acc`` is what *this rank
sent* (and, with ``reselect``, what the group dropped), which only the
exchange knows; the averaged update it emits is not that. It has the unit of
the transform's input: gradients when it comes first in a chain (momentum
after it then acts on the averaged update), parameter steps after
``scale_by_learning_rate`` (EF-SGD's form).

**Non-finite values.** NaN/Inf gradients rank as infinite magnitudes, are
sent, and reach every rank's update; in such a step every rank keeps its
residual as it was (``state.skipped`` counts these steps), so a step that is
then skipped (e.g. by :func:`functopk.apply_if_finite` around the chain, which
also keeps the old state) leaves no trace in the error-feedback memory.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from functopk._checks import check_leaves, check_state, describe
from functopk.base import GradientTransformation, Params, Updates
from functopk.distributed.agree import check_agreement, layout_code
from functopk.distributed.config import ExchangeConfig
from functopk.distributed.tree import tree_step, tree_wire_bytes
from functopk.distributed.wire import check_group_arg, nonfinite, receive, resolve_group, send, wire_bytes
from functopk.tree.layout import FlatLayout

__all__ = ["DistributedTopKState", "distributed_topk"]

_FORMAT = "functopk.distributed_topk"


class DistributedTopKState(NamedTuple):
    """State of :func:`distributed_topk`.

    Attributes:
        residual: This rank's error-feedback memory: a 1-d tensor over the flat
            layout of the parameters (``functopk.tree.FlatLayout`` order), in their
            promoted dtype, in the unit of the transform's input.
        count: Steps taken (int64, 0-d).
        bytes_sent: Bytes this rank put on the wire in the last step (int64, 0-d):
            ``k * (index bytes + value bytes)``.
        bytes_gathered: Bytes this rank received in the last step (int64,
            0-d): ``P`` times ``bytes_sent`` with the all-gather, about
            ``bytes_sent`` with ``exchange="tree"``.
        update_density: Fraction of coordinates that are non-zero in the last
            averaged update (float32, 0-d): between ``k / n`` (all ranks chose
            the same coordinates) and ``P * k / n``; at most ``k / n`` with
            ``reselect=True``.
        skipped: Steps whose residual update was skipped because a value sent
            by some rank was NaN or Inf (int64, 0-d): the residual stayed as it was.

    Example:
        >>> import torch, functopk as ft
        >>> state = ft.distributed.distributed_topk(2).init({"w": torch.zeros(3), "b": torch.zeros(1)})
        >>> state.residual, state.count
        (tensor([0., 0., 0., 0.]), tensor(0))
    """

    residual: torch.Tensor
    count: torch.Tensor  # type: ignore[assignment]
    bytes_sent: torch.Tensor
    bytes_gathered: torch.Tensor
    update_density: torch.Tensor
    skipped: torch.Tensor

    def state_dict(self, params: Params) -> dict[str, Any]:
        """This rank's state as a plain dict, the residual keyed by leaf path and shaped like the leaves.

        ``params`` (or any tree of the same structure and shapes, such as the
        gradients) gives the paths. Residuals differ between ranks: save one
        file per rank. ``torch.save`` / ``torch.load(weights_only=True)`` round-trip it.

        Example:
            >>> import torch, functopk as ft
            >>> params = {"w": torch.zeros(2), "b": torch.zeros(1)}
            >>> state = ft.distributed.distributed_topk(1).init(params)
            >>> state.state_dict(params)["residual"]
            {"['b']": tensor([0.]), "['w']": tensor([0., 0.])}
        """
        layout = _layout(params, "params")
        _check_residual(self.residual, layout)
        return {
            "format": _FORMAT, "version": 1,
            "count": self.count.clone(), "skipped": self.skipped.clone(),
            "residual": dict(zip(layout.leaf_paths(), (r.clone() for r in layout.split(self.residual)))),
        }  # fmt: skip

    def load_state_dict(self, state_dict: Mapping[str, Any], params: Params) -> DistributedTopKState:
        """A new state (states are immutable) with the residual and counts of a :meth:`state_dict`.

        Leaves are matched by path, not by position: ``ValueError`` names the
        paths that are missing, unknown, or of another size. The byte counters
        and ``update_density`` are this state's own.
        """
        if not isinstance(state_dict, Mapping) or state_dict.get("format") != _FORMAT:
            raise ValueError(f"state_dict is not a DistributedTopKState.state_dict() (format {_FORMAT!r}), "
                             f"got {describe(state_dict)}")  # fmt: skip
        layout = _layout(params, "params")
        _check_residual(self.residual, layout)
        saved, paths = state_dict["residual"], layout.leaf_paths()
        missing, unknown = sorted(set(paths) - set(saved)), sorted(set(saved) - set(paths))
        resized = [p for p, n in zip(paths, layout.numels) if p in saved and saved[p].numel() != n]
        if missing or unknown or resized:
            raise ValueError(f"DistributedTopKState.load_state_dict: residual leaves missing {missing}, "
                             f"unknown {unknown}, of another size {resized}")  # fmt: skip
        pieces = [saved[p].reshape(-1) for p in paths]
        residual = torch.cat(pieces).to(self.residual) if pieces else self.residual.clone()
        return self._replace(residual=residual, count=state_dict["count"].to(self.count),
                             skipped=state_dict["skipped"].to(self.skipped))  # fmt: skip


def distributed_topk(
    k: int | None = None,
    *,
    density: float | None = None,
    group: dist.ProcessGroup | None = None,
    reselect: bool = False,
    exchange: str = "allgather",
) -> GradientTransformation:
    """Data-parallel gradient averaging with sparse top-k communication and error feedback.

    Each rank, each step: ``acc = grads + residual``; send the ``k`` entries of
    largest ``|acc|`` (global over the whole tree, as :func:`functopk.topk`);
    keep the rest as the new residual; sum every rank's pairs
    (:func:`sparse_allreduce`'s exchange) and emit the mean over ranks as a
    dense tree with the structure and dtypes of the gradients. Every rank emits
    bit-identical updates, so replicas stay identical. Typically first in a
    chain: ``chain(distributed_topk(density=0.01), sgd(lr, momentum=0.9))``.

    With ``reselect=True`` the sum is cut back to its own top ``k`` (gTop-k,
    Shi et al. 2019), so the update is exactly ``k``-sparse; what a rank sent
    at the coordinates dropped there goes back into its residual, so no
    gradient mass is lost. ``exchange="tree"`` is gTop-k's communication too:
    ``log2 P`` rounds of pairwise swaps, each keeping the top ``k`` of the
    pair's sum (``log2(P) * k`` pairs per rank, instead of the all-gather's
    ``k`` sent and ``P k`` received); it always re-selects, and keeps a
    slightly different set than the exact top ``k`` of the sum. NaN and Inf
    are sent and reach every rank's update; in such a step every rank keeps
    its residual (``state.skipped`` counts these steps). More, and the
    residual's unit, in :mod:`functopk.distributed.transform`.

    ``init`` checks, in one small collective when a process group is
    initialised (every rank calls it alike), that every rank has the same tree
    layout (paths, shapes, dtypes), number of coordinates, ``k``, ``reselect``
    and ``exchange``, and raises ``ValueError`` naming the first field that
    differs (ranks would otherwise corrupt each other's updates silently, or
    wait on each other until the timeout). ``update`` has no host sync, and the
    state keeps its shapes and dtypes from step to step. The exchange is a
    collective, so a ``torch.compile``-d step graph-breaks there.

    ``k`` and ``density`` size the exchange buffers, so they are Python numbers,
    never tensors (with :func:`functopk.inject_hyperparams`, list them in
    ``static_args``).

    Args:
        k: Coordinates each rank sends per step.
        density: Instead of ``k``: the fraction of all coordinates sent per step
            (``k = functopk.sparse.k_from_density(density, n)``).
        group: The process group (default: the world), looked up at each update.
        reselect: Keep only the global top ``k`` of the sum (gTop-k).
        exchange: ``"allgather"`` (one all-gather, exact) or ``"tree"``
            (gTop-k's ``O(k log P)`` tree reduction, approximate re-selection).

    Example:
        >>> import torch, torch.distributed as dist, functopk as ft
        >>> from functopk.distributed import distributed_topk
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # torchrun does this
        >>> tx = distributed_topk(k=1)
        >>> state = tx.init({"w": torch.zeros(3)})
        >>> updates, state = tx.update({"w": torch.tensor([1.0, -3.0, 2.0])}, state)
        >>> updates["w"], state.residual, int(state.bytes_sent)
        (tensor([ 0., -3.,  0.]), tensor([1., 0., 2.]), 8)
        >>> dist.destroy_process_group()
    """
    config = ExchangeConfig(k=k, density=density, reselect=reselect, exchange=exchange)
    check_group_arg(group, "group")
    # Nothing mutable is captured: the frozen config and the group handle.
    return GradientTransformation(partial(_init, config, group), partial(_update, config, group))


def _init(config: ExchangeConfig, group: dist.ProcessGroup | None, params: Params) -> DistributedTopKState:
    """A zero residual over ``params``' flat layout; with a process group, the ranks' agreement checked."""
    layout = _layout(params, "params")
    k = config.k_for(layout.numel)
    device, dtype = layout.device, layout.common_dtype
    if group is not None or (dist.is_available() and dist.is_initialized()):
        grp, rank, world = resolve_group(group, "distributed_topk")
        check_agreement("distributed_topk", {
            "the number of coordinates": layout.numel,
            "the tree layout (paths, shapes, dtypes)": layout_code(layout.shapes, layout.dtypes, layout.treedef),
            "the residual dtype": str(dtype), "k": k, "reselect": config.reselect, "exchange": config.exchange,
        }, grp, rank, world, device)  # fmt: skip
    zero = torch.zeros((), dtype=torch.int64, device=device)
    return DistributedTopKState(
        residual=torch.zeros(layout.numel, dtype=dtype, device=device),
        count=zero,
        bytes_sent=zero,
        bytes_gathered=zero,
        update_density=torch.zeros((), dtype=torch.float32, device=device),
        skipped=zero,
    )


def _update(
    config: ExchangeConfig,
    group: dist.ProcessGroup | None,
    updates: Updates,
    state: DistributedTopKState,
    params: Params | None = None,
) -> tuple[Updates, DistributedTopKState]:
    """One step: error feedback, top-k exchange, mean over ranks (see :func:`distributed_topk`)."""
    del params
    # Step I: the updates' flat layout must be the state's; k and the group.
    check_state(state, DistributedTopKState, "distributed_topk")
    layout = _layout(updates, "updates")
    res = state.residual
    if layout.numel != res.numel() or layout.device != res.device:
        raise ValueError(
            f"updates have {layout.numel} coordinates on {layout.device}, but the state's residual has "
            f"{res.numel()} on {res.device}; init the state from parameters shaped like the updates"
        )
    k, n = config.k_for(layout.numel), layout.numel
    grp, rank, world = resolve_group(group, "distributed_topk")
    # Step II: acc = grads + residual (a fresh buffer: ours to change); send its top k, which leaves the
    # candidate residual in it; receive every rank's pairs as the mean (and, with gTop-k, put back the dropped).
    residual = layout.ravel(updates, dtype=res.dtype).add_(res)
    if config.exchange == "tree":
        mean, bad = tree_step(residual, k, grp, rank, world, "the tree exchange of distributed_topk")
        sent, received = tree_wire_bytes(k, n, res.dtype, world, rank)
    else:
        idx, vals, _, gathered = send(residual, k, grp, world, "the sparse all-gather of distributed_topk",
                                      async_op=False)  # fmt: skip
        mean = receive(torch.zeros_like(res), gathered, (idx, vals), residual, world, config.reselect)
        bad = nonfinite(gathered, world, k, n, res.dtype)
        sent = wire_bytes(k, n, res.dtype)
        received = sent * world
    # Step III: the new state; where any rank sent a NaN or Inf, the residual stays as it was.
    return layout.unravel(mean), DistributedTopKState(
        residual=torch.where(bad, res, residual, out=residual),
        count=state.count + 1,
        bytes_sent=torch.full_like(state.bytes_sent, sent),
        bytes_gathered=torch.full_like(state.bytes_gathered, received),
        update_density=(torch.count_nonzero(mean) / n).to(torch.float32),
        skipped=state.skipped + bad,
    )


def _check_residual(residual: torch.Tensor, layout: FlatLayout) -> None:
    if residual.numel() != layout.numel:
        raise ValueError(f"params have {layout.numel} coordinates but the state's residual has {residual.numel()}")


def _layout(tree: Params, name: str) -> FlatLayout:
    """The flat layout of ``tree`` after checking for floating-point tensor leaves on one device."""
    check_leaves(tree, name, floating=True)
    layout = FlatLayout.from_tree(tree)
    layout.device  # noqa: B018 - raises ValueError for leaves on several devices
    return layout
