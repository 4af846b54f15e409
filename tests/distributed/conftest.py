"""The runs the tests of this folder read: one spawned 3-rank gloo run (``workers.py``) and one forked
8-rank run (``tree_workers.py``). No process group is ever created in the pytest process."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch
import torch.multiprocessing as mp

from tests.distributed.common import FORKSERVER_PRELOAD, WATCHDOG_S, WORLD, run_ranks
from tests.distributed.fsdp_topk_workers import FSDP_WATCHDOG_S, fsdp_worker
from tests.distributed.tree_workers import TREE_WATCHDOG_S, TREE_WORLD, tree_worker
from tests.distributed.workers import worker


@pytest.fixture(scope="session")
def run(tmp_path_factory):
    """One spawned 3-rank gloo run; its per-rank results, exit codes and duration."""
    out = tmp_path_factory.mktemp("distributed")
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=worker, args=(r, WORLD, str(out / "store"), str(out)), daemon=True)
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


@pytest.fixture(scope="session")
def tree_run(tmp_path_factory):
    """The forked 8-rank run of ``test_tree.py`` and ``test_hook_tree.py``: per-rank results, exit codes, duration."""
    out = tmp_path_factory.mktemp("tree")
    # forkserver: one server imports torch once and forks the 8 ranks (spawn re-imports torch in each: ~25 s on
    # 2 cores instead of ~3 s); the server is single-threaded, and no process group exists in this process.
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(FORKSERVER_PRELOAD)
    t0 = time.monotonic()
    codes = run_ranks(ctx, tree_worker, lambda r: (r, str(out / "store"), str(out)), TREE_WORLD, TREE_WATCHDOG_S)
    results = [torch.load(out / f"rank{r}.pt", weights_only=False) if (out / f"rank{r}.pt").exists() else {}
               for r in range(TREE_WORLD)]  # fmt: skip
    return SimpleNamespace(results=results, exitcodes=codes, seconds=time.monotonic() - t0)


@pytest.fixture(scope="session", params=[2, 4], ids=["P2", "P4"])
def fsdp_run(request, tmp_path_factory):
    """The forked FSDP2 runs of ``test_fsdp_topk.py`` on 2 and 4 ranks: per-rank results, exit codes."""
    world = request.param
    out = tmp_path_factory.mktemp(f"fsdp{world}")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(FORKSERVER_PRELOAD)
    codes = run_ranks(ctx, fsdp_worker, lambda r: (r, world, str(out / "store"), str(out)), world, FSDP_WATCHDOG_S)
    results = [torch.load(out / f"rank{r}.pt", weights_only=False) if (out / f"rank{r}.pt").exists() else {}
               for r in range(world)]  # fmt: skip
    return SimpleNamespace(world=world, results=results, exitcodes=codes)
