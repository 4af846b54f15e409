"""The one spawned gloo run that every test of this folder reads (see ``workers.py``)."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch
import torch.multiprocessing as mp

from tests.distributed.common import WATCHDOG_S, WORLD
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
