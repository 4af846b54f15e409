"""functopk.distributed on real gloo process groups, against single-process references.

Process start-up (a fresh interpreter importing torch) is the expensive part here,
so one spawned run of three ranks does every multi-process check: each check
runs on the 3-rank world and on a 2-rank subgroup (ranks 0 and 1). The workers
only *record* what they saw (``torch.save`` per rank); the assertions, and the
references they are compared with, live in the test functions of this process.
The run ends with rank 2 dying, so that the others must fail fast and clearly.
Processes talk over 127.0.0.1 only, rendezvous through a file (no port to
choose), use a 20 s process-group timeout, and are killed if still alive after
a watchdog deadline.
"""

from __future__ import annotations

import datetime
import faulthandler
import inspect
import math
import os
import socket
import time
import traceback
from types import SimpleNamespace

import pytest
import torch
import torch.multiprocessing as mp

import functopk as ft
from functopk.distributed import HookStats, TopKHookState, distributed_topk, sparse_allreduce, topk_hook
from tests.helpers import assert_tree_bitwise_equal, batch, bits, clone_tree, small_cnn

WORLD = 3
PG_TIMEOUT_S = 20.0
WATCHDOG_S = 150.0
DEATH_EXIT_CODE = 17
GROUPS = ("pair", "world")  # ranks {0, 1}, ranks {0, 1, 2}
SIZES = {"pair": 2, "world": 3}

# --------------------------------------------------------------------------- inputs (shared by workers and references)


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
    raise ValueError(case)


ALLREDUCE_CASES = ("fixed", "variable", "variable_capacity", "fp64_odd")
TREE_SHAPES = {"a": (5, 4), "b": (7,), "c": (2, 3, 2)}  # 39 coordinates
TX_K, TX_STEPS = 5, 4


def tx_grads(rank: int, step: int):
    g = gen(2, rank, step)
    return {name: torch.randn(shape, generator=g) for name, shape in TREE_SHAPES.items()}


HOOK_BUCKETS = (50, 30)  # sizes of two fake buckets; the second is the last of an iteration
HOOK_DENSITY, HOOK_ITERS = 0.1, 3


def hook_grads(rank: int, it: int, bucket: int) -> torch.Tensor:
    return torch.randn(HOOK_BUCKETS[bucket], generator=gen(3, rank, it, bucket))


DDP_STEPS, DDP_WARMUP, DDP_DENSITY = 12, 2, 0.1


# --------------------------------------------------------------------------- the worker


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


def _phase(results: dict, name: str, fn, *args) -> None:
    t0 = time.monotonic()
    try:
        results[name] = fn(*args)
    except Exception:  # recorded; the test for this phase reports it
        results[name] = {"error": traceback.format_exc()}
    results.setdefault("seconds", {})[name] = time.monotonic() - t0


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
    return out


