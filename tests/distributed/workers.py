"""The spawned ranks: each phase feeds the inputs of ``common.py`` to functopk and records what it sees.

The workers only *record* (``torch.save`` per rank after each phase); the
assertions live in the test modules. Nothing here is collected as a test.
"""

from __future__ import annotations

import inspect
import io
import itertools
import math
import os
import time
import traceback

import torch
import torch.nn.functional as F

from functopk.distributed import TopKHookState, distributed_topk, sparse_allreduce, topk_hook
from tests.distributed.common import (
    ALLREDUCE_CASES,
    AMP_BAD_STEP,
    AMP_SCALE,
    AMP_STEPS,
    DDP_DENSITY,
    DDP_STEPS,
    DDP_WARMUP,
    DEATH_EXIT_CODE,
    HOOK_DENSITY,
    HOOK_LAYOUTS,
    HOOK_MOMENTUM,
    HOOK_PARAMS,
    OVERLAP_STEPS,
    RESUME_LAYOUTS,
    THRESHOLD_PARAMS,
    THRESHOLD_SCALES,
    TX_BAD,
    TX_K,
    TX_STEPS,
    UNUSED_STEPS,
    WATCHDOG_S,
    Branchy,
    FakeBucket,
    allreduce_case,
    ddp_recording_buckets,
    hook_grad,
    hook_module,
    start_gloo,
    tx_grads,
    unused_branches,
)
from tests.helpers import assert_tree_bitwise_equal, batch, bits, clone_tree, small_cnn


def _phase(results: dict, name: str, fn, *args) -> None:
    t0 = time.monotonic()
    try:
        results[name] = fn(*args)
    except Exception:  # recorded; the test for this phase reports it
        results[name] = {"error": traceback.format_exc()}
    results.setdefault("seconds", {})[name] = time.monotonic() - t0


def _failure(fn) -> tuple[str, float]:
    t0 = time.monotonic()
    try:
        fn()
        return "no error", time.monotonic() - t0
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}", time.monotonic() - t0


def _roundtrip(obj):
    """``obj`` after ``torch.save`` and ``torch.load(weights_only=True)``, as a checkpoint would see it."""
    f = io.BytesIO()
    torch.save(obj, f)
    f.seek(0)
    return torch.load(f, weights_only=True)


def _flat_params(module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()]).clone()


# --------------------------------------------------------------------------- phases on all groups


def _allreduce_phase(rank: int, groups: dict):
    import torch.distributed as dist

    out = {}
    for gname, group in groups.items():
        if group is None:
            continue
        for case in ALLREDUCE_CASES:
            idx, vals, numel, cap = allreduce_case(case, rank)
            before = (idx.clone(), vals.clone())
            total = sparse_allreduce(idx, vals, numel, group, capacity=cap)
            mean = sparse_allreduce(idx, vals, numel, group, average=True, capacity=cap)
            pure = torch.equal(idx, before[0]) and torch.equal(bits(vals), bits(before[1]))
            out[(gname, case)] = {"sum": total, "mean": mean, "pure": pure}
        # An index out of range fails on the calling rank, before any collective.
        try:
            sparse_allreduce(torch.tensor([3, 30]), torch.ones(2), 30, group, capacity=2)
            out[(gname, "range")] = "no error"
        except RuntimeError as exc:
            out[(gname, "range")] = str(exc)
    dist.barrier()
    return out


def _transform_phase(rank: int, groups: dict):
    out = {}
    for gname, group in groups.items():
        if group is None:
            continue
        for reselect in (False, True):
            tx = distributed_topk(TX_K, group=group, reselect=reselect)
            state = tx.init(tx_grads(rank, 0))
            steps = []
            for step in range(TX_STEPS):
                grads = tx_grads(rank, step)
                grads_before, state_before = clone_tree(grads), clone_tree(state)
                updates, new_state = tx.update(grads, state)
                assert_tree_bitwise_equal(grads, grads_before)
                assert_tree_bitwise_equal(state, state_before)
                assert [(x.shape, x.dtype) for x in new_state] == [(x.shape, x.dtype) for x in state]
                state = new_state
                steps.append({"updates": updates, "state": state})
            out[(gname, reselect)] = steps
        # NaN: rank 0's NaN ranks as an infinite magnitude, is sent, and reaches every rank's update.
        tx = distributed_topk(2, group=group)
        grads = {"w": torch.tensor([1.0, math.nan if rank == 0 else 0.5, -3.0, 0.1])}
        out[(gname, "nan")] = tx.update(grads, tx.init(grads))[0]["w"]
        # Inf on rank 1 at one step: every rank's residual stays as it was for that step.
        tx = distributed_topk(TX_K, group=group)
        state, steps = tx.init(tx_grads(rank, 0)), []
        for step in range(3):
            grads = tx_grads(rank, step)
            if step == TX_BAD[0] and rank == 1:
                grads[TX_BAD[1]].view(-1)[TX_BAD[2]] = math.inf
            updates, state = tx.update(grads, state)
            steps.append({"updates": updates, "state": state})
        out[(gname, "nonfinite")] = steps
    return out


