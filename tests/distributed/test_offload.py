"""The worker of ``TopKHookState(overlap=True)`` on its own: order, the inline last bucket, errors."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from functopk.distributed import TopKHookState
from functopk.distributed.offload import Offloader
from tests.distributed.common import assert_fails_for_ddp


def _done(value) -> torch.futures.Future:
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(value)
    return fut


def test_launches_run_in_order_on_one_worker_and_the_inline_one_after_them():
    offload, order, threads = Offloader(), [], set()

    def launch(i, delay=0.0):
        def run():
            time.sleep(delay)  # an earlier launch that takes longer still comes first
            order.append(i)
            threads.add(threading.current_thread().name)
            return _done(torch.tensor(float(i)))

        return run

    futs = [offload.run(launch(i, 0.02 * (3 - i)), inline=False) for i in range(3)]
    last = offload.run(launch(3), inline=True)
    assert order == [0, 1, 2, 3]  # the inline launch waited for the queued ones
    assert [f.wait().item() for f in [*futs, last]] == [0.0, 1.0, 2.0, 3.0]
    assert threads == {"functopk-topk-hook", threading.current_thread().name}


def test_an_error_reaches_the_future_and_the_worker_goes_on():
    offload = Offloader()

    def broken():
        raise RuntimeError("functopk.distributed: the peer went away")

    failed: torch.futures.Future = torch.futures.Future()
    failed.set_exception(ValueError("failed exchange"))
    bad = offload.run(broken, inline=False)
    worse = offload.run(lambda: failed, inline=False)
    good = offload.run(lambda: _done(torch.ones(2)), inline=False)
    offload.drain()
    assert_fails_for_ddp(bad, "the peer went away")  # DDP reads these futures: errors, not values
    assert_fails_for_ddp(worse, "ValueError: failed exchange")
    assert torch.equal(good.wait(), torch.ones(2))


def test_overlap_must_be_a_bool():
    with pytest.raises(TypeError, match="overlap must be a bool"):
        TopKHookState(overlap=1)
    assert TopKHookState(overlap=True).overlap is True
