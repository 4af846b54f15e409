"""compression_stats: per-step statistics of a compressor, against hand-computed and brute-force values."""

from __future__ import annotations

import math

import pytest
import torch

import functopk as ft
from tests.helpers import assert_tree_bitwise_equal, clone_tree


def test_hand_computed_top2_with_mixed_dtypes():
    tree = {"a": torch.tensor([3.0, -1.0]), "b": torch.tensor([2.0, 0.5], dtype=torch.float64)}
    tx = ft.compress.compression_stats(ft.topk(2))
    state = tx.init(tree)
    before = clone_tree((tree, state))
    out, state = tx.update(tree, state)
    assert_tree_bitwise_equal((tree, tx.init(tree)), before)  # pure
    assert_tree_bitwise_equal(out, ft.topk_sparsify(tree, 2))  # the updates pass through unchanged
    s = state.stats
    assert int(s.kept) == 2 and s.kept.dtype == torch.int64
    assert s.density.item() == 0.5 and s.density.dtype == torch.float32
    assert s.energy.item() == pytest.approx(13.0 / 14.25, rel=1e-6)
    assert s.residual_norm.item() == pytest.approx(math.sqrt(1.25), rel=1e-6)
    assert int(s.bytes) == (4 + 4) + (4 + 8)  # one fp32 and one fp64 value, each with an int32 index


def test_inside_error_feedback_the_residual_norm_is_the_residuals():
    g = torch.Generator().manual_seed(0)
    params = {"w": torch.zeros(5, 4), "b": torch.zeros(7)}
    tx = ft.error_feedback(ft.compress.compression_stats(ft.topk(3), index_bytes=8))
    state = tx.init(params)
    for _ in range(4):
        grads = {k: torch.randn(v.shape, generator=g) for k, v in params.items()}
        sent, state = tx.update(grads, state, params)
        s = state.inner_state.stats
        residual = torch.cat([x.reshape(-1) for x in ft.tree.leaves(state.residual)])
        flat_sent = torch.cat([x.reshape(-1) for x in ft.tree.leaves(sent)])
        corrected = residual + flat_sent
        assert int(s.kept) == 3 and int(s.bytes) == 3 * (8 + 4)
        assert s.residual_norm.item() == pytest.approx(residual.norm().item(), rel=1e-5)
        assert s.energy.item() == pytest.approx((flat_sent.norm() / corrected.norm()).item() ** 2, rel=1e-5)


def test_zero_input_keeps_everything_of_nothing_and_empty_trees_keep_the_old_stats():
    tx = ft.compress.compression_stats(ft.threshold(0.5))
    state = tx.init({"w": torch.zeros(3)})
    _, state = tx.update({"w": torch.zeros(3)}, state)
    assert int(state.stats.kept) == 0 and state.stats.energy.item() == 1.0 and state.stats.residual_norm.item() == 0
    _, state2 = ft.compress.compression_stats(ft.scale(1.0)).update({}, state)
    assert state2.stats is state.stats


def test_bad_arguments_and_states():
    with pytest.raises(TypeError, match="inner must be a functopk.GradientTransformation"):
        ft.compress.compression_stats(3)
    with pytest.raises(ValueError, match="index_bytes must be >= 0"):
        ft.compress.compression_stats(ft.topk(1), index_bytes=-1)
    tx = ft.compress.compression_stats(ft.topk(1))
    with pytest.raises(TypeError, match="state must be a CompressionStatsState"):
        tx.update({"w": torch.ones(2)}, ft.EmptyState())
