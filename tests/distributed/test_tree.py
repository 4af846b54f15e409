"""The gTop-k tree exchange (``functopk.distributed.tree``) on gloo, P = 2, 3, 4, 6, 8, against a brute-force reference.

One run of 8 forked ranks (``tree_workers.py``) with subgroups of the first
2, 3, 4, 6 and 8 ranks; the workers record, the tests compare with the dense
single-process reference of ``tree_reference.py``. No process group is ever
created in the pytest process.
"""

from __future__ import annotations

import math
import time
from types import SimpleNamespace

import pytest
import torch
import torch.multiprocessing as mp

from functopk.distributed.transform import distributed_topk
from functopk.distributed.tree import _merge, tree_wire_bytes
from tests.distributed.common import FORKSERVER_PRELOAD
from tests.distributed.tree_reference import tree_reference
from tests.distributed.tree_workers import (
    TREE_CASES,
    TREE_GROUPS,
    TREE_WATCHDOG_S,
    TREE_WORLD,
    TX_K,
    TX_SHAPES,
    TX_STEPS,
    tree_acc,
    tree_worker,
    tx_grads,
)
from tests.helpers import bits

GROUPS = list(TREE_GROUPS)


@pytest.fixture(scope="module")
def tree_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("tree")
    # forkserver: one server imports torch once and forks the 8 ranks (spawn re-imports torch in each: ~25 s on
    # 2 cores instead of ~3 s); the server is single-threaded, and no process group exists in this process.
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(FORKSERVER_PRELOAD)
    procs = [ctx.Process(target=tree_worker, args=(r, str(out / "store"), str(out)), daemon=True)
             for r in range(TREE_WORLD)]  # fmt: skip
    t0 = time.monotonic()
    for p in procs:
        p.start()
    for p in procs:
        p.join(max(0.0, t0 + TREE_WATCHDOG_S - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    results = [torch.load(out / f"rank{r}.pt", weights_only=False) if (out / f"rank{r}.pt").exists() else {}
               for r in range(TREE_WORLD)]  # fmt: skip
    return SimpleNamespace(results=results, exitcodes=[p.exitcode for p in procs], seconds=time.monotonic() - t0)


def _got(run, gname: str, rank: int) -> dict:
    res = run.results[rank]
    assert "error" not in res, res["error"]
    return res[gname]


def test_the_run_finished(tree_run):
    assert tree_run.exitcodes == [0] * TREE_WORLD, (tree_run.exitcodes, [r.get("error") for r in tree_run.results])


@pytest.mark.parametrize("case", list(TREE_CASES))
@pytest.mark.parametrize("gname", GROUPS)
def test_tree_equals_the_reference_bitwise_on_every_rank(tree_run, gname, case):
    world = TREE_GROUPS[gname]
    accs = [tree_acc(case, r) for r in range(world)]
    mean, residuals, _ = tree_reference(accs, TREE_CASES[case][1])
    for r in range(world):
        got = _got(tree_run, gname, r)["raw"][case]
        assert torch.equal(bits(got["mean"]), bits(mean)), (r, got["mean"], mean)
        assert torch.equal(bits(got["residual"]), bits(residuals[r])), r
        assert not got["bad"]
    # conservation: P * mean + sum of residuals = sum of the inputs
    total = sum(a.double() for a in accs)
    assert torch.allclose(world * mean.double() + sum(r.double() for r in residuals), total, atol=1e-5)
    assert torch.count_nonzero(mean) <= TREE_CASES[case][1]


@pytest.mark.parametrize("case", list(TREE_CASES))
@pytest.mark.parametrize("gname", GROUPS)
def test_wire_bytes_per_rank_are_log2_p_times_k_pairs(tree_run, gname, case):
    world = TREE_GROUPS[gname]
    numel, k, dtype = TREE_CASES[case]
    pair = 4 + torch.empty((), dtype=dtype).element_size()  # int32 index + value
    for r in range(world):
        sent, received = _got(tree_run, gname, r)["raw"][case]["bytes"]
        assert (sent, received) == tree_wire_bytes(k, numel, dtype, world, r)
        if world & (world - 1) == 0:
            assert sent == received == int(math.log2(world)) * k * pair


@pytest.mark.parametrize("gname", GROUPS)
def test_an_inf_on_one_rank_is_seen_by_every_rank(tree_run, gname):
    assert all(_got(tree_run, gname, r)["raw"]["inf"] for r in range(TREE_GROUPS[gname]))


@pytest.mark.parametrize("gname", GROUPS)
def test_distributed_topk_tree_equals_the_reference_over_steps(tree_run, gname):
    world = TREE_GROUPS[gname]
    residuals = [torch.zeros(39) for _ in range(world)]
    names = sorted(TX_SHAPES)  # FlatLayout order of a dict: sorted keys
    for step in range(TX_STEPS):
        accs = [torch.cat([tx_grads(r, step)[n].reshape(-1) for n in names]) + residuals[r] for r in range(world)]
        mean, residuals, _ = tree_reference(accs, TX_K)
        for r in range(world):
            got = _got(tree_run, gname, r)["transform"]["steps"][step]
            flat = torch.cat([got["updates"][n].reshape(-1) for n in names])
            assert torch.equal(bits(flat), bits(mean)), (step, r)
            assert torch.equal(bits(got["residual"]), bits(residuals[r])), (step, r)
            assert (got["bytes_sent"], got["bytes_gathered"]) == tree_wire_bytes(TX_K, 39, torch.float32, world, r)
            assert got["skipped"] == 0


@pytest.mark.parametrize("gname", GROUPS)
def test_ranks_with_different_exchanges_fail_naming_the_field(tree_run, gname):
    for r in range(TREE_GROUPS[gname]):
        assert "exchange" in _got(tree_run, gname, r)["transform"]["mismatch"]


def test_merge_is_symmetric_and_ties_go_to_the_lower_index():
    ones = torch.ones(3, 1, dtype=torch.bool)
    a = (torch.tensor([1, 4, 6]), torch.tensor([2.0, -1.0, 3.0]), ones)
    b = (torch.tensor([0, 4, 9]), torch.tensor([-2.0, 0.5, 3.0]), ~ones)
    ab, ba = _merge(a, b, 3), _merge(b, a, 3)
    assert torch.equal(ab[0], ba[0]) and torch.equal(bits(ab[1]), bits(ba[1]))
    assert ab[0].tolist() == [0, 6, 9]  # |3| twice, then |2| at 0 and 1: 0 wins; 4 sums to -0.5
    assert ab[2][:, 0].tolist() == [False, True, False]
    nan = _merge((torch.tensor([5]), torch.tensor([float("nan")]), ones[:1]),
                 (torch.tensor([2]), torch.tensor([1e30]), ones[:1]), 1)  # fmt: skip
    assert nan[0].tolist() == [5]


def test_exchange_argument_is_checked():
    with pytest.raises(ValueError, match="exchange"):
        distributed_topk(2, exchange="ring")
    with pytest.raises(TypeError, match="exchange"):
        distributed_topk(2, exchange=None)  # type: ignore[arg-type]
