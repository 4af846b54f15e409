"""functopk.leafwise: the helper every leaf-maths transformation is written with."""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch

import functopk as ft
from functopk.base import init_count
from functopk.tree import foreach
from tests.helpers import assert_tree_bitwise_equal, clone_tree


class SumState(NamedTuple):
    total: object
    count: torch.Tensor  # type: ignore[assignment]


def running_sum() -> ft.GradientTransformation:
    """A test transformation: emits the running sum of the updates (a hand-checkable state)."""

    def init(params):
        return SumState(total=foreach.zeros_like(params), count=init_count(params))

    def update(grads, state, params):
        total = foreach.add(state.total, grads)
        return total, SumState(total=total, count=state.count + 1)

    return ft.leafwise("running_sum", update, init=init, state=SumState, tree_fields=("total",))


PARAMS = {"w": torch.zeros(2, 2), "h": torch.zeros(3, dtype=torch.float16), "frozen": None}


def test_flattens_unflattens_and_keeps_state_as_trees():
    tx = running_sum()
    state = tx.init(PARAMS)
    assert state.total["frozen"] is None and state.total["w"].shape == (2, 2)
    g = {"w": torch.ones(2, 2), "h": torch.ones(3, dtype=torch.float16), "frozen": None}
    before = clone_tree((g, state))
    out, state2 = tx.update(g, state)
    assert_tree_bitwise_equal((g, state), before)  # pure
    out, state3 = tx.update(g, state2)
    assert torch.equal(out["w"], torch.full((2, 2), 2.0)) and out["h"].dtype == torch.float16
    assert int(state3.count) == 2 and torch.equal(state3.total["h"], torch.full((3,), 2.0, dtype=torch.float16))


def test_dtypes_of_outputs_and_state_never_change():
    def update(grads, state, params):  # promotes to float32 through a 0-d float32 tensor
        return foreach.mul_list(grads, [torch.tensor(2.0)] * len(grads)), state

    tx = ft.leafwise("double", update)
    out, _ = tx.update({"h": torch.tensor(1.0, dtype=torch.float16)}, tx.init(None))
    assert out["h"].dtype == torch.float16 and out["h"].item() == 2.0


def test_checks_state_type_floating_leaves_structure_and_shapes():
    tx = running_sum()
    state = tx.init(PARAMS)
    g = {"w": torch.ones(2, 2), "h": torch.ones(3, dtype=torch.float16), "frozen": None}
    with pytest.raises(TypeError, match=r"state must be a SumState \(the state running_sum's init returns\)"):
        tx.update(g, ft.EmptyState())
    with pytest.raises(TypeError, match=r"updates leaf at \['w'\] has dtype torch.int64"):
        tx.update({**g, "w": torch.ones(2, 2, dtype=torch.int64)}, state)
    with pytest.raises(ValueError, match=r"updates leaf at \['w'\] has shape \(1, 2\), but running_sum's state"):
        tx.update({**g, "w": torch.ones(1, 2)}, state)  # would broadcast: refused
    with pytest.raises(ValueError, match=r"does not have the tree structure of running_sum's state"):
        tx.update({"w": torch.ones(2, 2)}, state)
    with pytest.raises(ValueError, match="needs the parameters at init"):
        tx.init(None)
    with pytest.raises(TypeError, match=r"dict\(model.named_parameters\(\)\)"):
        tx.init(torch.nn.Linear(2, 2).parameters())


def test_needs_params_requires_and_checks_them():
    def update(grads, state, params):
        return foreach.add(grads, params), state

    tx = ft.leafwise("plus_params", update, needs_params=True)
    g = {"w": torch.ones(2)}
    with pytest.raises(ValueError, match="plus_params needs the parameters"):
        tx.update(g, tx.init(None))
    with pytest.raises(ValueError, match=r"params leaf at \['w'\] has shape \(3,\)"):
        tx.update(g, tx.init(None), {"w": torch.ones(3)})
    out, _ = tx.update(g, tx.init(None), {"w": torch.full((2,), 2.0)})
    assert torch.equal(out["w"], torch.full((2,), 3.0))


def test_empty_tree_runs_the_maths_on_empty_lists():
    tx = running_sum()
    state = tx.init({})
    out, state = tx.update({}, state)
    assert out == {} and int(state.count) == 1


def test_stateless_init_refuses_an_iterator_too():
    tx = ft.leafwise("negate", lambda g, s, p: (foreach.neg(g), s))
    with pytest.raises(TypeError, match=r"dict\(model.named_parameters\(\)\)"):
        tx.init(torch.nn.Linear(2, 2).parameters())
    assert tx.init(None) == ft.EmptyState()
