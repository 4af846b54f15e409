"""``fsdp_topk``: the exact global top-k of an FSDP2-sharded gradient, selected across every rank's shards.

After FSDP2's reduce-scatter (``torch.distributed.fsdp.fully_shard``) each rank
holds its ``Shard(0)`` piece of the averaged gradient of every parameter, as a
``DTensor``. :func:`fsdp_topk` keeps exactly the ``k`` coordinates that
:func:`functopk.topk_indices` would keep on the *unsharded* averaged gradient,
and zeroes the rest, without ever gathering a dense gradient:

* **Step I, local candidates.** Each rank concatenates its local shards in
  leaf order and takes their top ``min(k, local size)`` with the library's
  exact rule (NaN ranks as infinite, ties go to the lower index). A
  ``Shard(0)`` piece is a run of whole rows, so the local flat order is the
  unsharded flat order restricted to this rank: the local tie rule *is* the
  global one.
* **Step II, exchange.** Each rank maps its candidates to flat indices of the
  unsharded model (leaf offset, then row-major index within the unsharded
  leaf) and all-gathers exactly ``k`` pairs (padded with the index ``n``, one
  past the end, and the value 0): ``k`` pairs sent, ``P k`` received, in the
  packed format of :mod:`functopk.distributed`.
* **Step III, selection.** Every rank sorts the ``P k`` candidates by global
  index and takes their top ``k`` with the same rule, so every rank computes
  the same set; each writes the part of it that lies in its own shards.

Why the candidates suffice: a coordinate of the global top ``k`` is preceded,
in the global order, by fewer than ``k`` coordinates; those of its own rank
are among them, so it is in its rank's local top ``k``. The padding (value 0,
index ``n``) loses every tie, and there are always at least ``k`` real
candidates (``n >= k`` is checked).

**Non-finite gradients.** NaN and Inf rank first, so they are selected (up to
``k`` of them) and reach the update of the rank that owns them, where
``torch.amp.GradScaler`` or :func:`functopk.apply_if_finite` sees them; since
every rank's candidates hold its non-finite values, the state's
``nonfinite_steps`` counts such steps identically on every rank, without a
host sync.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any, NamedTuple

import optree
import torch
import torch.distributed as dist

from functopk._checks import check_k_or_density, check_leaves, check_state, path_str
from functopk._compat import replace
from functopk.base import GradientTransformation, Params, Updates
from functopk.distributed import fsdp_torch
from functopk.distributed.agree import check_agreement, layout_code
from functopk.distributed.wire import gather_or_fail, local_topk, pack, unpack
from functopk.sparse.api import topk_indices
from functopk.sparse.k import resolve_k

__all__ = ["FSDPTopKState", "fsdp_topk"]

_WHAT = "fsdp_topk"


class FSDPTopKState(NamedTuple):
    """State of :func:`fsdp_topk`: two counters, the same on every rank.

    Attributes:
        count: Steps taken (int64, 0-d).
        nonfinite_steps: Steps in which some rank's gradient held a NaN or Inf
            (int64, 0-d); those values were selected and are in the update.

    Example:
        >>> import torch
        >>> from functopk.distributed import FSDPTopKState
        >>> FSDPTopKState(torch.tensor(0), torch.tensor(0)).count
        tensor(0)
    """

    count: torch.Tensor  # type: ignore[assignment]
    nonfinite_steps: torch.Tensor


class _Shards(NamedTuple):
    """Where this rank's shards lie: their local flat tensors and their positions in the unsharded model."""

    local: list[torch.Tensor]  # each leaf's local shard, flat
    starts: list[int]  # each leaf's first coordinate in the unsharded flat model
    offsets: list[int]  # each local shard's first coordinate within its unsharded leaf
    numel: int  # the unsharded model's coordinates
    dtype: torch.dtype  # the leaves' promoted dtype: what the selection compares
    group: dist.ProcessGroup
    world: int


