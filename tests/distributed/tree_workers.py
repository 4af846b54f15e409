"""The forked ranks of ``test_tree.py`` and ``test_hook_tree.py``: 8 gloo ranks, subgroups of 2, 3, 4, 6 and 8.

They only record: the tree exchange and ``distributed_topk(exchange="tree")``
here, ``topk_hook(exchange="tree")`` in ``hook_tree_workers.py``.

Every byte the tree hands to ``torch.distributed`` is counted by wrapping
``send``, ``recv`` and ``batch_isend_irecv`` in the worker process.
"""

from __future__ import annotations

import os

import torch

from tests.distributed.common import record_and_exit, start_gloo
from tests.distributed.hook_tree_workers import HT_DDP_GROUP, hook_tree_ddp_phase, hook_tree_phase

TREE_WORLD = 8
TREE_GROUPS = {"p2": 2, "p3": 3, "p4": 4, "p6": 6, "p8": 8}  # the first n ranks
TREE_WATCHDOG_S = 120.0
# (numel, k, dtype): int32 indices with fp32 values; fp64 values with an odd k
TREE_CASES = {"fp32": (64, 6, torch.float32), "fp64_odd": (40, 7, torch.float64), "dense_k": (12, 12, torch.float32)}
TX_SHAPES = {"a": (5, 4), "b": (7,), "c": (2, 3, 2)}  # 39 coordinates
TX_K, TX_STEPS = 5, 3


def tree_acc(case: str, rank: int, step: int = 0) -> torch.Tensor:
    """Rank ``rank``'s ``grads + residual`` in one case: a shared signal plus noise, so coordinates overlap."""
    numel, _, dtype = TREE_CASES[case]
    g = torch.Generator().manual_seed(1000 * step + 17 * rank + len(case))
    shared = torch.Generator().manual_seed(7 + step)
    return (torch.randn(numel, generator=shared, dtype=torch.float64) * 0.5
            + torch.randn(numel, generator=g, dtype=torch.float64)).to(dtype)  # fmt: skip


def tx_grads(rank: int, step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(31 * step + rank)
    return {n: torch.randn(s, generator=g) for n, s in TX_SHAPES.items()}


class _Counter:
    def __init__(self, dist) -> None:
        self.sent = self.received = 0
        send, recv, batch, isend = dist.send, dist.recv, dist.batch_isend_irecv, dist.isend

        def counted_send(tensor, *a, **kw):
            self.sent += tensor.nbytes
            return send(tensor, *a, **kw)

        def counted_recv(tensor, *a, **kw):
            self.received += tensor.nbytes
            return recv(tensor, *a, **kw)

        def counted_batch(ops):
            for op in ops:
                if op.op is isend:
                    self.sent += op.tensor.nbytes
                else:
                    self.received += op.tensor.nbytes
            return batch(ops)

        dist.send, dist.recv, dist.batch_isend_irecv = counted_send, counted_recv, counted_batch

    def take(self) -> tuple[int, int]:
        out, self.sent, self.received = (self.sent, self.received), 0, 0
        return out


def _raw(rank: int, group, counter: _Counter, world: int) -> dict:
    from functopk.distributed.tree import tree_step

    out = {}
    for case, (_, k, _) in TREE_CASES.items():
        acc = tree_acc(case, rank)
        mean, bad = tree_step(acc, k, group, rank, world, "test")
        out[case] = {"mean": mean, "residual": acc, "bad": bool(bad), "bytes": counter.take()}
    acc = tree_acc("fp32", rank)
    if rank == world - 1:
        acc[3] = float("inf")
    _, bad = tree_step(acc, TREE_CASES["fp32"][1], group, rank, world, "test")
    out["inf"] = bool(bad)
    counter.take()
    return out


def _transform(rank: int, group, counter: _Counter) -> dict:
    from functopk.distributed import distributed_topk

    tx = distributed_topk(TX_K, group=group, exchange="tree")
    state = tx.init(tx_grads(rank, 0))
    steps = []
    for step in range(TX_STEPS):
        updates, state = tx.update(tx_grads(rank, step), state)
        steps.append({"updates": updates, "residual": state.residual.clone(), "bytes_sent": int(state.bytes_sent),
                      "bytes_gathered": int(state.bytes_gathered), "skipped": int(state.skipped)})  # fmt: skip
    counter.take()
    try:  # a rank configured with the all-gather fails at once, naming the field
        other = distributed_topk(TX_K, group=group, exchange="allgather" if rank == 0 else "tree")
        other.update(tx_grads(rank, 0), other.init(tx_grads(rank, 0)))
        mismatch = "no error"
    except ValueError as exc:
        mismatch = str(exc)
    counter.take()
    return {"steps": steps, "mismatch": mismatch}


def tree_worker(rank: int, store: str, out_dir: str) -> None:
    dist = start_gloo(rank, TREE_WORLD, store, TREE_WATCHDOG_S)
    groups = {name: dist.new_group(list(range(n))) for name, n in TREE_GROUPS.items()}
    counter = _Counter(dist)

    def body(results: dict) -> None:
        for name, n in TREE_GROUPS.items():
            if rank < n:
                results[name] = {"raw": _raw(rank, groups[name], counter, n),
                                 "transform": _transform(rank, groups[name], counter),
                                 "hook": hook_tree_phase(rank, groups[name], counter, n)}  # fmt: skip
        if rank < TREE_GROUPS[HT_DDP_GROUP]:
            results[HT_DDP_GROUP]["ddp"] = hook_tree_ddp_phase(rank, groups[HT_DDP_GROUP], counter)

    record_and_exit(os.path.join(out_dir, f"rank{rank}.pt"), body)
