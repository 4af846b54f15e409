"""``topk_hook`` with ``exchange="tree"`` in the forked 8-rank run of ``tree_workers.py``: the ranks only record.

Two phases per subgroup: stand-in buckets (``FakeBucket``) through the hook
for several iterations (warm-up, compressed steps, a save and load into a new
state, a rank whose parameter is unused, an Inf on one rank), then a state
configured with the all-gather on rank 0 only. And DDP training with the
tree hook on the 3-rank subgroup (``P`` not a power of two).
"""

from __future__ import annotations

import io
import math

import torch
import torch.nn.functional as F

from tests.distributed.common import FakeBucket, ddp_recording_buckets
from tests.helpers import batch

HT_PARAMS = {"a": (6, 5), "b": (17,), "c": (23,)}  # 70 coordinates
HT_LAYOUT = (("a", "b"), ("c",))  # two buckets: 47 and 23 coordinates
HT_DENSITY, HT_WARMUP, HT_ITERS = 0.15, 1, 7  # k = 7 and 3
HT_SAVE_AFTER = 2  # the state is saved after this iteration and loaded into a new one
HT_UNUSED = (4, 0, "b")  # (iteration, rank, parameter): an all-zero gradient (held back)
HT_BAD = (5, -1, "c", 4)  # (iteration, rank (-1: the last), parameter, position) of an Inf
HT_DDP_GROUP, HT_DDP_STEPS, HT_DDP_WARMUP, HT_DDP_DENSITY = "p3", 6, 2, 0.1
HT_MOMENTUM = 0.75  # the second run: momentum correction (TopKHookState(momentum=...))


def ht_grad(rank: int, it: int, name: str, world: int) -> torch.Tensor:
    """The flat gradient of one parameter on one rank at one iteration (with the injected zeros and Inf)."""
    numel = math.prod(HT_PARAMS[name])
    g = torch.Generator().manual_seed(10_000 * it + 100 * rank + list(HT_PARAMS).index(name))
    shared = torch.Generator().manual_seed(77 + it)
    grad = torch.randn(numel, generator=shared) * 0.5 + torch.randn(numel, generator=g)  # overlapping choices
    if (it, rank, name) == HT_UNUSED:
        grad.zero_()
    if (it, rank % world - world, name) == HT_BAD[:3]:
        grad[HT_BAD[3]] = math.inf
    return grad


def _module() -> torch.nn.Module:
    return torch.nn.ParameterDict({n: torch.nn.Parameter(torch.zeros(s)) for n, s in HT_PARAMS.items()})


def _state(group, module, **kwargs):
    from functopk.distributed import TopKHookState

    state = TopKHookState(group, density=HT_DENSITY, warmup_iters=HT_WARMUP, model=module, exchange="tree", **kwargs)
    state.find_unused_parameters = True  # a DDP model's flag; here without DDP
    return state


def _roundtrip(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def hook_tree_phase(rank: int, group, counter, world: int) -> dict:
    from functopk.distributed import TopKHookState, topk_hook

    its = _hook_tree_iters(rank, group, counter, world, 0.0)
    mc_its = _hook_tree_iters(rank, group, counter, world, HT_MOMENTUM)
    other = TopKHookState(group, density=HT_DENSITY, warmup_iters=0, exchange="allgather" if rank == 0 else "tree")
    try:
        topk_hook(other, FakeBucket(0, torch.ones(40), [torch.zeros(40)], last=True)).wait()
        mismatch = "no error"
    except ValueError as exc:
        mismatch = str(exc)
    counter.take()
    return {"iters": its, "mc_iters": mc_its, "mismatch": mismatch}


def _hook_tree_iters(rank: int, group, counter, world: int, momentum: float) -> list:
    from functopk.distributed import topk_hook

    module = _module()
    state = _state(group, module, momentum=momentum)
    its = []
    for it in range(HT_ITERS):
        outs = []
        for b, names in enumerate(HT_LAYOUT):
            buf = torch.cat([ht_grad(rank, it, n, world) for n in names])
            bucket = FakeBucket(b, buf, [module[n] for n in names], last=b == len(HT_LAYOUT) - 1)
            outs.append(topk_hook(state, bucket).wait().clone())
        saved = state.state_dict()
        its.append({"buckets": outs, "residuals": saved["residuals"], "velocities": saved.get("velocities"),
                    "last_step": state.last_step, "skipped": state.skipped_iters, "wire": counter.take()})  # fmt: skip
        if it == HT_SAVE_AFTER:  # as in a new process: the residuals come back by name
            state = _state(group, module, momentum=momentum)
            state.load_state_dict(_roundtrip(saved))
    counter.take()
    return its


def hook_tree_ddp_phase(rank: int, group, counter) -> dict:
    """DDP training of a small CNN with the tree hook; several buckets per step."""
    net, model, state, sizes, opt = ddp_recording_buckets(group, density=HT_DDP_DENSITY,
                                                          warmup_iters=HT_DDP_WARMUP, exchange="tree")  # fmt: skip
    x, y = batch(n=16, seed=20 + rank)
    steps = []
    counter.take()
    for _ in range(HT_DDP_STEPS):
        del sizes[:]
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        steps.append({"loss": loss.item(), "params": torch.cat([p.detach().reshape(-1) for p in net.parameters()]),
                      "sizes": list(sizes), "last_step": state.last_step, "wire": counter.take(),
                      "skipped": state.skipped_iters})  # fmt: skip
    del model
    return {"steps": steps}