def _hook_iteration(state, module, rank: int, it: int, layout) -> dict:
    """One iteration of hand-made buckets through the hook: the outputs, statistics and saved residuals."""
    futs = []
    for b, names in enumerate(layout):  # as DDP does: every bucket is handed over, then the futures are waited for
        buf = torch.cat([hook_grad(rank, it, name) for name in names])
        bucket = FakeBucket(b, buf, [module[name] for name in names], last=b == len(layout) - 1)
        futs.append(topk_hook(state, bucket))
    outs = [f.wait().clone() for f in futs]
    saved = state.state_dict()
    return {"buckets": outs, "last_step": state.last_step, "iter": state.iter,
            "skipped": state.skipped_iters, "residuals": saved["residuals"], "layout": saved["layout"],
            "velocities": saved.get("velocities"),
            "entries": len(state.residuals)}  # fmt: skip


def _hook_phase(rank: int, groups: dict):
    out = {}
    for gname, group in groups.items():
        if group is None:
            continue
        for reselect, momentum in itertools.product((False, True), (0.0, HOOK_MOMENTUM)):
            module = hook_module()
            kwargs = {"density": HOOK_DENSITY, "warmup_iters": 1, "reselect": reselect, "model": module,
                      "momentum": momentum}  # fmt: skip
            state = TopKHookState(group, **kwargs)
            its = [_hook_iteration(state, module, rank, it, layout) for it, layout in enumerate(HOOK_LAYOUTS)]
            saved = _roundtrip(state.state_dict())
            resumed = TopKHookState(group, **kwargs)  # as in a new process
            resumed.load_state_dict(saved)
            for j, layout in enumerate(RESUME_LAYOUTS):
                its.append(_hook_iteration(resumed, module, rank, len(HOOK_LAYOUTS) + j, layout))
            # Other parameters in a bucket of the same size: fresh memory; the old entries are dropped.
            stranger = torch.nn.Parameter(torch.zeros(sum(math.prod(s) for s in HOOK_PARAMS.values())))
            topk_hook(resumed, FakeBucket(0, hook_grad(rank, 0, "a").repeat(4), [stranger], last=True)).wait()
            stranger_residual = next(iter(resumed.residuals.values())).clone()
            out[(gname, reselect, momentum)] = {
                "iters": its, "saved": saved, "entries_after_stranger": len(resumed.residuals),
                "stranger_residual": stranger_residual,
            }  # fmt: skip
        # Without model=, the residuals have no names to be saved by.
        anonymous = TopKHookState(group, density=HOOK_DENSITY, warmup_iters=0)
        topk_hook(anonymous, FakeBucket(0, hook_grad(rank, 0, "b"), [torch.zeros(30)], last=True)).wait()
        out[(gname, "anonymous")] = _failure(anonymous.state_dict)
    return out


def _threshold_grad(rank: int, it: int, b: int, numel: int) -> torch.Tensor:
    """Big-bucket gradients on a coarse grid (many ties), drifting slowly; the scale jumps at 3 and drops at 5."""
    g = torch.randn(numel, generator=torch.Generator().manual_seed(1000 * rank + 10 * it + b))
    g = (g * torch.linspace(0.5, 2.0, numel) * 8).round() / 8  # ties at every magnitude
    return g * THRESHOLD_SCALES[it]


