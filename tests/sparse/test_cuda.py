"""The CUDA path: no host synchronisation in the default top-k path, and the CPU's selection (skipped without a GPU).

``torch.cuda.set_sync_debug_mode("error")`` turns every synchronising CUDA
call (``.item()``, ``nonzero``, a device-to-host copy) into an error, so these
tests fail if the default path waits for the device.
"""

from __future__ import annotations

import pytest
import torch

import functopk as ft
from tests.helpers import assert_tree_bitwise_equal, no_sync, reference_sparsify, to_device

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]


def _tree():
    g = torch.Generator().manual_seed(0)
    tree = {"conv": torch.randn(64, 32, 3, 3, generator=g), "fc": torch.randn(1000, 100, generator=g),
            "bias": torch.randn(100, generator=g).half()}
    tree["fc"][3, 4] = float("nan")
    return tree


@pytest.mark.parametrize("method", ["exact", "torch", "approx", "gaussian"])
def test_dense_outputs_do_not_synchronise(method):
    tree = to_device(_tree(), "cuda")
    k_dev = torch.tensor(500, device="cuda")
    with no_sync():
        for k in (500, k_dev):
            ft.topk_sparsify(tree, k, method=method)
            ft.topk_mask(tree, k, method=method)


def test_static_size_indices_and_a_whole_update_do_not_synchronise():
    cpu = _tree()
    tree = to_device(cpu, "cuda")
    tx = ft.chain(ft.topk(density=ft.linear_schedule(0.1, 0.01, 10)), ft.sgd(0.1, momentum=0.9))
    state = tx.init(tree)
    with no_sync():
        sparse = ft.topk_indices(tree, 500)  # an int k: static size (torch.nonzero_static)
        bounded = ft.topk_indices(tree, torch.tensor(400, device="cuda"), max_k=500)  # a tensor k: max_k's size
        updates, state = tx.update(tree, state, tree)
        ft.apply_updates(tree, updates)
    assert sparse.indices.shape == (500,) and torch.equal(bounded.indices, sparse.indices)
    assert_tree_bitwise_equal(to_device(bounded.to_dense(tree), "cpu"), reference_sparsify(cpu, 400))
    assert_tree_bitwise_equal(to_device(ft.topk_sparsify(tree, 500), "cpu"), reference_sparsify(cpu, 500))


def test_selection_equals_the_cpu_kernels_bit_for_bit():
    cpu = _tree()
    tree = to_device(cpu, "cuda")
    for k in (1, 77, 5000, torch.tensor(123)):
        assert_tree_bitwise_equal(to_device(ft.topk_sparsify(tree, k), "cpu"), ft.topk_sparsify(cpu, k))
        got, want = ft.topk_indices(tree, k), ft.topk_indices(cpu, k)
        assert torch.equal(got.indices.cpu(), want.indices)
