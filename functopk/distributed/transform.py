"""``distributed_topk``: data-parallel averaging with top-k exchange, as a gradient transformation."""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist

from functopk._checks import check_bool, check_k_or_density, check_leaves, check_state
from functopk.base import GradientTransformation, Params, Updates
from functopk.distributed.exchange import _check_group_arg, _receive, _resolve_group, _send, _wire_bytes
from functopk.sparse.api import resolve_k
from functopk.tree.layout import FlatLayout

__all__ = ["DistributedTopKState", "distributed_topk"]


class DistributedTopKState(NamedTuple):
    """State of :func:`distributed_topk`.

    Attributes:
        residual: This rank's error-feedback memory: a 1-d tensor over the flat
            layout of the parameters (``functopk.tree.FlatLayout`` order), in their
            promoted dtype, in the unit of the transform's input.
        count: Steps taken (int64, 0-d).
        bytes_sent: Bytes this rank put on the wire in the last step (int64, 0-d):
            ``k * (index bytes + value bytes)``.
        bytes_gathered: Bytes every rank received in the last step (int64,
            0-d): ``P`` times ``bytes_sent``.
        update_density: Fraction of coordinates that are non-zero in the last
            averaged update (float32, 0-d): between ``k / n`` (all ranks chose
            the same coordinates) and ``P * k / n``; at most ``k / n`` with
            ``reselect=True``.

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


def distributed_topk(
    k: int | None = None,
    *,
    density: float | None = None,
    group: dist.ProcessGroup | None = None,
    reselect: bool = False,
) -> GradientTransformation:
    """Data-parallel gradient averaging with sparse top-k communication and error feedback.

    Each rank, each step: ``acc = grads + residual``; send the ``k`` entries of
    largest ``|acc|`` (global over the whole tree, as :func:`functopk.topk`);
    keep the rest as the new residual; sum every rank's pairs
    (:func:`sparse_allreduce`'s exchange) and emit the mean over ranks as a
    dense tree with the structure and dtypes of the gradients. Every rank emits
    bit-identical updates, so replicas stay identical. Typically first in a
    chain: ``chain(distributed_topk(density=0.01), sgd(lr, momentum=0.9))``.

    With ``reselect=True`` the summed vector is cut back to its own top ``k``
    (gTop-k, Shi et al. 2019, "A distributed synchronous SGD algorithm with
    global top-k sparsification for low bandwidth networks"), so the update is
    exactly ``k``-sparse across the group; each rank adds the values it sent at
    the coordinates dropped there back into its residual, so no gradient mass
    is lost. The exchange is still one all-gather (not gTop-k's tree
    reduction): the bytes on the wire are the same either way.

    The residual lives inside this transformation rather than in a wrapping
    ``error_feedback``: what must be subtracted from ``acc`` is what *this rank
    sent* (and, with ``reselect``, what the group dropped), which only the
    exchange knows; the averaged update it emits is not that.

    Runs eagerly: the exchange is a ``torch.distributed`` collective, so a
    ``torch.compile``-d step graph-breaks there. It has no host sync, and the
    state keeps its shapes and dtypes from step to step. NaN/Inf gradients rank
    as infinite magnitudes, are sent, and reach every rank's update.

    ``k`` and ``density`` size the exchange buffers, so they are Python numbers,
    never tensors (with :func:`functopk.inject_hyperparams`, list them in
    ``static_args``).

    The residual has the unit of the transform's input: gradients when it comes
    first in a chain (momentum after it then acts on the averaged update),
    parameter steps after ``scale_by_learning_rate`` (EF-SGD's form).

    Args:
        k: Coordinates each rank sends per step.
        density: Instead of ``k``: the fraction of all coordinates sent per step
            (``k = functopk.sparse.k_from_density(density, n)``).
        group: The process group (default: the world), looked up at each update.
        reselect: Keep only the global top ``k`` of the sum (gTop-k).

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
    k, density = check_k_or_density(k, density, allow_tensor=False)
    _check_group_arg(group, "group")
    check_bool(reselect, "reselect")

    def init(params: Params) -> DistributedTopKState:
        layout = _layout(params, "params")
        _count(k, density, layout.numel)
        device = layout.device
        zero = torch.zeros((), dtype=torch.int64, device=device)
        return DistributedTopKState(
            residual=torch.zeros(layout.numel, dtype=layout.common_dtype, device=device),
            count=zero,
            bytes_sent=zero,
            bytes_gathered=zero,
            update_density=torch.zeros((), dtype=torch.float32, device=device),
        )

    def update(
        updates: Updates, state: DistributedTopKState, params: Params | None = None
    ) -> tuple[Updates, DistributedTopKState]:
        del params
        check_state(state, DistributedTopKState, "distributed_topk")
        layout = _layout(updates, "updates")
        res = state.residual
        if layout.numel != res.numel() or layout.device != res.device:
            raise ValueError(
                f"updates have {layout.numel} coordinates on {layout.device}, but the state's residual has "
                f"{res.numel()} on {res.device}; init the state from parameters shaped like the updates"
            )
        kk = _count(k, density, layout.numel)
        grp, _, world = _resolve_group(group, "distributed_topk")
        residual = layout.ravel(updates, dtype=res.dtype).add_(res)  # a fresh buffer: ours to change
        idx, vals, _, gathered = _send(residual, kk, grp, world, "the sparse all-gather of distributed_topk",
                                       async_op=False)  # fmt: skip
        mean = _receive(torch.zeros_like(res), gathered, (idx, vals), residual, world, reselect)
        sent = _wire_bytes(kk, layout.numel, res.dtype)
        new_state = DistributedTopKState(
            residual=residual,
            count=state.count + 1,
            bytes_sent=torch.full_like(state.bytes_sent, sent),
            bytes_gathered=torch.full_like(state.bytes_gathered, sent * world),
            update_density=(torch.count_nonzero(mean) / layout.numel).to(torch.float32),
        )
        return layout.unravel(mean), new_state

    return GradientTransformation(init, update)


def _layout(tree: Params, name: str) -> FlatLayout:
    """The flat layout of ``tree`` after checking for floating-point tensor leaves on one device."""
    check_leaves(tree, name, floating=True)
    layout = FlatLayout.from_tree(tree)
    layout.device  # noqa: B018 - raises ValueError for leaves on several devices
    return layout


def _count(k: int | None, density: float | None, numel: int) -> int:
    """The pairs each rank sends for a tree of ``numel`` coordinates (a Python int: it sizes the buffers)."""
    count = resolve_k(k, density, numel, name="the tree")
    assert isinstance(count, int)  # k and density are Python numbers here
    return count
