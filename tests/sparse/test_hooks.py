"""GradientHooks: hooks that hold their owner weakly, one owner per parameter, removed at once on demand."""

from __future__ import annotations

import gc

import pytest
import torch

from functopk.sparse.hooks import GradientHooks, owner_of


class Recorder:
    """An owner that records each gradient it is shown and frees it, as a stream does."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, torch.Tensor]] = []

    def take(self, i: int, param: torch.Tensor) -> None:
        self.seen.append((i, param.grad.clone()))
        param.grad = None


class Cyclic(Recorder):
    """An owner in a reference cycle: only the garbage collector frees it."""

    def __init__(self) -> None:
        super().__init__()
        self.me = self


def test_hooks_call_the_owner_and_skip_leaves_without_grad():
    w, frozen = torch.ones(2, requires_grad=True), torch.ones(3)
    owner = Recorder()
    hooks = GradientHooks(owner, Recorder.take, [frozen, w], ["['frozen']", "['w']"])
    (3 * w).sum().backward()
    assert [i for i, _ in owner.seen] == [1] and torch.equal(owner.seen[0][1], torch.full((2,), 3.0))
    assert w.grad is None and hooks.active and owner_of(w) is owner and owner_of(frozen) is None


def test_a_deleted_owner_stops_its_hooks_and_they_are_removed():
    w = torch.ones(2, requires_grad=True)
    owner = Recorder()
    hooks = GradientHooks(owner, Recorder.take, [w], ["w"])
    del owner  # no gc.collect(): the last reference goes, and so do the hooks
    assert not hooks.active and owner_of(w) is None
    w.sum().backward()
    assert torch.equal(w.grad, torch.ones(2))  # left as autograd wrote it


def test_an_owner_kept_only_by_a_cycle_stops_as_soon_as_it_is_collected():
    w = torch.ones(2, requires_grad=True)
    owner = Cyclic()
    hooks = GradientHooks(owner, Cyclic.take, [w], ["w"])
    del owner
    gc.collect()
    assert not hooks.active
    w.sum().backward()
    assert torch.equal(w.grad, torch.ones(2))


def test_one_owner_per_parameter_named_and_nothing_registered_on_refusal():
    a, b = torch.ones(2, requires_grad=True), torch.ones(3, requires_grad=True)
    first = Recorder()
    hooks = GradientHooks(first, Recorder.take, [a], ["['a']"])
    second = Recorder()
    with pytest.raises(ValueError, match=r"params leaf at \['a'\] already has the gradient hooks of a live Recorder"):
        GradientHooks(second, Recorder.take, [b, a], ["['b']", "['a']"])
    assert owner_of(b) is None  # b, checked first, was not hooked either
    b.sum().backward()
    assert torch.equal(b.grad, torch.ones(3)) and second.seen == []
    hooks.remove()
    hooks.remove()  # again: nothing
    assert owner_of(a) is None
    GradientHooks(second, Recorder.take, [a], ["['a']"])  # free again
    a.sum().backward()
    assert len(second.seen) == 1 and first.seen == []


@pytest.mark.parametrize(
    "leaves, match",
    [
        (lambda w: [w, w], r"one tensor twice, at \[0\] and \[1\]"),
        (lambda w: [w * 2], r"\[0\] is not a leaf of the autograd graph"),
    ],
)
def test_leaves_are_checked_before_anything_is_registered(leaves, match):
    w = torch.ones(2, requires_grad=True)
    with pytest.raises(ValueError, match=match):
        GradientHooks(Recorder(), Recorder.take, leaves(w), ["[0]", "[1]"])
    assert owner_of(w) is None