def _hook_phase(rank: int, groups: dict):
    out = {}
    for gname, group in groups.items():
        if group is None:
            continue
        for reselect in (False, True):
            state = TopKHookState(group, density=HOOK_DENSITY, warmup_iters=1, reselect=reselect)
            params = [[torch.zeros(1)], [torch.zeros(1)]]  # stand-ins: the residual key uses their identity
            its = []
            for it in range(HOOK_ITERS):
                got = []
                for b in range(len(HOOK_BUCKETS)):
                    bucket = FakeBucket(b, hook_grads(rank, it, b), params[b], last=b == len(HOOK_BUCKETS) - 1)
                    got.append(topk_hook(state, bucket).wait().clone())
                its.append({"buckets": got, "last_step": state.last_step, "iter": state.iter})
            residuals = {k[1]: v.clone() for k, v in state.residuals.items()}
            # A rebuilt bucket (other parameters, same size): fresh memory, and the old entry is dropped.
            params[0] = [torch.zeros(1)]
            for b in range(len(HOOK_BUCKETS)):
                bucket = FakeBucket(b, hook_grads(rank, 0, b), params[b], last=b == len(HOOK_BUCKETS) - 1)
                topk_hook(state, bucket).wait()
            out[(gname, reselect)] = {
                "iters": its, "residuals": residuals, "entries_after_rebuild": len(state.residuals)
            }
    return out


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
    from torch.nn.parallel import DistributedDataParallel as DDP


    log: list = []
    _record_collectives(log)
    torch.manual_seed(0)  # the same initial model everywhere (DDP would broadcast it anyway)
    net = small_cnn()
    model = DDP(net, process_group=pair, bucket_cap_mb=0.0005)
    state = TopKHookState(pair, density=DDP_DENSITY, warmup_iters=DDP_WARMUP)
    bucket_sizes: list = []

    def hook(state, bucket):
        bucket_sizes.append(bucket.buffer().numel())
        return topk_hook(state, bucket)

    model.register_comm_hook(state, hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    x, y = batch(n=16, seed=10 + rank)  # each rank its own data
    steps = []
    for _ in range(DDP_STEPS):
        del log[:], bucket_sizes[:]
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        steps.append({
            "loss": loss.item(),
            "params": torch.cat([p.detach().reshape(-1) for p in net.parameters()]).clone(),
            "collectives": list(log),
            "bucket_sizes": list(bucket_sizes),
            "last_step": state.last_step,
            "iter": state.iter,
            "residuals": len(state.residuals),
        })  # fmt: skip
    return steps


def _failure(fn) -> tuple[str, float]:
    t0 = time.monotonic()
    try:
        fn()
        return "no error", time.monotonic() - t0
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}", time.monotonic() - t0


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
    model = DDP(small_cnn(), process_group=pair, **no_sync)
    model.register_comm_hook(TopKHookState(pair, density=0.1, warmup_iters=1), topk_hook)
    x, y = batch(n=8, seed=rank)
    for _ in range(2):  # a dense and a compressed step succeed
        torch.nn.functional.cross_entropy(model(x), y).backward()
    dist.barrier(group=pair)
    if rank == 1:
        os._exit(DEATH_EXIT_CODE)
    return {"hook": _failure(lambda: torch.nn.functional.cross_entropy(model(x), y).backward())}


