"""layerwise_topk against a per-leaf brute force: ties, NaN, densities, min_size, errors, compile."""

from __future__ import annotations

import pytest
import torch

import functopk as ft
from tests.compress.helpers import check_compiled, tree_of
from tests.helpers import assert_tree_bitwise_equal, bits, clone_tree, ref_leaf_topk_mask, to_device

# --------------------------------------------------------------------------- layerwise top-k


def test_layerwise_topk_matches_per_leaf_brute_force_with_ties_and_nan(device):
    cpu_tree = {
        "big": torch.tensor([1.0, -3.0, 3.0, 2.0, -3.0, 0.5, float("nan"), 1.0]),
        "ties": torch.tensor([[2.0, -2.0, 2.0], [1.0, -2.0, 0.0]]),
        "mixed": torch.tensor([0.1, 5.0, -5.0, 0.3, 0.2], dtype=torch.float16),
        "small": torch.tensor([9.0, 8.0]),
    }
    tree = to_device(cpu_tree, device)
    before = clone_tree(tree)
    tx = ft.layerwise_topk(3, min_size=5)
    out, _ = tx.update(tree, tx.init(tree))
    assert_tree_bitwise_equal(tree, before)
    out = to_device(out, "cpu")
    for name in ("big", "ties", "mixed"):
        expected = torch.where(ref_leaf_topk_mask(cpu_tree[name], 3), cpu_tree[name], 0.0)
        assert torch.equal(bits(out[name]), bits(expected)), name
    assert torch.equal(out["small"], cpu_tree["small"])  # below min_size: dense


@pytest.mark.parametrize("density", [0.01, 0.1, 0.5, 1.0])
def test_layerwise_topk_density_keeps_k_from_density_per_leaf(device, density):
    tree = tree_of((30, 20), (7, 7), (5,), (100,))
    tx = ft.layerwise_topk(density=density, min_size=10)
    out = to_device(tx.update(to_device(tree, device), tx.init(None))[0], "cpu")
    for name, leaf in tree.items():
        n = leaf.numel()
        if n < 10:
            assert torch.equal(out[name], leaf)
        else:
            k = ft.sparse.k_from_density(density, n)
            assert torch.equal(out[name] != 0, ref_leaf_topk_mask(leaf, k)), name


def test_layerwise_topk_min_size_boundary_and_small_k(device):
    tree = to_device({"a": torch.randn(10), "b": torch.randn(9), "c": torch.randn(2)}, device)
    out, _ = ft.layerwise_topk(2, min_size=10).update(tree, ft.EmptyState())
    assert int((out["a"] != 0).sum()) == 2  # numel == min_size: sparsified
    assert torch.equal(out["b"], tree["b"])  # numel < min_size: dense
    out, _ = ft.layerwise_topk(5, min_size=0).update(tree, ft.EmptyState())
    assert torch.equal(out["c"], tree["c"])  # numel <= k: kept whole
    assert int((out["b"] != 0).sum()) == 5


def test_layerwise_topk_errors():
    with pytest.raises(TypeError, match="numeric density"):
        ft.layerwise_topk(density=lambda step: 0.1)
    with pytest.raises(ValueError, match="min_size must be >= 0"):
        ft.layerwise_topk(1, min_size=-1)
    with pytest.raises(TypeError, match="min_size must be an int"):
        ft.layerwise_topk(1, min_size=1.5)
    with pytest.raises(ValueError, match="method"):
        ft.layerwise_topk(1, method="no-such-method")
    with pytest.raises(ValueError, match="exactly one of k or density"):
        ft.layerwise_topk()


@pytest.mark.compile
def test_compiles_fullgraph_without_recompiling(fresh_dynamo):
    check_compiled(ft.layerwise_topk(density=0.2, min_size=8, method="torch"), tree_of((6, 5), (4,), (3, 3)))


def test_layerwise_topk_rejects_integer_gradients_and_foreign_states():
    tx = ft.layerwise_topk(1, min_size=0)
    with pytest.raises(TypeError, match=r"updates leaf at \['w'\] has dtype torch.int64"):
        tx.update({"w": torch.ones(3, dtype=torch.int64)}, tx.init(None))
    with pytest.raises(TypeError, match="floating-point"):
        tx.init({"w": torch.ones(3, dtype=torch.int32)})
    with pytest.raises(TypeError, match="EmptyState"):
        tx.update({"w": torch.ones(3)}, ft.randk(1).init(None))
