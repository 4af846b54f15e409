"""What the spawned workers and the tests share: the inputs, the fake bucket, and the references.

The workers (``workers.py``) feed these inputs to functopk on real process
groups and record what they see; the tests compare the records with the
single-process references defined here.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import functopk as ft

WORLD = 3
PG_TIMEOUT_S = 20.0
WATCHDOG_S = 150.0
DEATH_EXIT_CODE = 17
# What the forkserver of test_tree.py and test_resume.py imports once, before it forks the ranks (the
# first of the two to start it decides, so both name everything both need):
FORKSERVER_PRELOAD = ["torch", "torch.distributed", "torch.nn.parallel", "functopk.distributed", "tests.helpers",
                      "tests.distributed.tree_workers", "tests.distributed.hook_tree_workers",
                      "tests.distributed.resume_workers", "tests.distributed.fsdp_topk_workers",
                      "tests.distributed.fsdp_compress_workers"]  # fmt: skip
GROUPS = ("pair", "world")  # ranks {0, 1}, ranks {0, 1, 2}
SIZES = {"pair": 2, "world": 3}

# --------------------------------------------------------------------------- inputs


def gen(*seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(hash(seed) % 2**31)


def allreduce_case(case: str, rank: int):
    """``(indices, values, numel, capacity)`` of one ``sparse_allreduce`` case on one rank."""
    g = gen(1, ALLREDUCE_CASES.index(case), rank)
    if case == "fixed":  # the same k everywhere; indices overlap across ranks (drawn from 0..19 of 30)
        idx = torch.randperm(20, generator=g)[:8]
        return idx, torch.randn(8, generator=g), 30, 8
    if case == "variable":  # different counts, duplicates within a rank, rank 1 sends nothing
        count = (5, 0, 11)[rank]
        idx = torch.randint(0, 12, (count,), generator=g)
        return idx, torch.randn(count, generator=g), 12, None
    if case == "variable_capacity":  # the same, with a fixed bound instead of a count exchange
        count = (5, 0, 11)[rank]
        return torch.randint(0, 12, (count,), generator=g), torch.randn(count, generator=g), 12, 16
    if case == "fp64_odd":  # int32 indices + fp64 values, odd k: the unaligned unpacking path
        idx = torch.randperm(40, generator=g)[:7].to(torch.int64)
        return idx, torch.randn(7, generator=g, dtype=torch.float64), 40, 7
    if case == "strided_int32":  # int32 indices (the wire's dtype) that are a strided view, no padding
        idx = torch.randperm(40, generator=g).to(torch.int32)[::5]
        return idx, torch.randn(8, generator=g), 40, 8
    raise ValueError(case)


ALLREDUCE_CASES = ("fixed", "variable", "variable_capacity", "fp64_odd", "strided_int32")
TREE_SHAPES = {"a": (5, 4), "b": (7,), "c": (2, 3, 2)}  # 39 coordinates
TX_K, TX_STEPS = 5, 4
TX_BAD = (1, "b", 2)  # in the non-finite run, step 1 has an Inf in rank 1's leaf "b" at position 2


def tx_grads(rank: int, step: int):
    g = gen(2, rank, step)
    return {name: torch.randn(shape, generator=g) for name, shape in TREE_SHAPES.items()}


# The hook on hand-made buckets. Four parameters; each iteration lists its buckets (the last bucket of an
# iteration is the last in its tuple). DDP's first buckets, then a rebuild that reorders each bucket's
# parameters; then the state is saved and loaded into a new state that sees other buckets again.
HOOK_PARAMS = {"a": (4, 5), "b": (30,), "c": (10,), "d": (4, 5)}  # 80 coordinates
# selection="threshold" vs "exact" (buckets above the exact kernel's 65536-coordinate scan size):
THRESHOLD_PARAMS = {"a": 70_000, "b": 30_000, "c": 90_000}
THRESHOLD_SCALES = (1.0, 1.01, 1.02, 8.0, 8.1, 0.01, 0.0101)  # x8: too few candidates; x1/800: too many
HOOK_LAYOUTS = (
    (("a", "b"), ("c", "d")),  # warm-up (dense)
    (("a", "b"), ("c", "d")),
    (("a", "b"), ("c", "d")),
    (("b", "a"), ("d", "c")),  # rebuilt: the residuals move with their parameters
)
RESUME_LAYOUTS = (
    # Other buckets from the 2nd on: the hook reduces within the saved ones instead, deferring the 2nd and 3rd.
    # Rank 1's "c" holds an Inf: no bucket's residual changes.
    (("b", "a"), ("c",), ("d",)),
    (("d", "c"), ("b", "a")),
    (("d", "c"), ("b", "a")),
)
HOOK_BAD = (len(HOOK_LAYOUTS), 1, "c", 3)  # (iteration, rank, parameter, position) of the Inf
HOOK_DENSITY = 0.1
HOOK_MOMENTUM = 0.75  # momentum correction (a power-of-two fraction: fp32 and fp64 references agree closely)


def hook_module() -> nn.Module:
    return nn.ParameterDict({name: nn.Parameter(torch.zeros(shape)) for name, shape in HOOK_PARAMS.items()})


def hook_grad(rank: int, it: int, name: str) -> torch.Tensor:
    """The flat gradient of one parameter on one rank at one iteration (with the injected Inf)."""
    numel = math.prod(HOOK_PARAMS[name])
    grad = torch.randn(numel, generator=gen(3, rank, it, list(HOOK_PARAMS).index(name)))
    if (it, rank, name) == HOOK_BAD[:3]:
        grad[HOOK_BAD[3]] = math.inf
    return grad


def hook_layouts():
    return HOOK_LAYOUTS + RESUME_LAYOUTS


def hook_selected(it: int):
    """The buckets within which the hook selects at iteration ``it``: after loading, first the saved ones."""
    return HOOK_LAYOUTS[-1] if it == len(HOOK_LAYOUTS) else hook_layouts()[it]


DDP_STEPS, DDP_WARMUP, DDP_DENSITY = 12, 2, 0.1
AMP_STEPS, AMP_BAD_STEP, AMP_SCALE = 6, 3, 2.0**8  # rank 1's first conv weight gets an Inf at AMP_BAD_STEP
UNUSED_STEPS = 8
OVERLAP_STEPS = 6


def unused_branches(rank: int, step: int) -> tuple[str, ...]:
    """Which branches of :class:`Branchy` rank ``rank`` runs at ``step``.

    Steps 0-3: both (warm-up, then residuals build up); 4-5: no rank uses "right"
    (DDP drops its averaged values); 6: only rank 0 does; 7: both again.
    """
    if step in (4, 5):
        return ("left",)
    if step == 6:
        return ("right",) if rank == 0 else ("left",)
    return ("left", "right")


class Branchy(nn.Module):
    """A trunk and two heads; ``forward`` runs the heads it is told to (the others are unused)."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(6, 5)
        self.left = nn.Linear(5, 3)
        self.right = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor, branches: tuple[str, ...]) -> torch.Tensor:
        h = torch.tanh(self.trunk(x))
        return sum(getattr(self, b)(h) for b in branches)


