"""Combinators: masked, partition (clipping and apply_if_finite: tests/optim/test_clipping.py; multi_steps:
tests/optim/test_accumulate.py)."""

from __future__ import annotations

import optree
import pytest
import torch

import functopk as ft
from tests.helpers import assert_tree_bitwise_equal, clone_tree

PARAMS = {"conv": {"weight": torch.randn(3, 2, 2), "bias": torch.randn(3)}, "fc": (torch.randn(4, 3), torch.randn(4))}


pytestmark = pytest.mark.usefixtures("one_thread")


def grads_at(i, like=PARAMS):
    g = torch.Generator().manual_seed(i)
    return ft.tree.map(lambda p: torch.randn(p.shape, generator=g), like)


def is_matrix(tree):
    return ft.tree.map(lambda x: x.dim() > 1, tree)


def sub(tree, keep):
    """The tree with the leaves where ``keep`` is False replaced by None (what an inner transform sees)."""
    return ft.tree.map(lambda x, k: x if k else None, tree, keep)


# ---------------------------------------------------------------- masked


@pytest.mark.parametrize("mask", [is_matrix(PARAMS), is_matrix], ids=["tree", "callable"])
def test_masked_equals_inner_on_selected_leaves_and_leaves_the_rest(mask):
    inner = ft.adam(0.1, weight_decay=0.01)
    tx = ft.masked(inner, mask)
    keep = is_matrix(PARAMS)
    state, ref_state = tx.init(PARAMS), inner.init(sub(PARAMS, keep))
    # the inner state holds tensors for the selected leaves only
    assert len(ft.tree.leaves(state.inner_state.mu)) == 2
    for i in range(3):
        g = grads_at(i)
        g0, s0 = clone_tree(g), clone_tree(state)
        updates, state = tx.update(g, state, PARAMS)
        ref_updates, ref_state = inner.update(sub(g, keep), ref_state, sub(PARAMS, keep))
        assert_tree_bitwise_equal(g, g0)
        assert_tree_bitwise_equal(s0, clone_tree(s0))
        assert updates["conv"]["bias"] is g["conv"]["bias"] and updates["fc"][1] is g["fc"][1]
        assert torch.equal(updates["conv"]["weight"], ref_updates["conv"]["weight"])
        assert torch.equal(updates["fc"][0], ref_updates["fc"][0])
    assert_tree_bitwise_equal(state.inner_state, ref_state)


def test_masked_errors():
    with pytest.raises(TypeError, match="inner must be a functopk.GradientTransformation"):
        ft.masked(lambda u: u, {"w": True})
    tx = ft.masked(ft.scale(2.0), {"conv": {"weight": True, "bias": 1}, "fc": (True, False)})
    with pytest.raises(TypeError, match=r"mask leaf at \['conv'\]\['bias'\] must be a Python bool, got int"):
        tx.init(PARAMS)
    tx = ft.masked(ft.scale(2.0), {"conv": True, "fc": (True, False)})
    with pytest.raises(ValueError, match=r"mask must have the structure of the parameters: leaf 0 is at \['conv'\] "):
        tx.init(PARAMS)
    tx = ft.masked(ft.scale(2.0), is_matrix)
    state = tx.init(PARAMS)
    with pytest.raises(TypeError, match=r"state must be a MaskedState \(the state masked's init returns\), got tuple"):
        tx.update(PARAMS, (state.inner_state,), PARAMS)
    with pytest.raises(ValueError, match=r"params does not have the tree structure of updates: .*\['fc'\]"):
        tx.update(PARAMS, state, {"conv": PARAMS["conv"]})


# ---------------------------------------------------------------- partition


def test_partition_sends_each_group_to_its_transform():
    """Like torch.optim parameter groups: matrices get AdamW, vectors SGD with momentum."""
    labels = ft.tree.map(lambda x: "decay" if x.dim() > 1 else "plain", PARAMS)
    txs = {"decay": ft.adamw(0.01, weight_decay=0.1), "plain": ft.sgd(0.1, momentum=0.9)}
    tx = ft.partition(txs, lambda p: ft.tree.map(lambda x: "decay" if x.dim() > 1 else "plain", p))
    state = tx.init(PARAMS)
    assert set(state) == {"decay", "plain"}
    keep = {name: ft.tree.map(lambda lab: lab == name, labels) for name in txs}
    refs = {name: t.init(sub(PARAMS, keep[name])) for name, t in txs.items()}
    for i in range(3):
        g = grads_at(i)
        s0 = clone_tree(state)
        updates, new_state = tx.update(g, state, PARAMS)
        assert_tree_bitwise_equal(state, s0)
        state = new_state
        for name, t in txs.items():
            ref_u, refs[name] = t.update(sub(g, keep[name]), refs[name], sub(PARAMS, keep[name]))
            for u, r, k in zip(ft.tree.leaves(updates), _full_leaves(ref_u, keep[name]), ft.tree.leaves(keep[name])):
                if k:
                    assert torch.equal(u, r)
    for name in txs:
        assert_tree_bitwise_equal(state[name], refs[name])


def _full_leaves(sub_tree, keep):
    """Leaves of a sub-tree in the full tree's positions (None where not kept)."""
    return optree.tree_structure(keep).flatten_up_to(sub_tree)


def test_partition_errors():
    with pytest.raises(TypeError, match="non-empty dict"):
        ft.partition({}, {})
    tx = ft.partition({"a": ft.sgd(0.1)}, ft.tree.map(lambda x: "b", PARAMS))
    with pytest.raises(ValueError, match=r"param_labels leaf at \['conv'\]\['bias'\] is 'b', which is not a key"):
        tx.init(PARAMS)
    tx = ft.partition({"a": ft.sgd(0.1)}, ft.tree.map(lambda x: "a", PARAMS))
    state = tx.init(PARAMS)
    with pytest.raises(TypeError, match=r"state must be a dict with keys \[\"'a'\"\] \(the state partition's init"):
        tx.update(PARAMS, {"b": state["a"]}, PARAMS)
    with pytest.raises(TypeError, match="state must be a dict with keys .* got tuple"):
        tx.update(PARAMS, (state["a"],), PARAMS)
    with pytest.raises(ValueError, match=r"param_labels must have the structure .*: leaf 0 is at \['conv'\]"):
        ft.partition({"a": ft.sgd(0.1)}, {"conv": "a", "fc": "a"}).init(PARAMS)
    with pytest.raises(ValueError, match=r"params does not have the tree structure of updates: .*\['fc'\]"):
        tx.update(PARAMS, state, {"conv": PARAMS["conv"]})