def _threshold_phase(rank: int, groups: dict):
    """``selection="exact"`` and ``"threshold"`` on the same buckets: the averaged buckets and the residuals."""
    out = {}
    group = groups["world"]
    module = torch.nn.ParameterDict({n: torch.nn.Parameter(torch.zeros(s)) for n, s in THRESHOLD_PARAMS.items()})
    layout = (("a", "b"), ("c",))
    for selection in ("exact", "threshold"):
        state = TopKHookState(group, density=HOOK_DENSITY, warmup_iters=0, model=module, selection=selection)
        its = []
        for it in range(len(THRESHOLD_SCALES)):
            bufs = []
            for b, names in enumerate(layout):
                buf = torch.cat([_threshold_grad(rank, it, b, THRESHOLD_PARAMS[n]) for n in names])
                bucket = FakeBucket(b, buf, [module[n] for n in names], last=b == len(layout) - 1)
                bufs.append(topk_hook(state, bucket).wait().clone())
            its.append({"buckets": bufs, "residuals": state.state_dict()["residuals"],
                        "fallbacks": state.threshold_fallbacks})  # fmt: skip
        out[selection] = its
    return out


def _agreement_phase(rank: int, groups: dict):
    """Ranks configured differently: every rank must raise the same clear error (and the group stays usable)."""
    out = {}
    for gname, group in groups.items():
        if group is None:
            continue
        odd = rank == 1
        for field, kwargs in (("warmup_iters", {"warmup_iters": 2 if odd else 1}),
                              ("reselect", {"reselect": odd}),
                              ("density", {"density": 0.2 if odd else 0.1}),
                              ("exchange", {"exchange": "tree" if odd else "allgather"}),  # a text setting
                              ("agree", {})):  # fmt: skip
            state = TopKHookState(group, **{"density": 0.1, "warmup_iters": 1, **kwargs})
            bucket = FakeBucket(0, torch.ones(40), [torch.zeros(40)], last=True)
            out[(gname, field)] = _failure(lambda: topk_hook(state, bucket).wait())  # noqa: B023
        tree = {"w": torch.ones(40 if odd else 39)}  # the same k, trees of different sizes
        tx = distributed_topk(3, group=group)
        out[(gname, "tree")] = _failure(lambda: tx.update(tree, tx.init(tree)))  # noqa: B023
    return out


# --------------------------------------------------------------------------- DDP phases (ranks 0 and 1)


def _record_collectives(log: list):
    """Wrap the Python collectives functopk uses so that each call's byte counts are logged."""
    import torch.distributed as dist

    def wrap(name):
        orig = getattr(dist, name)

        def wrapped(out, *args, **kwargs):
            inp = args[0] if args and isinstance(args[0], torch.Tensor) else out
            log.append((name, inp.numel() * inp.element_size(), out.numel() * out.element_size()))
            return orig(out, *args, **kwargs)

        setattr(dist, name, wrapped)

    for name in ("all_gather_single", "all_gather_into_tensor", "all_reduce"):
        if hasattr(dist, name):
            wrap(name)


def _ddp_phase(rank: int, pair):
    """DDP with topk_hook on the 2-rank group (constructing DDP imports torch._dynamo: slow, so 2 ranks only)."""
    log: list = []
    _record_collectives(log)
    net, model, state, bucket_sizes, opt = ddp_recording_buckets(pair, density=DDP_DENSITY, warmup_iters=DDP_WARMUP)
    x, y = batch(n=16, seed=10 + rank)  # each rank its own data
    steps = []
    for _ in range(DDP_STEPS):
        del log[:], bucket_sizes[:]
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        steps.append({
            "loss": loss.item(),
            "params": _flat_params(net),
            "collectives": list(log),
            "bucket_sizes": list(bucket_sizes),
            "last_step": state.last_step,
            "iter": state.iter,
            "residuals": len(state.residuals),
        })  # fmt: skip
    return steps


def _poison(grad: torch.Tensor) -> torch.Tensor:
    """A gradient hook: one entry overflows, as in a mixed-precision step whose loss scale is too high."""
    grad = grad.clone()
    grad.view(-1)[0] = math.inf
    return grad


