"""``topk_hook`` resumed in fresh processes equals an uninterrupted run bit for bit, with several DDP buckets.

Two forkserver runs of 2 gloo ranks (``resume_workers.py``): one trains
through and writes a checkpoint midway; fresh processes then load it into a
fresh model, DDP, optimizer and hook state and train the rest. The
uninterrupted run is the reference. No process group is ever created in the
pytest process.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch
import torch.multiprocessing as mp

from tests.distributed.common import FORKSERVER_PRELOAD, run_ranks
from tests.distributed.resume_workers import RESUME_WATCHDOG_S, SAVE_AT, STEPS, WORLD, resume_worker
from tests.helpers import bits


def _launch(ctx, mode: str, out) -> list:
    return run_ranks(ctx, resume_worker, lambda r: (r, mode, str(out / f"store-{mode}"), str(out)), WORLD,
                     RESUME_WATCHDOG_S)  # fmt: skip


@pytest.fixture(scope="module")
def resume_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("resume")
    ctx = mp.get_context("forkserver")  # fresh processes, without importing torch in each (see test_tree.py)
    ctx.set_forkserver_preload(FORKSERVER_PRELOAD)
    t0 = time.monotonic()
    codes = _launch(ctx, "through", out) + _launch(ctx, "resume", out)
    files = {(mode, r): out / f"{mode}-rank{r}.pt" for mode in ("through", "resume") for r in range(WORLD)}
    results = {key: torch.load(f, weights_only=False) for key, f in files.items() if f.exists()}
    return SimpleNamespace(results=results, exitcodes=codes, seconds=time.monotonic() - t0)


def _got(run, mode: str, rank: int) -> dict:
    res = run.results.get((mode, rank))
    assert res is not None, f"{mode} rank {rank} recorded nothing (exit codes {run.exitcodes})"
    assert "error" not in res, res["error"]
    return res


def test_the_runs_finished(resume_run):
    assert resume_run.exitcodes == [0] * (2 * WORLD), resume_run.exitcodes
    for mode in ("through", "resume"):
        for r in range(WORLD):
            _got(resume_run, mode, r)


def test_ddp_starts_every_process_with_other_buckets_than_it_rebuilds(resume_run):
    through = _got(resume_run, "through", 0)[False, "through"]["layouts"]
    resumed = _got(resume_run, "resume", 0)[False, "resumed"]["layouts"]
    initial, rebuilt = through[0], through[1]
    assert len(initial) == 1 and len(rebuilt) >= 3, (initial, rebuilt)
    assert all(layout == rebuilt for layout in through[1:])
    assert resumed[0] == initial and resumed[1] == rebuilt  # a new process starts over with the initial bucket
    # The checkpoint records the buckets the uninterrupted run used next.
    assert _got(resume_run, "resume", 0)[False, "saved_layout"] == rebuilt


def test_with_find_unused_parameters_ddp_keeps_its_first_buckets(resume_run):
    through = _got(resume_run, "through", 0)[True, "through"]["layouts"]
    resumed = _got(resume_run, "resume", 0)[True, "resumed"]["layouts"]
    assert len(through[0]) >= 3 and all(layout == through[0] for layout in through + resumed)
    assert _got(resume_run, "resume", 0)[True, "saved_layout"] == through[0]


@pytest.mark.parametrize("unused", [False, True], ids=["default", "find_unused_parameters"])
def test_resumed_run_equals_the_uninterrupted_one_bit_for_bit(resume_run, unused):
    for r in range(WORLD):
        through = _got(resume_run, "through", r)[unused, "through"]
        resumed = _got(resume_run, "resume", r)[unused, "resumed"]
        for name, expected in through["final"].items():
            assert torch.equal(bits(resumed["final"][name]), bits(expected)), f"rank {r}: {name} differs"
        for name, expected in through["hook"]["residuals"].items():
            assert torch.equal(bits(resumed["hook"]["residuals"][name]), bits(expected)), f"rank {r}: residual {name}"
        assert sorted(resumed["hook"]["residuals"]) == sorted(through["hook"]["residuals"])
        for key in ("iter", "skipped_iters", "last_step", "total", "layout"):
            assert resumed["hook"][key] == through["hook"][key], key
    assert resumed["hook"]["iter"] == STEPS and STEPS > SAVE_AT


def test_several_real_ddp_buckets_can_be_deferred(resume_run):
    """Resumed by a DDP that finds unused parameters: its buckets differ from the saved ones from the first on.

    The first step after loading equals the uninterrupted run's bit for bit; that DDP never rebuilds, so the
    later steps select within its own buckets (not compared).
    """
    for r in range(WORLD):
        through = _got(resume_run, "through", r)[False, "through"]
        mixed = _got(resume_run, "resume", r)["mixed"]
        saved = _got(resume_run, "resume", r)[False, "saved_layout"]
        assert len(mixed["layouts"][0]) >= 2 and mixed["layouts"][0][0] != saved[0], mixed["layouts"][0]
        assert torch.equal(bits(mixed["trace"][0]), bits(through["trace"][SAVE_AT]))


def test_without_the_saved_layout_the_resumed_run_differs(resume_run):
    """The control: the first step after loading selects within DDP's single initial bucket."""
    for r in range(WORLD):
        through = _got(resume_run, "through", r)[False, "through"]["final"]
        control = _got(resume_run, "resume", r)[False, "control"]["final"]
        assert any(not torch.equal(control[n], through[n]) for n in through if n.endswith("weight"))


def test_resume_run_is_fast(resume_run):
    assert resume_run.seconds < 40, resume_run.seconds