def _worker(rank: int, world: int, store: str, out_dir: str) -> None:
    faulthandler.dump_traceback_later(WATCHDOG_S - 10, exit=True)  # never outlive the parent's watchdog
    started = time.monotonic()
    if "lo" in {name for _, name in socket.if_nameindex()}:
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # gloo's sockets on the loopback interface only
    torch.set_num_threads(1)
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=PG_TIMEOUT_S),
    )  # fmt: skip
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
    dist.barrier()
    if rank == 2:
        os._exit(DEATH_EXIT_CODE)
    run_phase("ddp", _ddp_phase, rank, pair)  # on the pair group, unaffected by rank 2's death
    run_phase("death_of_rank2", _death_of_rank2, rank, world_group)
    run_phase("death_of_rank1", _death_of_rank1, rank, pair)
    os._exit(0)  # the groups are broken now; skip their teardown


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One spawned 3-rank gloo run; its per-rank results, exit codes and duration."""
    out = tmp_path_factory.mktemp("distributed")
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_worker, args=(r, WORLD, str(out / "store"), str(out)), daemon=True)
             for r in range(WORLD)]  # fmt: skip
    t0 = time.monotonic()
    for p in procs:
        p.start()
    deadline = t0 + WATCHDOG_S
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    stragglers = [r for r, p in enumerate(procs) if p.is_alive()]
    for r in stragglers:
        procs[r].kill()
        procs[r].join()
    results = [torch.load(out / f"rank{r}.pt", weights_only=False) if (out / f"rank{r}.pt").exists() else {}
               for r in range(WORLD)]  # fmt: skip
    return SimpleNamespace(results=results, exitcodes=[p.exitcode for p in procs], stragglers=stragglers,
                           seconds=time.monotonic() - t0)  # fmt: skip


def phase(run, name: str, rank: int):
    got = run.results[rank].get(name)
    assert got is not None, f"rank {rank} recorded nothing for phase {name!r} (exit codes {run.exitcodes})"
    if isinstance(got, dict) and "error" in got:
        pytest.fail(f"rank {rank} failed in phase {name!r}:\n{got['error']}")
    return got


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
    sent = []
    new_res = []
    for g, r in zip(grads_per_rank, residuals):
        acc = g.double() + r
        mask = ft.topk_mask(acc, k)
        sent.append(torch.where(mask, acc, 0.0))
        new_res.append(torch.where(mask, 0.0, acc))
    total = sum(sent)
    if reselect:
        keep = ft.topk_mask(total, k)
        new_res = [r + torch.where(keep, 0.0, s) for r, s in zip(new_res, sent)]
        total = torch.where(keep, total, 0.0)
    return total / len(grads_per_rank), new_res


def flat(tree) -> torch.Tensor:
    return torch.cat([tree[name].reshape(-1) for name in sorted(TREE_SHAPES)])


# --------------------------------------------------------------------------- tests: the spawned run


def test_run_finishes_without_stragglers(run):
    assert run.stragglers == [], f"ranks {run.stragglers} still alive after {WATCHDOG_S} s: killed"
    assert run.exitcodes == [0, DEATH_EXIT_CODE, DEATH_EXIT_CODE], run.exitcodes


@pytest.mark.parametrize("gname", GROUPS)
@pytest.mark.parametrize("case", ALLREDUCE_CASES)
def test_sparse_allreduce_matches_single_process_reference(run, gname, case):
    size = SIZES[gname]
    inputs = [allreduce_case(case, r) for r in members(gname)]
    numel, dtype = inputs[0][2], inputs[0][1].dtype
    expected = reference_sum([(i, v) for i, v, _, _ in inputs], numel)
    got = [phase(run, "allreduce", r)[(gname, case)] for r in members(gname)]
    for r, rec in enumerate(got):
        assert rec["pure"], f"rank {r} had its inputs modified"
        assert rec["sum"].dtype == dtype and rec["sum"].shape == (numel,)
        torch.testing.assert_close(rec["sum"].double(), expected, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(rec["mean"].double(), expected / size, rtol=1e-6, atol=1e-6)
        assert torch.equal(bits(rec["sum"]), bits(got[0]["sum"])), f"rank {r} differs from rank 0"


@pytest.mark.parametrize("gname", GROUPS)
def test_sparse_allreduce_rejects_out_of_range_index_before_exchanging(run, gname):
    for r in members(gname):
        msg = phase(run, "allreduce", r)[(gname, "range")]
        assert "indices must lie in [0, 30)" in msg, msg


@pytest.mark.parametrize("gname", GROUPS)
@pytest.mark.parametrize("reselect", [False, True])
def test_distributed_topk_matches_reference_and_conserves_mass(run, gname, reselect):
    size = SIZES[gname]
    numel = sum(math.prod(s) for s in TREE_SHAPES.values())
    got = [phase(run, "transform", r)[(gname, reselect)] for r in members(gname)]
    residuals = [torch.zeros(numel, dtype=torch.float64) for _ in members(gname)]
    total_in = torch.zeros(numel, dtype=torch.float64)
    total_out = torch.zeros(numel, dtype=torch.float64)
    for step in range(TX_STEPS):
        grads = [flat(tx_grads(r, step)) for r in members(gname)]
        total_in += sum(g.double() for g in grads)
        expected, residuals = reference_ef_topk(grads, residuals, TX_K, reselect)
        for r in members(gname):
            rec = got[r][step]
            upd, st = rec["updates"], rec["state"]
            assert {n: (x.shape, x.dtype) for n, x in upd.items()} == {
                n: (torch.Size(s), torch.float32) for n, s in TREE_SHAPES.items()
            }
            torch.testing.assert_close(flat(upd).double(), expected, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(st.residual.double(), residuals[r], rtol=1e-5, atol=1e-6)
            assert torch.equal(bits(flat(upd)), bits(flat(got[0][step]["updates"])))  # replicas agree bitwise
            assert int(st.count) == step + 1
            assert int(st.bytes_sent) == TX_K * (4 + 4)  # int32 index + fp32 value
            assert int(st.bytes_gathered) == size * TX_K * (4 + 4)
            nnz = int((expected != 0).sum())
            assert float(st.update_density) == pytest.approx(nnz / numel)
            if reselect:
                assert nnz <= TX_K
        total_out += size * flat(got[0][step]["updates"]).double()
    # What every rank sent and was applied, plus what is still held back, is every gradient ever computed.
    held = sum(got[r][-1]["state"].residual.double() for r in members(gname))
    torch.testing.assert_close(total_out + held, total_in, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("gname", GROUPS)
def test_distributed_topk_propagates_nan_to_every_rank(run, gname):
    size = SIZES[gname]
    expected = torch.tensor([(size - 1) / size, math.nan, -3.0, 0.0])
    for r in members(gname):
        torch.testing.assert_close(phase(run, "transform", r)[(gname, "nan")], expected, equal_nan=True)


@pytest.mark.parametrize("gname", GROUPS)
@pytest.mark.parametrize("reselect", [False, True])
def test_topk_hook_on_buckets_matches_reference(run, gname, reselect):
    size = SIZES[gname]
    got = [phase(run, "hook", r)[(gname, reselect)] for r in members(gname)]
    residuals = {b: [torch.zeros(n, dtype=torch.float64) for _ in members(gname)] for b, n in enumerate(HOOK_BUCKETS)}
    for it in range(HOOK_ITERS):
        for b, n in enumerate(HOOK_BUCKETS):
            grads = [hook_grads(r, it, b) for r in members(gname)]
            if it == 0:  # warm-up: plain averaging
                expected = sum(g.double() for g in grads) / size
            else:
                k = ft.sparse.k_from_density(HOOK_DENSITY, n)
                expected, residuals[b] = reference_ef_topk(grads, residuals[b], k, reselect)
            for r in members(gname):
                out = got[r]["iters"][it]["buckets"][b]
                torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-6)
                assert torch.equal(bits(out), bits(got[0]["iters"][it]["buckets"][b]))
        sent = [n * 4 if it == 0 else ft.sparse.k_from_density(HOOK_DENSITY, n) * 8 for n in HOOK_BUCKETS]
        stats = got[0]["iters"][it]["last_step"]
        assert stats == HookStats(
            bytes_sent=sum(sent),
            bytes_gathered=sum(s if it == 0 else s * size for s in sent),
            bytes_dense=4 * sum(HOOK_BUCKETS),
            coords_sent=sum(n if it == 0 else ft.sparse.k_from_density(HOOK_DENSITY, n) for n in HOOK_BUCKETS),
            coords=sum(HOOK_BUCKETS),
        )
        assert got[0]["iters"][it]["iter"] == it + 1
    for r in members(gname):
        for b, n in enumerate(HOOK_BUCKETS):
            torch.testing.assert_close(got[r]["residuals"][n].double(), residuals[b][r], rtol=1e-5, atol=1e-6)
        assert got[r]["entries_after_rebuild"] == len(HOOK_BUCKETS)


def test_ddp_hook_trains_keeps_replicas_identical_and_counts_bytes(run):
    gname, size = "pair", 2
    got = [phase(run, "ddp", r) for r in members(gname)]
    for step in range(DDP_STEPS):
        for r in members(gname):
            assert torch.equal(bits(got[r][step]["params"]), bits(got[0][step]["params"])), (
                f"rank {r} parameters differ from rank 0 after step {step}"
            )
        rec = got[0][step]
        sizes = rec["bucket_sizes"]
        gathers = [c for c in rec["collectives"] if c[0] != "all_reduce"]
        reduces = [c for c in rec["collectives"] if c[0] == "all_reduce"]
        if step < DDP_WARMUP:
            assert gathers == [] and len(reduces) == len(sizes)
            assert sum(c[1] for c in reduces) == rec["last_step"].bytes_sent == 4 * sum(sizes)
            continue
        assert len(sizes) >= 2, f"expected several DDP buckets, got sizes {sizes}"
        ks = [ft.sparse.k_from_density(DDP_DENSITY, n) for n in sizes]
        wire = [size * k * (4 + 4) for k in ks]  # P * k * (int32 index + fp32 value) per bucket
        assert reduces == []
        assert [c[2] for c in gathers] == wire  # measured on the collectives themselves
        assert [c[1] for c in gathers] == [k * 8 for k in ks]
        stats = rec["last_step"]
        assert stats.bytes_gathered == sum(wire) and stats.bytes_sent == 8 * sum(ks)
        assert stats.bytes_dense == 4 * sum(sizes) and stats.coords_sent == sum(ks)
        assert rec["residuals"] == len(sizes)  # one per bucket; none left over from the first buckets
    for r in members(gname):
        losses = [s["loss"] for s in got[r]]
        assert sum(losses[-3:]) < 0.8 * sum(losses[:3]), f"rank {r} loss did not decrease: {losses}"


@pytest.mark.parametrize(
    ("which", "ranks", "what"),
    [
        ("death_of_rank2", (0, 1), "sparse_allreduce"),
        ("death_of_rank2", (0, 1), "distributed_topk"),
        ("death_of_rank1", (0,), "hook"),
    ],
)
def test_dead_rank_makes_the_others_fail_fast_and_clearly(run, which, ranks, what):
    for r in ranks:
        msg, seconds = phase(run, which, r)[what]
        assert "functopk.distributed" in msg and "another rank probably died" in msg, msg
        assert seconds < PG_TIMEOUT_S + 5, f"rank {r} took {seconds:.1f} s to fail"


# --------------------------------------------------------------------------- tests: this process only


def test_everything_needs_a_process_group_only_when_it_runs():
    import torch.distributed as dist

    assert not dist.is_initialized()
    tx = distributed_topk(density=0.5)  # building needs no group
    state = tx.init({"w": torch.ones(4)})
    with pytest.raises(RuntimeError, match="init_process_group"):
        tx.update({"w": torch.ones(4)}, state)
    with pytest.raises(RuntimeError, match="init_process_group"):
        sparse_allreduce(torch.tensor([0]), torch.ones(1), 3)
    TopKHookState()


@pytest.mark.parametrize(
    ("args", "kwargs", "exc", "match"),
    [
        ((torch.tensor([0.0]), torch.ones(1), 3), {}, TypeError, "indices must be a 1-d integer tensor"),
        ((torch.tensor([[0]]), torch.ones(1), 3), {}, TypeError, "indices must be a 1-d integer tensor"),
        ((torch.tensor([0]), torch.ones(1, dtype=torch.int64), 3), {}, TypeError, "values must be a 1-d floating"),
        ((torch.tensor([0, 1]), torch.ones(1), 3), {}, ValueError, "same length"),
        ((torch.tensor([0]), torch.ones(1), 0), {}, ValueError, "numel must be >= 1, got 0"),
        ((torch.tensor([0]), torch.ones(1), 3.0), {}, TypeError, "numel must be an int, got float 3.0"),
        ((torch.tensor([0, 1]), torch.ones(2), 3), {"capacity": 1}, ValueError, "capacity=1 is smaller"),
        ((torch.tensor([0]), torch.ones(1), 3), {"capacity": 1.0}, TypeError, "capacity must be an int"),
        ((torch.tensor([0]), torch.ones(1), 3), {"average": 1}, TypeError, "average must be a bool"),
        ((torch.tensor([0]), torch.ones(1), 3), {"group": "world"}, TypeError, "group must be a torch.distributed"),
    ],
)
def test_sparse_allreduce_rejects_bad_arguments(args, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        sparse_allreduce(*args, **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        ({}, ValueError, "exactly one of k or density"),
        ({"k": 3, "density": 0.1}, ValueError, "exactly one of k or density"),
        ({"k": 0}, ValueError, "k must be >= 1"),
        ({"k": 2.0}, TypeError, "k must be an int"),
        ({"density": 1.5}, ValueError, r"density must be in \(0, 1\]"),
        ({"density": "0.1"}, TypeError, r"density must be a number in \(0, 1\], got str '0.1'"),
        ({"k": 1, "reselect": 1}, TypeError, "reselect must be a bool"),
        ({"k": 1, "group": 0}, TypeError, "group must be a torch.distributed"),
    ],
)
def test_distributed_topk_rejects_bad_arguments(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        distributed_topk(**kwargs)


def test_distributed_topk_init_checks_the_tree():
    with pytest.raises(ValueError, match="k=5 exceeds the number of coordinates in the tree \\(4\\)"):
        distributed_topk(5).init({"w": torch.ones(4)})
    with pytest.raises(TypeError, match=r"params leaf at \['w'\] has dtype torch.int64; expected a floating-point"):
        distributed_topk(1).init({"w": torch.ones(4, dtype=torch.int64)})
    tx = distributed_topk(1)
    state = tx.init({"w": torch.ones(4)})
    with pytest.raises(ValueError, match="updates have 5 coordinates"):
        tx.update({"w": torch.ones(5)}, state)
    with pytest.raises(TypeError, match="state must be a DistributedTopKState .*distributed_topk's init"):
        tx.update({"w": torch.ones(4)}, (state,))
    with pytest.raises(ValueError, match=r"the tree has no coordinates: .*were all gradients None\?"):
        distributed_topk(density=0.5).init({"w": None})


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        ({"density": 0.0}, ValueError, r"density must be in \(0, 1\]"),
        ({"density": None}, TypeError, r"density must be a number in \(0, 1\], got NoneType"),
        ({"density": torch.tensor(0.1)}, TypeError, r"density must be a number in \(0, 1\], got a tensor"),
        ({"warmup_iters": -1}, ValueError, "warmup_iters must be >= 0, got -1"),
        ({"warmup_iters": 1.0}, TypeError, "warmup_iters must be an int, got float"),
        ({"reselect": "yes"}, TypeError, "reselect must be a bool"),
        ({"process_group": 1}, TypeError, "process_group must be a torch.distributed"),
    ],
)
def test_hook_state_rejects_bad_arguments(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        TopKHookState(**kwargs)


def test_hook_stats_add_field_by_field():
    assert HookStats(1, 2, 3, 4, 5) + HookStats(10, 20, 30, 40, 50) == HookStats(11, 22, 33, 44, 55)


def test_module_is_exposed_without_initialising_anything():
    import torch.distributed as dist

    assert ft.distributed.sparse_allreduce is sparse_allreduce and "distributed" in ft.__all__
    assert not dist.is_initialized()


def test_docstring_examples_run_in_their_own_process():
    """The examples of functopk.distributed start gloo process groups; they run here, away from the test process.

    (pyproject's addopts keeps them out of the main doctest collection: a gloo
    group torn down inside the long-lived pytest process aborted it once in CI.)
    """
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-o", "addopts=", "--doctest-modules", "-q", "-p", "no:cacheprovider",
         os.path.join(root, "functopk", "distributed")],
        capture_output=True, text=True, cwd=root, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "6 passed" in proc.stdout, proc.stdout[-3000:]
