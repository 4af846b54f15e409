"""The ranks of ``test_fsdp_topk.py``: ``fsdp_topk`` on real FSDP2 shards, each result recorded with its reference.

Every reference is computed on the rank itself from the *unsharded* tensors
(``DTensor.full_tensor()``) with single-process functopk or torch.optim, so
the test compares each rank's shards of the result with the dense reference.
Nothing here is collected as a test.
"""

from __future__ import annotations

import math
import os

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

import functopk as ft
from functopk.distributed import fsdp_topk
from functopk.distributed.fsdp_torch import fully_shard
from tests.distributed.common import DEATH_EXIT_CODE, gen, record_and_exit, start_gloo

FSDP_WATCHDOG_S = 120.0
FSDP_K = 7
FSDP_STEPS = 3
# Rows not divisible by 2 or 4 (uneven shards; with 4 ranks the 3-row leaves leave one rank empty).
TIE_SHAPES = {"a": (5, 4), "b": (3,), "c": (6, 2)}
NAN_AT = ("c", 9)  # the non-finite case puts a NaN here (in the last rank's shard of "c")


def tie_tree(case: str) -> dict[str, torch.Tensor]:
    """A gradient whose magnitudes tie across leaves and shard boundaries (values +-1, +-2 and a few 3s)."""
    g = gen(7, len(case))
    tree = {n: torch.randint(1, 3, s, generator=g).float() * (torch.randint(0, 2, s, generator=g) * 2 - 1)
            for n, s in TIE_SHAPES.items()}  # fmt: skip
    tree["c"].view(-1)[[3, 10]] = 3.0  # two coordinates above the rest; the other k - 2 come from the ties
    if case == "nan":
        tree[NAN_AT[0]].view(-1)[NAN_AT[1]] = math.nan
    return tree


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))


def shard_model(model: nn.Module) -> nn.Module:
    for layer in (model[0], model[2]):
        fully_shard(layer).set_force_sum_reduction_for_comms(True)
    fully_shard(model).set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
    return model


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = gen(8, rank, step)
    return torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)


def full(tree) -> list[torch.Tensor]:
    return [t.full_tensor() for t in tree]


def _ties(mesh) -> dict:
    """The transformation alone on hand-made shards: updates and counters against ``topk_indices``."""
    out = {}
    for case in ("ties", "nan"):
        tree = tie_tree(case)
        grads = {n: distribute_tensor(t, mesh, [Shard(0)]) for n, t in tree.items()}
        tx = fsdp_topk(FSDP_K)
        updates, state = tx.update(grads, tx.init(grads))
        expected = ft.topk_indices(tree, FSDP_K).to_dense(tree)
        out[case] = {"got": {n: u.full_tensor() for n, u in updates.items()}, "expected": expected,
                     "local_is_shard": all(u.to_local().shape == grads[n].to_local().shape for n, u in updates.items()),
                     "nonfinite_steps": int(state.nonfinite_steps)}  # fmt: skip
    return out


def _train(rank: int, how: str) -> dict:
    """A few steps of FSDP2 + fsdp_topk (functional chain or the torch.optim adapter) and the dense reference."""
    ref = make_model()  # every rank holds the unsharded reference, fed the full averaged gradients
    model = shard_model(make_model())
    params = list(model.parameters())
    if how == "chain":
        tx = ft.chain(fsdp_topk(FSDP_K), ft.sgd(0.5, momentum=0.9))
        state = tx.init(params)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5, momentum=0.9)
    else:
        opt = ft.optimizer_from_torch(torch.optim.AdamW, params, lr=0.05, sparsify=fsdp_topk(FSDP_K))
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.05)
    got, expected = [], []
    for step in range(FSDP_STEPS):
        x, y = batch(rank, step)
        F.cross_entropy(model(x), y).backward()
        grads = full(p.grad for p in params)
        for p, g in zip(ref.parameters(), ft.topk_indices(grads, FSDP_K).to_dense(grads)):
            p.grad = g
        ref_opt.step()
        if how == "chain":
            updates, state = tx.update([p.grad for p in params], state, params)
            with torch.no_grad():
                torch._foreach_add_(params, updates)
        else:
            opt.step()
        for p in params:
            p.grad = None
        got.append(full(p.detach() for p in params))
        expected.append([p.detach().clone() for p in ref.parameters()])
    return {"got": got, "expected": expected}


def _amp(rank: int) -> dict:
    """GradScaler with the adapter: an Inf in rank 1's shard at step 1 must skip that step on every rank."""
    model = shard_model(make_model())
    opt = ft.optimizer_from_torch(torch.optim.SGD, model.parameters(), lr=0.5, sparsify=fsdp_topk(FSDP_K))
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    changed, scales = [], []
    for step in range(3):
        x, y = batch(rank, step)
        before = full(p.detach() for p in model.parameters())
        scaler.scale(F.cross_entropy(model(x), y)).backward()
        if step == 1 and rank == 1:  # rank 1 holds rows of the first weight at 2 and at 4 ranks
            next(model.parameters()).grad.to_local().view(-1)[-1] = math.inf
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        changed.append(any(not torch.equal(a, b) for a, b in zip(before, full(p.detach() for p in model.parameters()))))
        scales.append(scaler.get_scale())
    return {"changed": changed, "scales": scales}


def _mismatch(rank: int) -> str:
    grads = {"w": distribute_tensor(torch.zeros(8, 2), init_device_mesh("cpu", (torch.distributed.get_world_size(),)),
                                    [Shard(0)])}  # fmt: skip
    try:
        fsdp_topk(3 + (rank == 1)).init(grads)
    except ValueError as exc:
        return str(exc)
    return "no error"


def _death(rank: int, mesh) -> str:
    grads = {"w": distribute_tensor(torch.ones(8, 2), mesh, [Shard(0)])}
    tx = fsdp_topk(3)
    state = tx.init(grads)
    torch.distributed.barrier()
    if rank == 1:
        os._exit(DEATH_EXIT_CODE)
    try:
        tx.update(grads, state)
    except RuntimeError as exc:
        return str(exc)
    return "no error"


def fsdp_worker(rank: int, world: int, store: str, out_dir: str) -> None:
    dist = start_gloo(rank, world, store, FSDP_WATCHDOG_S, timeout_s=15.0)
    mesh = init_device_mesh("cpu", (world,))
    path = os.path.join(out_dir, f"rank{rank}.pt")

    def body(results: dict) -> None:
        results["ties"] = _ties(mesh)
        results["chain"] = _train(rank, "chain")
        results["adapter"] = _train(rank, "adapter")
        results["amp"] = _amp(rank)
        results["mismatch"] = _mismatch(rank)

    if world != 2:
        record_and_exit(path, body)
    results: dict = {}
    body(results)
    dist.barrier()
    torch.save(results, path)  # rank 1 dies in the next phase
    results["death"] = _death(rank, mesh)  # rank 1 exits inside; rank 0 records the error
    torch.save(results, path)
    os._exit(0)
