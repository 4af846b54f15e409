"""Pickling and deep copies of transformations and of the torch.optim adapters (torch.save(opt), spawn, Ray).

A model and its optimizer are copied together (as ``torch.save((model, opt))``
or a spawned worker would), then both pairs take the same steps: the copy must
step bit for bit as the original, from state it does not share with it.
"""

from __future__ import annotations

import copy
import pickle

import pytest
import torch

import functopk as ft


def test_transformations_pickle_recursively():
    schedule = ft.warmup_cosine_decay_schedule(0.0, 0.1, warmup_steps=1, decay_steps=10)
    tx = ft.chain(ft.error_feedback(ft.topk(2)), ft.inject_hyperparams(ft.sgd)(learning_rate=schedule, momentum=0.9))
    copied = pickle.loads(pickle.dumps(tx))
    params = {"w": torch.tensor([1.0, 2.0, 3.0])}
    ours, theirs = tx.init(params), copied.init(params)
    for grads in ({"w": torch.tensor([0.5, -4.0, 2.0])}, {"w": torch.tensor([3.0, 1.0, -2.0])}):
        ours_updates, ours = tx.update(grads, ours, params)
        theirs_updates, theirs = copied.update(grads, theirs, params)
        assert torch.equal(ours_updates["w"], theirs_updates["w"])
    assert ours_updates["w"].abs().sum() > 0  # (the schedule's second value is its peak)
    assert torch.equal(ours[0].residual["w"], theirs[0].residual["w"])


def _hand_built():
    def update(updates, state, params=None):
        return updates, state

    return ft.GradientTransformation(lambda params: ft.EmptyState(), update)


def test_what_cannot_be_pickled_is_named():
    with pytest.raises(TypeError, match=r"sgd\(\.\.\.\) made: its argument learning_rate is the lambda"):
        pickle.dumps(ft.chain(ft.topk(1), ft.sgd(lambda count: 0.1)))
    with pytest.raises(TypeError, match="GradientTransformation .*records no recipe"):
        pickle.dumps(ft.chain(ft.topk(1), _hand_built()))


def test_deepcopy_makes_a_recorded_transformation_again_and_keeps_any_other():
    tx = ft.chain(ft.topk(1), ft.sgd(0.5, momentum=0.9))
    copied = copy.deepcopy(tx)
    assert copied is not tx and repr(copied) == repr(tx) == "chain(topk(1), sgd(0.5, momentum=0.9))"
    hand_built = _hand_built()
    assert copy.deepcopy(hand_built) is hand_built and copy.copy(hand_built) is hand_built  # functions are atomic
