"""Single-process brute-force references for the tree exchange (``functopk.distributed.tree``).

Dense vectors throughout, independent of the sparse code under test: each
block of ranks is a dense vector with a mask of its present coordinates; a
merge adds two blocks and keeps the ``k`` largest ``|sum|`` among present
coordinates (NaN as infinite, ties to the lower index). Also the all-gather
re-selection and the exact dense top-k, for the accuracy comparison.
"""

from __future__ import annotations

import torch


def _top(key: torch.Tensor, k: int) -> torch.Tensor:
    """A bool mask of the ``k`` largest ``key`` entries, ties to the lower index."""
    keep = torch.zeros(key.numel(), dtype=torch.bool)
    keep[torch.sort(key, descending=True, stable=True).indices[:k]] = True
    return keep


def _key(v: torch.Tensor, present: torch.Tensor) -> torch.Tensor:
    return torch.where(present, v.abs().nan_to_num(nan=float("inf")), torch.full_like(v, -1.0))


def local_topk(acc: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sent, mask)``: the dense top-``k`` of ``acc`` (zeros elsewhere) and its mask."""
    mask = _top(_key(acc, torch.ones_like(acc, dtype=torch.bool)), k)
    return torch.where(mask, acc, torch.zeros_like(acc)), mask


def _merge(a, b, k: int):
    v = a[0] + b[0]  # absent coordinates are zero: x + 0 is what the sparse merge computes too
    keep = _top(_key(v, a[1] | b[1]), k)
    alive = {r: m & keep for r, m in {**a[2], **b[2]}.items()}
    return torch.where(keep, v, torch.zeros_like(v)), keep, alive


def tree_reference(accs: list[torch.Tensor], k: int):
    """``(mean, residuals, lost)`` of one tree exchange over ranks holding ``accs`` (grads + residual).

    ``lost`` is the mass gTop-k's own rule would lose: per rank, the sent
    values whose coordinate is in the final set but that a merge on the
    rank's path had dropped (the paper puts back only coordinates outside
    the final set; the implementation puts back every dropped value).
    """
    world = len(accs)
    rounds = world.bit_length() - 1
    p2 = 1 << rounds
    sent = [local_topk(a, k) for a in accs]
    blocks = [(s, m, {r: m.clone()}) for r, (s, m) in enumerate(sent)]
    for r in range(p2, world):
        blocks[r - p2] = _merge(blocks[r - p2], blocks[r], k)
    for t in range(rounds):
        blocks = [_merge(blocks[r], blocks[r ^ (1 << t)], k) for r in range(p2)]
    total, keep, alive = blocks[0]
    mean = total.div(world)
    residuals, lost = [], torch.zeros_like(total)
    for r, (acc, (s, m)) in enumerate(zip(accs, sent)):
        back = m & ~alive[r]
        residuals.append(torch.where(m & ~back, torch.zeros_like(acc), acc))
        lost += torch.where(back & keep, s, torch.zeros_like(s))
    return mean, residuals, lost


def allgather_reselect_reference(accs: list[torch.Tensor], k: int) -> torch.Tensor:
    """The mean ``distributed_topk(reselect=True)`` emits: the top ``k`` of the sum of every rank's top ``k``."""
    total = torch.stack([local_topk(a, k)[0] for a in accs]).sum(0)
    keep = _top(_key(total, torch.ones_like(total, dtype=torch.bool)), k)
    return torch.where(keep, total, torch.zeros_like(total)) / len(accs)


def dense_topk_reference(accs: list[torch.Tensor], k: int) -> torch.Tensor:
    """The top ``k`` of the exact dense mean: what a dense allreduce followed by top-k would give."""
    mean = torch.stack(accs).mean(0)
    return torch.where(_top(_key(mean, torch.ones_like(mean, dtype=torch.bool)), k), mean, torch.zeros_like(mean))
