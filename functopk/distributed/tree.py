"""gTop-k's tree exchange: ``log2 P`` rounds of pairwise swaps with re-sparsification, ``O(k log P)`` bytes per rank.

Shi et al. (2019), "A distributed synchronous SGD algorithm with global top-k
sparsification for low bandwidth networks". Recursive doubling: in round
``t`` rank ``r`` swaps its current ``k`` (index, value) pairs with rank
``r XOR 2**t`` and both keep the top ``k`` of the sum of the two sparse vectors
(:func:`_merge`, symmetric, so both partners hold the same bits). After the
last round every rank holds the same ``k`` pairs.

``P`` not a power of two: with ``p2`` the largest power of two ``<= P``, the
``P - p2`` extra ranks ``r >= p2`` first hand their pairs to rank ``r - p2``
(which merges them), stay idle during the rounds, and get the result back
with a ``k``-byte mask saying which of their own pairs survived.

Error feedback: each rank tracks which of *its own* sent pairs survive every
merge on its path; those that are dropped at any round go back into its
residual, so no gradient mass is lost (the paper puts back only the values
whose index is not in the final set, which loses those dropped at an
intermediate round whose index re-entered later; see docs/distributed.md).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from functopk.distributed.wire import comm_error, index_dtype, itemsize, local_topk, pack, unpack

__all__ = ["tree_wire_bytes"]


def _split(world: int) -> tuple[int, int]:
    """``(p2, rounds)``: the largest power of two ``<= world`` and its log2."""
    rounds = world.bit_length() - 1
    return 1 << rounds, rounds


def tree_wire_bytes(k: int, numel: int, value_dtype: torch.dtype, world: int, rank: int) -> tuple[int, int]:
    """``(sent, received)``: bytes ``rank`` of ``world`` puts on / takes off the wire in one tree exchange.

    ``log2(P) * k * (index + value bytes)`` each way when ``P`` is a power of
    two; otherwise the extra ranks send ``k`` pairs and receive ``k`` pairs plus
    a ``k``-byte mask, and their partners that much more.

    Example:
        >>> import torch
        >>> from functopk.distributed.tree import tree_wire_bytes
        >>> tree_wire_bytes(10, 1000, torch.float32, 8, 0)  # 3 rounds of 10 (int32, fp32) pairs
        (240, 240)
    """
    pair = k * (itemsize(index_dtype(numel)) + itemsize(value_dtype))
    p2, rounds = _split(world)
    if rank >= p2:
        return pair, pair + k
    if rank < world - p2:
        return (rounds + 1) * pair + k, (rounds + 1) * pair
    return rounds * pair, rounds * pair


def _merge(
    a: tuple[torch.Tensor, torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor, torch.Tensor], k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top ``k`` of the sum of two sparse vectors ``(indices, values, alive)`` with distinct indices each.

    The union is sorted by index, a coordinate in both is summed (two terms:
    commutative, so ``merge(a, b)`` and ``merge(b, a)`` have the same bits),
    and the ``k`` largest ``|sum|`` are kept (NaN ranks as infinite, ties go to
    the lower index), in ascending index order. ``alive`` (``[n, c]`` bool) are
    ownership flags, OR-ed where coordinates meet.
    """
    idx, order = torch.sort(torch.cat([a[0], b[0]]), stable=True)
    val, alive = torch.cat([a[1], b[1]])[order], torch.cat([a[2], b[2]])[order]
    dup = idx[1:] == idx[:-1]  # entry j + 1 repeats entry j (an index occurs at most twice)
    no = dup.new_zeros(1)
    first, second = torch.cat([dup, no]), torch.cat([no, dup])
    summed = val + torch.cat([torch.where(dup, val[1:], torch.zeros_like(val[1:])), val.new_zeros(1)])
    alive = alive | (first[:, None] & torch.cat([alive[1:], alive[:1] & False]))
    key = summed.abs().nan_to_num(nan=float("inf")).masked_fill(second, -1.0)
    pos = torch.sort(key, descending=True, stable=True).indices[:k].sort().values
    return idx[pos], summed[pos], alive[pos]


