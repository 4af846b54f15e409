"""functopk.leafwise: the helper every leaf-maths transformation is written with."""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch

import functopk as ft
from functopk.base import init_count
from functopk.build import wrapper
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


# --------------------------------------------------------------------------- the rules the hand-written ones needed


class CountState(NamedTuple):
    count: torch.Tensor  # type: ignore[assignment]


def test_counted_state_is_made_and_advanced_by_leafwise():
    seen = []

    def update(grads, state, params):
        seen.append(state.count.clone())  # the step being done
        return grads, state

    tx = ft.leafwise("counted", update, state=CountState, counted=True)
    state = tx.init(None)
    assert state == CountState(count=torch.tensor(0)) and state.count.dtype == torch.int64
    for _ in range(2):
        _, state = tx.update({"w": torch.ones(2)}, state)
    assert [int(c) for c in seen] == [0, 1] and int(state.count) == 2
    with pytest.raises(TypeError, match=r"state must be a CountState \(the state counted's init returns\)"):
        tx.update({"w": torch.ones(2)}, ft.EmptyState())


def test_dtypes_and_same_device_rules():
    tx = ft.leafwise("f32", lambda g, s, p: (g, s), dtypes=(torch.float32,), same_device=True)
    with pytest.raises(TypeError, match=r"updates leaf at \['w'\] has dtype torch.float64; .* of dtype float32"):
        tx.update({"w": torch.ones(2, dtype=torch.float64)}, tx.init(None))
    with pytest.raises(TypeError, match=r"params leaf at \['w'\] has dtype torch.float16"):
        ft.leafwise("f32", lambda g, s, p: (g, s), init=lambda p: ft.EmptyState(), dtypes=(torch.float32,)).init(
            {"w": torch.ones(2, dtype=torch.float16)})
    with pytest.raises(ValueError, match=r"updates leaves are on several devices \['cpu', 'meta'\]"):
        tx.update({"a": torch.ones(2), "b": torch.ones(2, device="meta")}, tx.init(None))
    assert tx.update({"w": torch.ones(2)}, tx.init(None))[0]["w"].dtype == torch.float32


def test_validate_sees_params_at_init_and_updates_at_every_update():
    calls = []

    def validate(leaves, treedef, name):
        calls.append((name, [tuple(x.shape) for x in leaves], treedef.paths()))
        if any(x.dim() != 1 for x in leaves):
            raise ValueError(f"{name} must be 1-d")

    tx = ft.leafwise("flat", lambda g, s, p: (g, s), validate=validate)
    state = tx.init(None)  # nothing to validate
    assert calls == []
    state = tx.init({"w": torch.zeros(3)})
    tx.update({"w": torch.ones(3)}, state)
    assert calls == [("params", [(3,)], [("w",)]), ("updates", [(3,)], [("w",)])]
    with pytest.raises(ValueError, match="params must be 1-d"):
        tx.init({"w": torch.zeros(2, 2)})
    with pytest.raises(ValueError, match="updates must be 1-d"):
        tx.update({"w": torch.ones(2, 2)}, state)


class RowState(NamedTuple):
    rows: object


def test_shapes_rule_for_a_state_field_not_shaped_like_the_updates():
    def init(params):
        return RowState(rows=[x.new_zeros(x.shape[:1]) for x in params])

    def update(grads, state, params):
        rows = foreach.add(state.rows, [g.sum(dim=1) for g in grads])
        return grads, RowState(rows=rows)

    tx = ft.leafwise("row_sums", update, init=init, state=RowState, tree_fields=("rows",),
                     shapes={"rows": lambda g: g.shape[:1]})
    state = tx.init({"w": torch.zeros(2, 3)})
    _, state = tx.update({"w": torch.ones(2, 3)}, state)
    assert torch.equal(state.rows["w"], torch.full((2,), 3.0))
    with pytest.raises(ValueError, match=r"row_sums's state \(rows\) leaf at \['w'\] is .*, but an update of shape "
                                         r"\(4, 3\) needs shape \(4,\) there"):
        tx.update({"w": torch.ones(4, 3)}, state)
    with pytest.raises(ValueError, match=r"row_sums's state \(rows\) does not have the tree structure of updates"):
        tx.update({"v": torch.ones(2, 3)}, state)


# --------------------------------------------------------------------------- wrapper


class CallsState(NamedTuple):
    calls: torch.Tensor
    inner_state: object


def count_calls(inner, needs_params=None):
    """A test wrapper: runs ``inner`` and counts its calls."""

    def update(updates, state, params):
        out, inner_state = inner.update(updates, state.inner_state, params)
        return out, CallsState(state.calls + 1, inner_state)

    return wrapper("count_calls", inner, update, init=lambda p, s: CallsState(init_count(p), s), state=CallsState,
                   needs_params=needs_params)


def test_wrapper_checks_inner_state_and_params_at_init():
    tx = count_calls(ft.sgd(0.5, momentum=0.9))
    params = {"w": torch.ones(2)}
    state = tx.init(params)
    assert isinstance(state.inner_state[0], ft.optim.TraceState)
    out, state = tx.update({"w": torch.ones(2)}, state, params)
    assert torch.equal(out["w"], torch.full((2,), -0.5)) and int(state.calls) == 1
    with pytest.raises(TypeError, match=r"inner must be a functopk.GradientTransformation .*, got int"):
        count_calls(3)
    with pytest.raises(TypeError, match=r"state must be a CallsState \(the state count_calls's init returns\)"):
        tx.update({"w": torch.ones(2)}, state.inner_state, params)
    with pytest.raises(ValueError, match="count_calls needs the parameters at init: they are counted"):
        count_calls(ft.identity(), needs_params="they are counted").init(None)


def test_compressors_and_optimizers_are_written_with_leafwise_or_wrapper():
    """docs/design.md's one idiom: no hand-written (init, update) pair outside the documented exceptions."""
    import pathlib

    root = pathlib.Path(ft.__file__).parent
    exceptions = {"optim/_shared.py", "optim/inject.py"}  # build their inner transformation anew at each call
    paths = [path for package in ("compress", "optim") for path in sorted((root / package).glob("*.py"))]
    hand_written = [
        name for name, path in ((p.relative_to(root).as_posix(), p) for p in paths)
        if "GradientTransformation(init" in path.read_text() and name not in exceptions
    ]
    assert hand_written == []