class FakeBucket:
    """The part of ``dist.GradBucket`` that ``topk_hook`` uses."""

    def __init__(self, index: int, buf: torch.Tensor, params: list, last: bool):
        self._index, self._buf, self._params, self._last = index, buf, params, last

    def buffer(self):
        return self._buf

    def index(self):
        return self._index

    def is_last(self):
        return self._last

    def parameters(self):
        return self._params


# --------------------------------------------------------------------------- reading the run


def phase(run, name: str, rank: int):
    got = run.results[rank].get(name)
    assert got is not None, f"rank {rank} recorded nothing for phase {name!r} (exit codes {run.exitcodes})"
    if isinstance(got, dict) and "error" in got:
        pytest.fail(f"rank {rank} failed in phase {name!r}:\n{got['error']}")
    return got


def assert_fails_for_ddp(fut, match: str) -> None:
    """``fut`` failed with an error DDP can read: the future's own error, which ``wait()`` reports as raised in
    a callback (``set_exception`` instead stores the exception as the value, and DDP, reading that in C++,
    fails with "Unable to cast <message> to Tensor"), and a message matching ``match``."""
    import re

    with pytest.raises(RuntimeError, match="error when running the callback") as info:
        fut.wait()
    assert re.search(match, str(info.value)), str(info.value)


def members(gname: str) -> range:
    return range(SIZES[gname])


# --------------------------------------------------------------------------- references


def reference_sum(pairs, numel: int) -> torch.Tensor:
    """Dense fp64 sum of every rank's pairs, one coordinate at a time in Python."""
    out = [0.0] * numel
    for idx, vals in pairs:
        for i, v in zip(idx.tolist(), vals.double().tolist()):
            out[i] += v
    return torch.tensor(out, dtype=torch.float64)