def _swap(buf: torch.Tensor, peer: int, group: dist.ProcessGroup) -> torch.Tensor:
    """Send ``buf`` to group rank ``peer`` and receive its buffer of the same size."""
    recv = torch.empty_like(buf)
    dst = dist.get_global_rank(group, peer)
    ops = [dist.P2POp(dist.isend, buf, dst, group), dist.P2POp(dist.irecv, recv, dst, group)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    return recv


def _pairs(buf: torch.Tensor, k: int, numel: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    idx, vals = unpack(buf, 1, k, numel, dtype)[0]
    return idx.to(torch.int64), vals


def _rounds(
    own: tuple[torch.Tensor, torch.Tensor], k: int, numel: int, group: dist.ProcessGroup, rank: int, world: int
):
    """The tree on ``own = (idx, vals)``: ``(indices, sums, alive)``; ``alive`` flags which of the final
    pairs hold a surviving value of this rank's own."""
    idx, vals = own
    p2, rounds = _split(world)
    extra, dtype = world - p2, vals.dtype
    size = k * (itemsize(index_dtype(numel)) + itemsize(dtype))  # one packed message of k pairs
    if rank >= p2:  # hand the pairs to rank - p2; get its result and this rank's survival mask back
        peer = dist.get_global_rank(group, rank - p2)
        dist.send(pack(idx, vals, k, numel), peer, group)
        buf = torch.empty(size + k, dtype=torch.uint8, device=vals.device)
        dist.recv(buf, peer, group)
        return (*_pairs(buf[:size], k, numel, dtype), buf[size:].bool())
    cols = 2 if rank < extra else 1  # flags: this rank's own pairs, and its extra rank's
    ones = torch.ones(k, 1, dtype=torch.bool, device=vals.device)
    state = (idx, vals, torch.cat([ones, ~ones], 1) if cols == 2 else ones)
    if cols == 2:
        buf = torch.empty(size, dtype=torch.uint8, device=vals.device)
        dist.recv(buf, dist.get_global_rank(group, rank + p2), group)
        state = _merge(state, (*_pairs(buf, k, numel, dtype), torch.cat([~ones, ones], 1)), k)
    none = torch.zeros(k, cols, dtype=torch.bool, device=vals.device)
    for t in range(rounds):
        got = _swap(pack(state[0], state[1], k, numel), rank ^ (1 << t), group)
        state = _merge(state, (*_pairs(got, k, numel, dtype), none), k)
    if cols == 2:
        dist.send(torch.cat([pack(state[0], state[1], k, numel), state[2][:, 1].to(torch.uint8)]),
                  dist.get_global_rank(group, rank + p2), group)  # fmt: skip
    return state[0], state[1], state[2][:, 0]


def tree_step(acc: torch.Tensor, k: int, group: dist.ProcessGroup, rank: int, world: int, what: str):
    """One ``distributed_topk`` exchange over the tree: ``(mean, nonfinite)``.

    ``acc`` (grads + residual, 1-d) is changed in place into the new
    residual (see :func:`tree_reduce_`); ``mean`` is a new tensor.
    """
    idx, vals = local_topk(acc, k)
    acc.index_fill_(0, idx, 0)
    mean = torch.zeros_like(acc)
    return mean, tree_reduce_(acc, (idx, vals), mean, group, rank, world, what)


def tree_reduce_(
    residual: torch.Tensor,
    sent: tuple[torch.Tensor, torch.Tensor],
    out: torch.Tensor,
    group: dist.ProcessGroup,
    rank: int,
    world: int,
    what: str,
) -> torch.Tensor:
    """The tree exchange of this rank's selected pairs ``sent = (idx, vals)``; the 0-d bool ``nonfinite``.

    The one implementation behind ``distributed_topk(exchange="tree")`` and
    ``topk_hook`` with ``exchange="tree"``. ``residual`` (1-d, zero at the sent
    ``idx``) gets back those of this rank's sent values that a merge dropped;
    ``out`` (zeroed, ``residual``'s size) receives the dense sum of the final
    ``k`` pairs divided by ``P``, bit-identical on every rank. ``nonfinite``
    (the same on every rank) says whether that sum holds a NaN or Inf. A
    failed send or receive raises :func:`comm_error` naming ``what``.
    """
    idx, vals = sent
    numel = residual.numel()
    try:
        final_idx, sums, alive = _rounds((idx, vals), idx.numel(), numel, group, rank, world)
    except RuntimeError as exc:
        raise comm_error(what, group, exc) from exc
    survived = torch.zeros(numel, dtype=torch.bool, device=residual.device).index_put_((final_idx,), alive)
    residual.index_put_((idx,), torch.where(survived[idx], torch.zeros_like(vals), vals))
    out.index_put_((final_idx,), sums.div(world))
    return ~torch.isfinite(sums).all()