def _amp_run(rank: int, pair, mode: str):
    """Training with an Inf in rank 1's gradient at AMP_BAD_STEP.

    ``mode``: ``"topk"`` (hook + GradScaler, the scaler passed to the hook), ``"topk_unaware"`` (the
    scaler not passed), ``"dense"`` (DDP's allreduce + GradScaler), ``"topk_skip"`` (hook, no scaler,
    and the bad step left out altogether: what a skipped step should amount to); ``"mc"`` and
    ``"mc_skip"``: ``"topk"`` and ``"topk_skip"`` with momentum correction in the hook.
    """
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    net = small_cnn()
    model = DDP(net, process_group=pair, bucket_cap_mb=0.0005)  # several buckets
    skip = mode.endswith("skip")
    scaler = None if skip else torch.amp.GradScaler("cpu", init_scale=AMP_SCALE, growth_interval=1000)
    state = None
    if mode != "dense":
        state = TopKHookState(pair, density=0.1, warmup_iters=1, model=model,
                              grad_scaler=scaler if mode in ("topk", "mc") else None,
                              momentum=0.9 if mode.startswith("mc") else 0.0)  # fmt: skip
        model.register_comm_hook(state, topk_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    weight = net[0].weight
    steps: list = []
    for step in range(AMP_STEPS):
        if skip and step == AMP_BAD_STEP:
            steps.append(None)
            continue
        x, y = batch(n=16, seed=100 * step + rank)
        opt.zero_grad()
        handle = weight.register_hook(_poison) if step == AMP_BAD_STEP and rank == 1 else None
        before = _flat_params(net)
        loss = F.cross_entropy(model(x), y)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            opt.step()
        if handle is not None:
            handle.remove()
        steps.append({
            "stepped": not torch.equal(before, _flat_params(net)),
            "params": _flat_params(net),
            "residuals": None if state is None else state.state_dict()["residuals"],
            "velocities": None if state is None else state.state_dict().get("velocities"),
            "skipped": None if state is None else state.skipped_iters,
        })  # fmt: skip
    return steps


def _amp_phase(rank: int, pair):
    modes = ("topk", "topk_unaware", "dense", "topk_skip", "mc", "mc_skip")
    return {mode: _amp_run(rank, pair, mode) for mode in modes}


def _unused_run(rank: int, pair, overlap: bool = False):
    """DDP(find_unused_parameters=True) with heads that ranks skip; float64; the mass fed, applied and held.

    ``overlap``: the hook's selection on its worker thread (DDP's own allreduce of the used-parameter map
    follows the last bucket: the ordering that mode must keep)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    net = Branchy().double()
    model = DDP(net, process_group=pair, find_unused_parameters=True)
    names = {id(p): name for name, p in net.named_parameters()}
    state = TopKHookState(pair, density=0.2, warmup_iters=1, model=model, overlap=overlap)
    fed = {name: torch.zeros_like(p) for name, p in net.named_parameters()}
    applied = {name: torch.zeros_like(p) for name, p in net.named_parameters()}

    def hook(state, bucket):  # record what each rank feeds the hook, parameter by parameter
        offset = 0
        for p in bucket.parameters():
            fed[names[id(p)]] += bucket.buffer()[offset : offset + p.numel()].view(p.shape)
            offset += p.numel()
        return topk_hook(state, bucket)

    model.register_comm_hook(state, hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    held = []
    for step in range(UNUSED_STEPS):
        g = torch.Generator().manual_seed(1000 * step + rank)
        x, y = torch.randn(8, 6, generator=g, dtype=torch.float64), torch.randn(8, 3, generator=g, dtype=torch.float64)
        opt.zero_grad(set_to_none=True)
        F.mse_loss(model(x, unused_branches(rank, step)), y).backward()
        for name, p in net.named_parameters():  # what DDP wrote into .grad (None: dropped)
            if p.grad is not None:
                applied[name] += p.grad
        opt.step()
        held.append(state.state_dict()["residuals"])
    residuals = dict(held[-1])
    return {"fed": fed, "applied": applied, "residuals": residuals, "held": held,
            "find_unused": state.find_unused_parameters}  # fmt: skip


def _unregistered_model_failure(rank: int, pair, model_arg: str):
    """DDP(find_unused_parameters=True), the hook state built with ``model=None`` or the wrapped module: fails."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    net = Branchy().double()
    model = DDP(net, process_group=pair, find_unused_parameters=True)
    model.register_comm_hook(TopKHookState(pair, density=0.2, model=None if model_arg == "none" else net), topk_hook)
    x, y = torch.randn(8, 6, dtype=torch.float64), torch.randn(8, 3, dtype=torch.float64)
    return _failure(lambda: F.mse_loss(model(x, ("left",)), y).backward())


def _unused_phase(rank: int, pair):
    return {"model": _unused_run(rank, pair), "no_model": _unregistered_model_failure(rank, pair, "none"),
            "wrapped": _unregistered_model_failure(rank, pair, "wrapped"),
            "overlap": _unused_run(rank, pair, overlap=True)}  # fmt: skip


def _overlap_phase(rank: int, pair):
    """DDP (several buckets) with momentum correction, the hook's work on the backward thread or offloaded."""
    out = {}
    for overlap in (False, True):
        net, model, state, sizes, opt = ddp_recording_buckets(pair, density=DDP_DENSITY, warmup_iters=DDP_WARMUP,
                                                              momentum=0.9, overlap=overlap)  # fmt: skip
        x, y = batch(n=16, seed=30 + rank)
        steps = []
        for _ in range(OVERLAP_STEPS):
            del sizes[:]
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
            steps.append({"params": _flat_params(net), "sizes": list(sizes), "last_step": state.last_step,
                          "worker": state._offload._thread is not None})  # fmt: skip
        out[overlap] = steps
        del model
    return out


# --------------------------------------------------------------------------- failures


def _death_of_rank2(rank: int, world):
    """Rank 2 died after the hook phase: a world-group exchange on ranks 0 and 1 must fail fast and clearly."""
    return {
        "sparse_allreduce": _failure(lambda: sparse_allreduce(torch.tensor([0]), torch.ones(1), 4, world, capacity=1)),
        "distributed_topk": _failure(lambda: distributed_topk(1, group=world).update(
            {"w": torch.ones(3)}, distributed_topk(1).init({"w": torch.ones(3)}))),
    }  # fmt: skip


def _death_of_rank1(rank: int, pair):
    """Rank 1 dies between two DDP steps: rank 0's backward must fail fast and clearly."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    # No buffer broadcast in forward, so that the first collective to meet the dead rank is the hook's.
    no_sync = {"forward_sync_buffers": False} if "forward_sync_buffers" in inspect.signature(DDP).parameters \
        else {"broadcast_buffers": False}  # fmt: skip
    models = {}  # the overlap path with several buckets: the first is exchanged on the worker thread
    for path, kwargs, cap in ("hook", {}, 25), ("tree", {"exchange": "tree"}, 25), ("overlap", {"overlap": True}, 5e-4):
        models[path] = DDP(small_cnn(), process_group=pair, bucket_cap_mb=cap, **no_sync)
        models[path].register_comm_hook(TopKHookState(pair, density=0.1, warmup_iters=1, **kwargs), topk_hook)
    x, y = batch(n=8, seed=rank)
    for model in models.values():
        for _ in range(2):  # a dense and a compressed step succeed
            F.cross_entropy(model(x), y).backward()
    dist.barrier(group=pair)
    if rank == 1:
        os._exit(DEATH_EXIT_CODE)
    return {path: _failure(lambda m=model: F.cross_entropy(m(x), y).backward()) for path, model in models.items()}


# --------------------------------------------------------------------------- the worker


def worker(rank: int, world: int, store: str, out_dir: str) -> None:
    started = time.monotonic()
    dist = start_gloo(rank, world, store, WATCHDOG_S)
    world_group = dist.group.WORLD
    pair = dist.new_group([0, 1])
    groups = {"pair": pair if rank in (0, 1) else None, "world": world_group}
    results: dict = {"seconds": {"start": time.monotonic() - started}}
    path = os.path.join(out_dir, f"rank{rank}.pt")

    def run_phase(name, fn, *args):
        _phase(results, name, fn, *args)
        torch.save(results, path)
        if "error" in results[name]:
            os._exit(1)  # the others then fail at once (peer gone) instead of waiting for timeouts

    run_phase("allreduce", _allreduce_phase, rank, groups)
    run_phase("transform", _transform_phase, rank, groups)
    run_phase("hook", _hook_phase, rank, groups)
    run_phase("threshold", _threshold_phase, rank, groups)
    run_phase("agreement", _agreement_phase, rank, groups)
    dist.barrier()
    if rank == 2:
        os._exit(DEATH_EXIT_CODE)
    run_phase("ddp", _ddp_phase, rank, pair)  # on the pair group, unaffected by rank 2's death
    run_phase("amp", _amp_phase, rank, pair)
    run_phase("unused", _unused_phase, rank, pair)
    run_phase("overlap", _overlap_phase, rank, pair)
    run_phase("death_of_rank2", _death_of_rank2, rank, world_group)
    run_phase("death_of_rank1", _death_of_rank1, rank, pair)
    os._exit(0)  # the groups are broken now; skip their teardown