def reference_ef_topk(grads_per_rank, residuals, k: int, reselect: bool):
    """One step of error-feedback top-k averaging over ranks, on flat fp64 vectors (library top-k mask)."""
    mean, new_res, _ = reference_ef_topk_spent(grads_per_rank, residuals, k, reselect)
    return mean, new_res


def reference_ef_topk_spent(grads_per_rank, residuals, k: int, reselect: bool):
    """:func:`reference_ef_topk`, also returning each rank's mask of the coordinates whose residual was spent."""
    sent, new_res, masks = [], [], []
    for g, r in zip(grads_per_rank, residuals):
        acc = g.double() + r
        mask = ft.topk_mask(acc, k)
        masks.append(mask)
        sent.append(torch.where(mask, acc, 0.0))
        new_res.append(torch.where(mask, 0.0, acc))
    total = sum(sent)
    if reselect:
        keep = ft.topk_mask(total, k)
        new_res = [r + torch.where(keep, 0.0, s) for r, s in zip(new_res, sent)]
        masks = [m & keep for m in masks]
        total = torch.where(keep, total, 0.0)
    return total / len(grads_per_rank), new_res, masks


def flat(tree) -> torch.Tensor:
    return torch.cat([tree[name].reshape(-1) for name in sorted(TREE_SHAPES)])


def ddp_recording_buckets(group, **state_kwargs):
    """``(net, model, state, sizes, opt)``: a small CNN in DDP over ``group`` with several buckets and
    ``topk_hook`` (``TopKHookState(group, **state_kwargs)``) behind a hook that appends each bucket's size
    to ``sizes``; SGD with lr 0.5. The same initial model on every rank."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from functopk.distributed import TopKHookState, topk_hook
    from tests.helpers import small_cnn

    torch.manual_seed(0)
    net = small_cnn()
    model = DDP(net, process_group=group, bucket_cap_mb=0.0005)
    state = TopKHookState(group, **state_kwargs)
    sizes: list = []

    def hook(state, bucket):
        sizes.append(bucket.buffer().numel())
        return topk_hook(state, bucket)

    model.register_comm_hook(state, hook)
    return net, model, state, sizes, torch.optim.SGD(model.parameters(), lr=0.5)


def group_result(run, gname: str, rank: int) -> dict:
    """What rank ``rank`` recorded for subgroup ``gname`` in a forked tree run (its error, if any, raised)."""
    res = run.results[rank]
    assert "error" not in res, res["error"]
    return res[gname]


def start_gloo(rank: int, world: int, store: str, watchdog_s: float, timeout_s: float = PG_TIMEOUT_S):
    """In a spawned or forked rank: a traceback and exit before the parent's watchdog fires, gloo on the
    loopback interface, one thread, and the file-rendezvous process group. Returns ``torch.distributed``."""
    import datetime
    import faulthandler
    import os
    import socket

    import torch.distributed as dist

    faulthandler.dump_traceback_later(watchdog_s - 10, exit=True)  # never outlive the parent's watchdog
    if "lo" in {name for _, name in socket.if_nameindex()}:
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # gloo's sockets on the loopback interface only
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))  # fmt: skip
    return dist


def run_ranks(ctx, target, args_of, world: int, watchdog_s: float) -> list:
    """Start ``world`` processes ``target(*args_of(rank))`` from ``ctx``, wait at most ``watchdog_s`` in all,
    kill what is left; their exit codes."""
    import time

    procs = [ctx.Process(target=target, args=args_of(r), daemon=True) for r in range(world)]
    t0 = time.monotonic()
    for p in procs:
        p.start()
    for p in procs:
        p.join(max(0.0, t0 + watchdog_s - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    return [p.exitcode for p in procs]


def record_and_exit(path: str, body) -> None:
    """In a rank: ``body(results)``, a barrier, then ``results`` saved to ``path`` and the process ended
    (``os._exit``: no teardown of groups a test may have broken). An exception is recorded as
    ``results["error"]`` (its traceback) and exits with 1, so that the test reports it."""
    import os
    import traceback

    import torch.distributed as dist

    results: dict = {}
    try:
        body(results)
        dist.barrier()
    except Exception:
        results["error"] = traceback.format_exc()
        torch.save(results, path)
        os._exit(1)
    torch.save(results, path)
    os._exit(0)