def fsdp_topk(k: int | None = None, *, density: float | None = None) -> GradientTransformation:
    """Keep the exact global top ``k`` of an FSDP2-sharded gradient (``DTensor`` leaves, ``Shard(0)``).

    The result on each rank is its shards of what
    ``functopk.topk_indices(full_gradient, k).to_dense()`` gives on the
    unsharded gradient, bit for bit: the same coordinates (ties go to the lower
    flat index of the unsharded model: leaf order, then row-major within the
    leaf), the gradient's own values, zeros elsewhere. Put it first in a chain
    (``chain(fsdp_topk(k), adamw(lr))``) or pass it as ``sparsify=`` to
    :func:`functopk.optimizer_from_torch`. Each step all-gathers ``k`` (index,
    value) pairs per rank over the parameters' device mesh (see
    :mod:`functopk.distributed.fsdp_topk`); no host sync.

    ``init`` checks, in one small collective (every rank calls it alike, with
    real, not meta, parameters), that every rank has the same ``k``, leaf
    layout (paths, unsharded shapes, dtypes) and mesh size, and raises
    ``ValueError`` naming the first field that differs. A failed or timed-out
    exchange raises ``RuntimeError`` naming this transformation (the
    process-group timeout bounds a hang). NaN and Inf are selected first and
    reach the update; ``state.nonfinite_steps`` counts such steps.

    Args:
        k: Coordinates kept per step, over the whole unsharded model.
        density: Instead of ``k``: the fraction of all coordinates kept.

    Raises (at ``init``/``update``):
        TypeError: a leaf is not a ``DTensor`` sharded ``Shard(0)`` on a 1-d mesh,
            or the leaves live on different meshes.

    Example:
        >>> import torch, torch.distributed as dist, functopk as ft
        >>> from torch.distributed.tensor import distribute_tensor, init_device_mesh, Shard
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # torchrun does this
        >>> mesh = init_device_mesh("cpu", (1,))
        >>> grads = {"w": distribute_tensor(torch.tensor([[1.0, -4.0], [0.5, 2.0]]), mesh, [Shard(0)])}
        >>> tx = ft.distributed.fsdp_topk(2)
        >>> updates, state = tx.update(grads, tx.init(grads))
        >>> updates["w"].full_tensor()
        tensor([[ 0., -4.],
                [ 0.,  2.]])
        >>> dist.destroy_process_group()
    """
    k, density = check_k_or_density(k, density, allow_tensor=False)
    return GradientTransformation(partial(_init, k, density), partial(_update, k, density))


def _init(k: int | None, density: float | None, params: Params) -> FSDPTopKState:
    """Zero counters; with real (not meta) parameters, the ranks' agreement checked."""
    leaves, treedef = check_leaves(params, "params", floating=True)
    device = leaves[0].device if leaves else torch.device("cpu")
    if leaves and device.type != "meta":
        shards = _shards(leaves, treedef, "params")
        kk = _k(k, density, shards.numel)
        check_agreement(_WHAT, {
            "the number of coordinates": shards.numel,
            "the leaf layout (paths, unsharded shapes, dtypes)":
                layout_code([leaf.shape for leaf in leaves], [leaf.dtype for leaf in leaves], treedef),
            "k": kk, "the mesh size": shards.world,
        }, shards.group, dist.get_rank(shards.group), shards.world, shards.local[0].device)  # fmt: skip
    zero = torch.zeros((), dtype=torch.int64, device=device)
    return FSDPTopKState(count=zero, nonfinite_steps=zero)


def _k(k: int | None, density: float | None, numel: int) -> int:
    kk = resolve_k(k, density, numel, name="the unsharded model")
    assert isinstance(kk, int)  # k and density are Python numbers here
    return kk


def _update(
    k: int | None, density: float | None, updates: Updates, state: FSDPTopKState, params: Params | None = None
) -> tuple[Updates, FSDPTopKState]:
    """One step: local candidates, their exchange, the global selection (see the module docstring)."""
    del params
    check_state(state, FSDPTopKState, _WHAT)
    leaves, treedef = check_leaves(updates, "updates", floating=True)
    if not leaves:
        return updates, replace(state, count=state.count + 1)
    shards = _shards(leaves, treedef, "updates")
    kk, n = _k(k, density, shards.numel), shards.numel
    # Step I: this rank's candidates (the library's selection over the local shards as a tree: no concatenation),
    # indexed in the unsharded model.
    sizes = [t.numel() for t in shards.local]
    device, local_n = shards.local[0].device, sum(sizes)
    if local_n:
        sel = topk_indices([t.detach() for t in shards.local], min(kk, local_n))
        idx, vals = sel.indices, sel.values.to(shards.dtype)
    else:  # this rank holds no coordinates (more ranks than rows): it sends padding only
        idx, vals = torch.zeros(0, dtype=torch.int64, device=device), torch.zeros(0, dtype=shards.dtype, device=device)
    local_starts = torch.tensor([0, *sizes[:-1]], device=device).cumsum(0)
    to_global = torch.tensor([s + o for s, o in zip(shards.starts, shards.offsets)], device=device)
    leaf = torch.searchsorted(local_starts, idx, right=True) - 1
    gidx = idx - local_starts[leaf] + to_global[leaf]
    # Step II: every rank's k pairs (padded with index n, value 0).
    packed = pack(gidx, vals, kk, n)
    gathered = torch.empty(shards.world * packed.numel(), dtype=torch.uint8, device=device)
    gather_or_fail(gathered, packed, shards.group, f"the candidate all-gather of {_WHAT}")
    pairs = unpack(gathered, shards.world, kk, n, shards.dtype)
    all_idx = torch.cat([i for i, _ in pairs])  # the wire's dtype: int32 sorts 2.5x faster than int64 on CPU
    all_vals = torch.cat([v for _, v in pairs])
    # Step III: the global top k (sorted by global index, so that ties go to the lower one); keep our part.
    all_idx, order = torch.sort(all_idx, stable=True)
    all_vals = all_vals[order]
    pos, top = local_topk(all_vals, kk)
    out = _scatter_own(all_idx[pos].to(torch.int64), top, shards)
    bad = ~torch.isfinite(all_vals).all()
    new_leaves = [_like(leaf_, piece) for leaf_, piece in zip(leaves, out)]
    return optree.tree_unflatten(treedef, new_leaves), FSDPTopKState(
        count=state.count + 1, nonfinite_steps=state.nonfinite_steps + bad
    )


