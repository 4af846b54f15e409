"""threshold against a coordinate-wise reference; tensor thresholds, inject_hyperparams, errors, compile."""

from __future__ import annotations

import math

import pytest
import torch

import functopk as ft
from tests.compress.helpers import check_compiled, tree_of
from tests.helpers import assert_tree_bitwise_equal, clone_tree, to_device

# --------------------------------------------------------------------------- threshold


def test_threshold_matches_reference_and_keeps_nan_and_inf(device):
    cpu_x = {
        "a": torch.tensor([0.5, -1.0, 1.0, -0.999, 2.0, 0.0, -0.0]),
        "b": torch.tensor([[float("nan"), float("inf")], [-float("inf"), 0.25]]),
        "c": torch.tensor([1.0, -3.0], dtype=torch.float64),
    }
    x = to_device(cpu_x, device)
    before = clone_tree(x)
    tx = ft.threshold(1.0)
    out, state = tx.update(x, tx.init(None))
    assert_tree_bitwise_equal(x, before)

    def ref(leaf):
        vals = [v if (math.isnan(v) or abs(v) >= 1.0) else 0.0 for v in leaf.reshape(-1).tolist()]
        return torch.tensor(vals, dtype=leaf.dtype).reshape(leaf.shape)

    assert_tree_bitwise_equal(to_device(out, "cpu"), ft.tree.map(ref, cpu_x))


def test_threshold_zero_keeps_everything_and_tensor_v_equals_number(device):
    x = to_device(tree_of((5, 3), (4,)), device)
    out, _ = ft.threshold(0.0).update(x, ft.EmptyState())
    assert_tree_bitwise_equal(out, x)
    a, _ = ft.threshold(0.7).update(x, ft.EmptyState())
    for where in dict.fromkeys(("cpu", device)):  # v on the CPU or on the leaves' device
        b, _ = ft.threshold(torch.tensor(0.7, device=where)).update(x, ft.EmptyState())
        assert_tree_bitwise_equal(a, b)


def test_threshold_with_inject_hyperparams(device):
    tx = ft.inject_hyperparams(ft.threshold)(v=0.5)
    x = {"w": torch.tensor([0.2, 0.6, -1.0], device=device)}
    state = tx.init(x)
    out, state = tx.update(x, state)
    assert out["w"].tolist() == [0.0, pytest.approx(0.6), -1.0]
    state = state._replace(hyperparams={"v": torch.tensor(0.8, device=device)})
    out, state = tx.update(x, state)
    assert out["w"].tolist() == [0.0, 0.0, -1.0]


def test_threshold_errors():
    with pytest.raises(ValueError, match="v must be >= 0"):
        ft.threshold(-1.0)
    with pytest.raises(TypeError, match="v must be a real number"):
        ft.threshold("0.1")
    with pytest.raises(TypeError, match="floating-point"):
        ft.threshold(0.1).update({"w": torch.ones(2, dtype=torch.int32)}, ft.EmptyState())


@pytest.mark.compile
@pytest.mark.parametrize(
    "make", [lambda: ft.threshold(0.5), lambda: ft.inject_hyperparams(ft.threshold)(v=0.5)],
    ids=["threshold", "threshold-injected"],
)
def test_compiles_fullgraph_without_recompiling(make, fresh_dynamo):
    check_compiled(make(), tree_of((6, 5), (4,), (3, 3)))


def test_threshold_rejects_a_foreign_state():
    with pytest.raises(TypeError, match="EmptyState"):
        ft.threshold(0.1).update({"w": torch.ones(2)}, ft.randk(1).init(None))
