"""``resume.Regroup`` in one process, with a stand-in for the hook: gathering, scattering, failures, fallback.

The real hook on real process groups is in ``test_distributed.py`` (stand-in
buckets) and ``test_resume.py`` (DDP in fresh processes); here the hook is a
function that records what it is given, so the bookkeeping is checked alone.
"""

from __future__ import annotations

from functools import partial
from types import SimpleNamespace

import pytest
import torch

from functopk.distributed.resume import Layout, Regroup
from tests.distributed.common import FakeBucket, assert_fails_for_ddp

SIZES = {"a": 3, "b": 2, "c": 4, "d": 1}


def _setup(saved_names):
    params = {n: torch.nn.Parameter(torch.zeros(k)) for n, k in SIZES.items()}
    saved = tuple(tuple(id(params[n]) for n in group) for group in saved_names)
    state = SimpleNamespace(_layout=Layout(rebuilds=True), _regroup=None)
    state._layout.loaded = True
    state._regroup = Regroup(saved, state._layout, release=lambda: setattr(state, "_regroup", None))
    grads = {n: torch.arange(k, dtype=torch.float32) + 10 * i for i, (n, k) in enumerate(SIZES.items())}
    return params, state, grads


def _buckets(params, grads, layout):
    return [FakeBucket(i, torch.cat([grads[n] for n in names]), [params[n] for n in names], i == len(layout) - 1)
            for i, names in enumerate(layout)]  # fmt: skip


def _doubling_hook(seen):
    def hook(state, bucket):
        names = [next(n for n, p in state.params.items() if p is q) for q in bucket.parameters()]
        seen.append((names, bucket.buffer().clone(), bucket.is_last()))
        fut = torch.futures.Future()
        fut.set_result(bucket.buffer().mul_(2))
        return fut

    return hook


def _arrive_all(state, buckets, hook):
    futs = []
    for b in buckets:
        fut = state._regroup.arrive(b, partial(hook, state)) if state._regroup is not None else None
        futs.append(hook(state, b) if fut is None else fut)
    return futs


def test_buckets_that_match_pass_and_the_rest_are_reduced_within_the_saved_ones():
    params, state, grads = _setup((("b", "a"), ("d", "c")))
    state.params = params
    seen = []
    hook = _doubling_hook(seen)
    buckets = _buckets(params, grads, (("b", "a"), ("c",), ("d",)))
    assert state._regroup.arrive(buckets[0], partial(hook, state)) is None  # as saved: the hook runs as usual
    futs = [hook(state, buckets[0]), state._regroup.arrive(buckets[1], partial(hook, state))]
    assert not futs[1].done() and [names for names, _, _ in seen] == [["b", "a"]]  # deferred
    futs.append(state._regroup.arrive(buckets[2], partial(hook, state)))
    assert state._regroup is None and futs[1].done()
    outs = [f.wait() for f in futs]
    assert [(names, last) for names, _, last in seen] == [(["b", "a"], False), (["d", "c"], True)]
    assert torch.equal(seen[1][1], torch.cat([grads["d"], grads["c"]]))  # gathered in the saved order
    for out, b in zip(outs, buckets):
        assert out is b.buffer()  # the averages are written into DDP's own buffers
    for names, out in zip((("b", "a"), ("c",), ("d",)), outs):
        assert torch.equal(out, 2 * torch.cat([grads[n] for n in names]))


def test_a_failing_reduction_fails_every_deferred_future():
    params, state, grads = _setup((("a", "b", "c", "d"),))
    state.params = params

    def failing_hook(state, bucket):
        fut = torch.futures.Future()
        fut.set_exception(RuntimeError("peer died"))
        return fut

    futs = _arrive_all(state, _buckets(params, grads, (("a",), ("b", "c"), ("d",))), failing_hook)
    for fut in futs:  # DDP reads the deferred futures too: each must carry an error, not the exception as a value
        assert_fails_for_ddp(fut, "peer died")


def test_a_hook_that_raises_fails_the_deferred_futures_and_raises():
    params, state, grads = _setup((("a", "b", "c", "d"),))

    def raising_hook(state, bucket):
        raise ValueError("configured differently")

    buckets = _buckets(params, grads, (("a", "b"), ("c", "d")))
    first = state._regroup.arrive(buckets[0], partial(raising_hook, state))
    with pytest.raises(ValueError, match="configured differently"):
        state._regroup.arrive(buckets[1], partial(raising_hook, state))
    assert_fails_for_ddp(first, "ValueError: configured differently")


def test_buckets_of_other_parameters_are_reduced_as_they_came():
    params, state, grads = _setup((("a", "b"), ("c",)))  # "d" is in no saved bucket
    state.params = params
    seen = []
    buckets = _buckets(params, grads, (("a", "b", "c", "d"),))
    (fut,) = _arrive_all(state, buckets, _doubling_hook(seen))
    assert [names for names, _, _ in seen] == [["a", "b", "c", "d"]]
    assert fut.wait() is buckets[0].buffer() and not state._layout.loaded  # the layout used is not the saved one