def _scatter_own(gidx: torch.Tensor, vals: torch.Tensor, shards: _Shards) -> list[torch.Tensor]:
    """The selected pairs that lie in this rank's shards, written into zeroed local shards (flat, per leaf)."""
    sizes = [t.numel() for t in shards.local]
    device, local_n = vals.device, sum(sizes)
    begin = torch.tensor([s + o for s, o in zip(shards.starts, shards.offsets)], device=device)
    local_starts = torch.tensor([0, *sizes[:-1]], device=device).cumsum(0)
    size_t = torch.tensor(sizes, device=device)
    leaf = (torch.searchsorted(torch.tensor(shards.starts, device=device), gidx, right=True) - 1).clamp_(0)
    within = gidx - begin[leaf]
    mine = (within >= 0) & (within < size_t[leaf])
    # Not ours (or padding): the scratch slot past the end, dropped.
    slot = torch.where(mine, local_starts[leaf] + within, torch.full_like(gidx, local_n))
    out = vals.new_zeros(local_n + 1).index_put_((slot,), vals)
    return list(out[:local_n].split(sizes))


def _like(leaf: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``local`` (flat, this rank's shard) as a DTensor shaped and placed like ``leaf`` (a checked DTensor)."""
    assert isinstance(leaf, fsdp_torch.DTensor)
    piece = local.to(leaf.dtype).view(leaf.to_local().shape)
    return fsdp_torch.DTensor.from_local(piece, leaf.device_mesh, leaf.placements, run_check=False,
                                         shape=leaf.shape, stride=leaf.stride())  # fmt: skip


def _shards(leaves: list[torch.Tensor], treedef: Any, name: str) -> _Shards:
    """Check that every leaf is a ``Shard(0)`` DTensor of one 1-d mesh; where each rank's shards lie."""
    DTensor, Shard = fsdp_torch.DTensor, fsdp_torch.Shard
    mesh = None
    starts, offsets, local, start = [], [], [], 0
    for path, leaf in zip(treedef.paths(), leaves):
        where = f"{name} leaf at {path_str(path)}"
        if not isinstance(leaf, DTensor) or tuple(leaf.placements) != (Shard(0),) or leaf.device_mesh.ndim != 1:
            got = f"a DTensor placed {tuple(leaf.placements)}" if isinstance(leaf, DTensor) else "a plain tensor"
            raise TypeError(f"{where} is {got}; fsdp_topk expects DTensors sharded (Shard(0),) on a 1-d device mesh, "
                            "as torch.distributed.fsdp.fully_shard makes them (for replicated data parallelism "
                            "use functopk.distributed.distributed_topk or topk_hook)")  # fmt: skip
        if mesh is None:
            mesh = leaf.device_mesh
        elif leaf.device_mesh != mesh:
            raise TypeError(f"{where} lives on another device mesh than the first leaf; fsdp_topk selects over "
                            "one mesh")  # fmt: skip
        _, offset = fsdp_torch.compute_local_shape_and_global_offset(leaf.shape, mesh, leaf.placements)
        row = math.prod(leaf.shape[1:])
        starts.append(start)
        offsets.append(offset[0] * row)
        local.append(leaf.to_local().reshape(-1))
        start += leaf.numel()
    assert mesh is not None
    dtype = leaves[0].dtype
    for leaf in leaves[1:]:
        dtype = torch.promote_types(dtype, leaf.dtype)
    group = mesh.get_group(0)
    return _Shards(local, starts, offsets, start, dtype, group, dist.get_world_size(group))

