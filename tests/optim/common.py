"""Trees and a purity-checking runner shared by the optim tests."""

from __future__ import annotations

import torch

import functopk as ft
from tests.helpers import assert_tree_bitwise_equal, clone_tree

PARAMS = {"w": torch.tensor([1.0, -2.0, 3.0]), "b": torch.tensor(0.5, dtype=torch.float64)}
GRADS = {"w": torch.tensor([0.5, 0.25, -1.0]), "b": torch.tensor(2.0, dtype=torch.float64)}


def run_pure(tx, params=PARAMS, grads=GRADS, steps=3):
    """Run a few updates, checking that no input is modified; return the final updates and state."""
    state = tx.init(params)
    for _ in range(steps):
        p0, g0, s0 = clone_tree(params), clone_tree(grads), clone_tree(state)
        updates, new_state = tx.update(grads, state, params)
        assert_tree_bitwise_equal(params, p0)
        assert_tree_bitwise_equal(grads, g0)
        assert_tree_bitwise_equal(state, s0)
        assert ft.tree.map(lambda a: (a.shape, a.dtype), new_state) == ft.tree.map(lambda a: (a.shape, a.dtype), state)
        state = new_state
    return updates, state


def grads_at(i, like=PARAMS):
    g = torch.Generator().manual_seed(100 + i)
    return ft.tree.map(lambda p: torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.dtype), like)
